"""On-demand scheduling: who gets an engine, who waits, who makes room.

The request path: a ready engine that is not draining → take a turn (turns.py;
429 above max_concurrency). Otherwise the request waits in its model's queue
(FIFO, 503 above the queue limit) while that model's one loader (loader.py)
makes room and starts the engine; the loader wakes the queue with the result.
A waiter whose client leaves just leaves the queue. Idle engines past their
TTL are stopped by the reaper (reaper.py). A wait is timed by what it waited for
(core/waits: room, load, queue, as its engine's state changes) and, once over, told to
the wait listeners (the metrics); a request that did not wait costs nothing more.

Taking a turn and choosing a victim are both synchronous: a request that was
handed an engine keeps it until it releases it, because a victim must serve
nobody at the moment it is chosen, and from that moment (its stop marks it
`stopping` before any await) no request is handed it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from gatewayd.core import scheduler
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engines import COMING_STATES, Engine, EngineState
from gatewayd.core.errors import EngineUnavailable, GatewayError, ModelNotLoaded
from gatewayd.core.ports import GpuProbe
from gatewayd.core.priority import NAMES, NORMAL
from gatewayd.core.waits import ROOM, Swap, Waited, near_miss, reason_of
from gatewayd.service.loader import LoadedEngines, Loader
from gatewayd.service.reaper import IdleReaper
from gatewayd.service.turns import QueueListener, Turns, Use
from gatewayd.service.wake_up import WakeUp

WaitListener = Callable[[Waited], None]
T = TypeVar("T")
# a caller's way of waiting for a turn (http/waiting tells a stream why it waits): the
# wait, and what gives back a turn taken just as the caller gave up
WaitFor = Callable[[Awaitable[Engine], Callable[[Engine], object]], Awaitable[Engine]]
log = logging.getLogger("gatewayd.dispatcher")


class DispatchedEngines(LoadedEngines, Protocol):
    """What the dispatcher asks of the engines (service/engine_manager has it): the
    loaders' parts (the engines and their changes, starts and stops, room), nothing more."""

class Dispatcher:
    def __init__(self, engines: DispatchedEngines, *, catalog: Catalog, gpu: GpuProbe,
                 config: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._engines = engines
        self._catalog = catalog
        self._gpu = gpu
        self._config = config
        self._clock = clock
        self._turns = Turns(clock)
        self._wake_up = WakeUp(clock)
        self._loader = Loader(engines, catalog=catalog, gpu=gpu, config=config,
                              turns=self._turns, usages=self.usages, wake_up=self._wake_up,
                              clock=clock)
        self._reaper = IdleReaper(engines, catalog, self.usages, clock)
        self._wait_listeners: list[WaitListener] = []
        engines.registry.subscribe(self._on_engine_change)

    # -- the request path ----------------------------------------------------------

    async def journey(self, model_id: str, send: Callable[[Engine], Awaitable[T]], *,
                      autoload: bool, counts_as_use: bool = True, priority: int = NORMAL,
                      client: str | None = None, wait: WaitFor | None = None,
                      no_turn: Callable[[GatewayError], Awaitable[T]] | None = None) -> T:
        """A request's whole journey to model_id's engine, in one scope: its turn taken
        (queued; the engine loaded where autoload), send(engine), and the turn given back
        however it ends. A request the engine's socket refused before it reached any
        process (the engine had just died, and systemd restarts it) waits for the
        restarted engine like any other and is sent to it, once. wait: the wait for the
        turn, as the caller tells it (http/waiting); no_turn: the answer where no turn
        could be had (spill-over to a remote upstream), else that error is raised; client:
        who asks (core/scheduler's grace: a lone client switching models is not held)."""
        for last in (False, True):
            try:
                engine = await self._take(model_id, autoload, counts_as_use, priority, wait,
                                          client)
            except GatewayError as e:
                if no_turn is None:
                    raise
                return await no_turn(e)
            try:
                return await send(engine)
            except EngineUnavailable as e:
                refused = e
            finally:
                self.release(model_id, counts_as_use=counts_as_use, priority=priority)
            if last or not refused.reached_no_process or not await self.coming_back(engine):
                raise refused
            log.info("%s: its engine's socket is shut and systemd restarts it: the request "
                     "waits for it", model_id)
        raise AssertionError("a journey ends in an answer or an error")   # pragma: no cover

    @contextlib.asynccontextmanager
    async def serve(self, model_id: str, *, autoload: bool, counts_as_use: bool = True,
                    priority: int = NORMAL, wait: WaitFor | None = None,
                    client: str | None = None) -> AsyncIterator[Engine]:
        """A turn at model_id's engine for the scope, given back when it ends. wait: the
        wait for the turn as the caller tells it; its undo gives back a turn taken just
        as the caller gave up."""
        engine = await self._take(model_id, autoload, counts_as_use, priority, wait, client)
        try:
            yield engine
        finally:
            self.release(model_id, counts_as_use=counts_as_use, priority=priority)

    async def _take(self, model_id: str, autoload: bool, counts_as_use: bool, priority: int,
                    wait: WaitFor | None, client: str | None = None) -> Engine:
        waiting = self.acquire(model_id, autoload=autoload, counts_as_use=counts_as_use,
                               priority=priority, client=client)
        if wait is None:
            return await waiting
        return await wait(waiting, lambda _: self.release(
            model_id, counts_as_use=counts_as_use, priority=priority))

    async def acquire(self, model_id: str, *, autoload: bool, counts_as_use: bool = True,
                      priority: int = NORMAL, client: str | None = None) -> Engine:
        model = self._catalog.get(model_id)
        waited: dict[str, float] = {}   # seconds per reason (core/waits), if it waits
        try:
            return await self._acquire(model_id, model, autoload=autoload,
                                       counts_as_use=counts_as_use, priority=priority,
                                       client=client, waited=waited)
        except GatewayError:
            if waited:   # answered with an error after a wait: its bound still counts
                self._waited(model_id, model, priority, waited, handed=False)
            raise

    async def _acquire(self, model_id: str, model: Model | None, *, autoload: bool,
                       counts_as_use: bool, priority: int, client: str | None,
                       waited: dict[str, float]) -> Engine:
        while True:
            engine = self._engines.registry.get(model_id)
            use = self._turns.get_or_add(model_id)
            if engine is not None and engine.state is EngineState.READY and (
                    not use.draining or not autoload):
                self._turns.take(model_id, limit=model.config.max_concurrency if model
                                 else None, counts_as_use=counts_as_use, priority=priority,
                                 client=client)
                if waited:
                    self._waited(model_id, model, priority, waited, handed=True)
                return engine
            state = engine.state.value if engine else EngineState.STOPPED.value
            if not autoload or model is None:
                raise ModelNotLoaded(
                    f"model {model_id!r} is not loaded (engine {state})"
                    + ("" if model else "; it is not in the catalog, so it cannot be loaded"),
                    param="model", model=model_id, state=state,
                    # on its way (starting, loading, systemd restarting it): ask again soon
                    retry_after=1 if engine is not None and engine.state in COMING_STATES
                    else None)
            limit = model.config.queue_limit
            waiter = self._turns.enqueue(
                model_id, self._config.queue_limit if limit is None else limit, priority,
                reason_of(engine.state if engine else None, use.draining), client)
            self._loader.ensure(model)
            try:
                await waiter.future   # room made and engine ready (take a turn above), or why not
            finally:
                self._turns.leave(model_id, waiter)
                for reason, spent in waiter.wait.end(self._clock()).items():
                    waited[reason] = waited.get(reason, 0.0) + spent

    def _waited(self, model_id: str, model: Model | None, priority: int,
                parts: dict[str, float], *, handed: bool) -> None:
        """A wait is over: tell the listeners (the metrics), with how its wait for the
        model's turn stood against max_wait_s."""
        max_wait = self._config.max_wait_for(model.config if model is not None else None)
        done = Waited(model_id, priority, parts, handed,
                      near_miss(parts.get(ROOM, 0.0), max_wait))
        for listener in list(self._wait_listeners):
            listener(done)

    async def coming_back(self, engine: Engine) -> bool:
        """Whether the engine, whose socket refused a request that reached no process, is
        on its way back (systemd restarting it), so that the request may wait for it."""
        return await self._engines.lifecycle.coming_back(engine.model_id, engine.main_pid)

    def release(self, model_id: str, *, counts_as_use: bool = True,
                priority: int = NORMAL) -> None:
        if self._turns.release(model_id, counts_as_use=counts_as_use, priority=priority):
            self._wake_up.notify()

    # -- state ---------------------------------------------------------------------------

    def usages(self) -> list[scheduler.Usage]:
        per_process = self._gpu.process_mib()
        rows = []
        for engine in self._engines.registry.engines():
            use = self._turns.peek(engine.model_id)
            model = self._catalog.get(engine.model_id)
            rows.append(scheduler.Usage(
                model_id=engine.model_id, state=engine.state,
                in_flight=use.in_flight if use else 0,
                queued=len(use.waiters) if use else 0,
                pinned=bool(model and model.config.pin),
                last_used=(use.last_used if use else 0.0) or (engine.ready_since or 0.0),
                estimate_mib=self._engines.capacity.need_mib(model) if model else 0,
                measured_mib=per_process.get(engine.main_pid) if per_process is not None
                else None,
                idle_ttl_s=model.config.idle_ttl_s if model else None,
                draining=bool(use and use.draining),
                exit_unconfirmed=engine.exit_unconfirmed,
                devices=engine.devices,
                priority=_class_of(use, model),
                sole_client=use.sole_client if use else None))
        return rows

    def schedule(self) -> dict[str, Any]:
        """The order for room at a glance: its rule, its bound, and the models waiting for
        room, head first (what /admin/status and `llm-gateway top` show)."""
        now = self._clock()
        return {
            "order": self._config.schedule, "max_wait_s": self._config.max_wait_s,
            "priority_aging_s": self._config.priority_aging_s,
            "line": [{"model": w.model_id, "waiting": w.waiting,
                      "waited_s": round(now - w.oldest_at, 3) if w.oldest_at is not None
                      else None, "priority": NAMES[w.priority],
                      "overdue": w.overdue(now), "max_wait_s": w.max_wait_s}
                     for w in self._loader.line()]}

    def queue_depths(self) -> dict[str, int]:
        """Per model with requests queued for a turn, how many: a model with no engine yet
        (waiting for room for its first) included, which usages() lists no row for."""
        return {m: len(u.waiters) for m, u in self._turns.uses().items() if u.waiters}

    def requests(self, model_id: str) -> int:
        """How many requests model_id's engine serves or has queued for a turn."""
        use = self._turns.peek(model_id)
        return 0 if use is None else use.in_flight + len(use.waiters)

    def has_requests(self, model_id: str) -> bool:
        """Whether model_id has requests in flight or queued for a turn."""
        use = self._turns.peek(model_id)
        return use is not None and (use.in_flight > 0 or bool(use.waiters))

    def subscribe_queue(self, listener: QueueListener) -> Callable[[], None]:
        """listener(model, depth) whenever a model's queue depth changes."""
        return self._turns.subscribe(listener)

    def subscribe_waits(self, listener: WaitListener) -> Callable[[], None]:
        """listener(waited) whenever a request's wait for its engine is over: handed one,
        or answered with an error (core/waits.Waited). Not for a request that never
        waited, nor one whose client left."""
        self._wait_listeners.append(listener)
        return lambda: self._wait_listeners.remove(listener)

    def swap(self, victim: str) -> Swap | None:
        """Why victim's engine was last evicted for a waiting model (None: it was not)."""
        return self._loader.swaps.get(victim)

    def enforce_limit(self) -> None:
        """More engines than max_engines (the reconciler found some): evict the surplus."""
        self._loader.enforce_limit()

    def _on_engine_change(self, old: Engine, new: Engine) -> None:
        if old.state is new.state and old.holds_place == new.holds_place:
            return   # (a place freed without a change of state: an exit confirmed, a stop done)
        use = self._turns.peek(new.model_id)
        if new.state is EngineState.READY:
            use = self._turns.get_or_add(new.model_id)
            use.last_used = use.last_used or self._clock()
        elif use is not None and old.state is EngineState.READY:
            use.draining_for = None   # it left service: nothing more to drain
        if use is not None and use.waiters:   # what its waiters wait for now
            self._turns.waiting_for(new.model_id, reason_of(new.state, use.draining))
        self._wake_up.notify()

    # -- lifecycle -----------------------------------------------------------------------

    async def reconfigure(self, config: GatewayConfig) -> None:
        """A reloaded configuration (the catalog is replaced in place by the reloader):
        queue limits, waits and budgets from now on; the idle reaper restarts, as the
        models' TTLs may have changed."""
        self._config = config
        self._loader.reconfigure(config)
        await self._reaper.close()
        self._reaper.start()

    def start_timers(self) -> None:
        self._reaper.start()

    async def reap_idle(self) -> list[str]:
        return await self._reaper.reap()

    async def close(self) -> None:
        await self._reaper.close()
        await self._loader.close()


def _class_of(use: Use | None, model: Model | None) -> int:
    """An engine's class for the scheduler: the highest among the requests it serves and
    those waiting for it; idle, its model's."""
    found = use.top_class() if use is not None else None
    if found is not None:
        return found
    return model.config.priority if model is not None else NORMAL
