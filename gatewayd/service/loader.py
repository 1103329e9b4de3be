"""Loading: one loader task per model makes room and starts its engine.

A model whose engine is not ready gets a loader when its first request queues
(the queue itself is in turns.py). Loaders stand in one line, in the order they
were created (FIFO across models). Each asks the pure scheduler
(core.scheduler.plan_start) what to do with a fresh snapshot and carries out the
answer: start; evict one victim and wait for its memory to show as free; mark
one draining (it is evicted once it serves nobody); or wait for a change. Every
wait is bounded: eviction_wait_s for room, load_timeout_s for the load. What can
be checked of the start before it runs (the engine server, the model's files) is
checked before the first decision: a start that cannot happen evicts nobody.

A victim is stopped through EngineManager.stop, which serialises it with any
start of the same model: a victim's own loader can start it again only once
its unit is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable

from gatewayd.core import scheduler
from gatewayd.core.budget import insufficient_gpu, insufficient_ram, model_need_mib
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engines import COMING_STATES, EngineState
from gatewayd.core.errors import (
    AlreadyRunning,
    EngineFailed,
    EngineLimitReached,
    EngineNotRunning,
    GatewayError,
)
from gatewayd.core.placement import Placement, total
from gatewayd.core.ports import GpuProbe
from gatewayd.core.priority import NORMAL, aged, turn_bound_s
from gatewayd.core.waits import SERVED_NOBODY, Swap, room_rule
from gatewayd.service.engine_manager import EngineManager
from gatewayd.service.turns import Turns

log = logging.getLogger("gatewayd.dispatcher")
MEMORY_SETTLE_S = 10.0   # how long a stopped engine's GPU memory may take to show as free
MEMORY_POLL_S = 0.1
CHANGE_POLL_S = 1.0   # a wait for a change also re-checks this often (nothing is missed)
LOOK_AGAIN_S = 0.01   # never spin: a retry always yields to the event loop first


class WakeUp:
    """Wakes whoever waits for "something changed" (an engine state, a place freed)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._future: asyncio.Future[None] | None = None

    def notify(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)
        self._future = None

    async def wait(self, deadline: float) -> None:
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._future),
                                   max(0.01, min(CHANGE_POLL_S, deadline - self._clock())))


class Loader:
    def __init__(self, engines: EngineManager, *, catalog: Catalog, gpu: GpuProbe,
                 config: GatewayConfig,
                 turns: Turns, usages: Callable[[], list[scheduler.Usage]],
                 wake_up: WakeUp, clock: Callable[[], float]) -> None:
        self._engines = engines
        self._catalog = catalog
        self._gpu = gpu
        self._config = config
        self._turns = turns
        self._usages = usages
        self._wake_up = wake_up
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._line: list[str] = []        # models whose loaders want room, oldest first
        self._asked: dict[str, float] = {}   # when each joined the line
        self._room_made: list[str] = []      # models an engine was evicted or drained for
        self._drains: dict[str, Swap] = {}   # draining engines: for whom, and why
        self.swaps: dict[str, Swap] = {}     # evicted engines: why each last gave its place
        self._limit_task: asyncio.Task[None] | None = None

    def ensure(self, model: Model) -> None:
        """A loader for model, unless one runs already."""
        if model.id not in self._tasks:
            self._line.append(model.id)
            self._asked[model.id] = self._clock()
            self._tasks[model.id] = asyncio.get_running_loop().create_task(self._load(model))

    @property
    def grouped(self) -> bool:
        return self._config.schedule == "grouped"

    def _want(self, model_id: str, now: float) -> scheduler.Want:
        """model_id in the line, as its order sees it: its waiting requests' age and
        class (aged by how long each waited)."""
        use = self._turns.peek(model_id)
        waiters = list(use.waiters) if use is not None else []
        model = self._catalog.get(model_id)
        max_wait = self._config.max_wait_for(model.config if model is not None else None)
        aging = self._config.priority_aging_s
        return scheduler.Want(
            model_id, self._asked.get(model_id, now),
            min((w.since for w in waiters), default=None), len(waiters),
            max((aged(w.priority, now - w.since, aging) for w in waiters), default=NORMAL),
            max_wait, room_made=self._room_made.index(model_id)
            if model_id in self._room_made else None, draining=self._draining(model_id),
            turn_by=min((w.since + turn_bound_s(w.priority, max_wait, aging)
                         for w in waiters), default=None))

    def line(self) -> list[scheduler.Want]:
        """The models waiting for room, head first (core/scheduler.line_order: grouped,
        within a class the room made goes to its model, and a model whose engine drains
        goes behind). A draining model at the head all the same (a request of a higher
        class came for it) has its drain undone by its loader."""
        now = self._clock()
        return scheduler.line_order((self._want(m, now) for m in self._line),
                                    grouped=self.grouped, now=now)

    def _made_room(self, model_id: str) -> None:
        if model_id not in self._room_made:
            self._room_made.append(model_id)

    def _draining(self, model_id: str) -> bool:
        engine = self._engines.get(model_id)
        use = self._turns.peek(model_id)
        return engine is not None and engine.state is EngineState.READY and \
            use is not None and use.draining

    def _ahead(self, model_id: str) -> list[str]:
        """Models before model_id in the line that still need room."""
        ahead = []
        for other in (w.model_id for w in self.line()):
            if other == model_id:
                break
            engine = self._engines.get(other)
            use = self._turns.peek(other)
            if engine is None or not engine.holds_place or engine.state is EngineState.STOPPING \
                    or (engine.state is EngineState.READY and use is not None and use.draining):
                ahead.append(other)
        return ahead

    def _ahead_ram_mib(self, ahead: list[str]) -> int:
        models = (self._catalog.get(m) for m in ahead)
        return sum(self._engines.need(m).ram_mib for m in models if m is not None)

    def reconfigure(self, config: GatewayConfig) -> None:
        self._config = config

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *([self._limit_task] if self._limit_task else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- one model's loader ----------------------------------------------------------

    async def _load(self, model: Model) -> None:
        error: BaseException | None = None
        try:
            await self._make_room_and_start(model)
        except GatewayError as e:
            error = e
        except Exception as e:  # every waiter must hear about it
            log.exception("loading %s failed", model.id)
            error = EngineFailed(f"loading {model.id!r} failed: {e}", model=model.id)
        finally:
            self._tasks.pop(model.id, None)
            self._asked.pop(model.id, None)
            with contextlib.suppress(ValueError):
                self._room_made.remove(model.id)
            with contextlib.suppress(ValueError):
                self._line.remove(model.id)
            for use in self._turns.uses().values():   # room no longer wanted
                if use.draining_for == model.id:
                    use.draining_for = None
            self._wake_up.notify()
        self._turns.wake(model.id, error)

    async def _make_room_and_start(self, model: Model) -> None:
        needs = self._engines.need(model)
        need = needs.vram_mib
        self._engines.check_ram_ceiling(model)   # never fits: said at once
        # grouped, room may wait for the model's turn first: max_wait_s, then the drain;
        # a turn that lasts longer (a lower class than the busy engines' traffic waits to
        # be aged: Want.turn_by) moves the deadline, so room keeps its eviction_wait_s
        began = self._clock()
        deadline = began + self._config.eviction_wait_s + (
            self._want(model.id, began).max_wait_s if self.grouped else 0.0)
        engines = self._engines
        checked = False
        while True:
            if not self._turns.queued(model.id):
                return   # every client left: nothing to make room for
            if self._clock() >= deadline + self._config.load_timeout_s:
                waited = self._clock() - began
                raise EngineFailed(f"{model.id!r} was not ready within {waited:.0f}s",
                                   retry_after=5, model=model.id)
            engine = engines.get(model.id)
            use = self._turns.get_or_add(model.id)
            if engine is not None and engine.state is EngineState.READY:
                if not use.draining:
                    return
                if self.grouped and self.line()[0].model_id == model.id:
                    # a request of a higher class came for the engine being drained for a
                    # lower one: the drain is undone, its engine serves it
                    log.info("%s is no longer drained: its own requests come first", model.id)
                    use.draining_for = None
                    self._wake_up.notify()
                    return
                await self._wait(deadline, model, "its engine is being evicted")
                continue
            if engine is not None and engine.state in COMING_STATES:
                try:
                    # someone else started it, or systemd restarts it
                    await engines.wait_ready(model.id)
                    return
                except EngineNotRunning:   # stopped meanwhile: look again (never spin)
                    await asyncio.sleep(LOOK_AGAIN_S)
                    continue
            if engines.busy(model.id) or (engine is not None and (
                    engine.state is EngineState.STOPPING or engine.exit_unconfirmed)):
                await self._wait(deadline, model, "its engine is stopping")
                continue
            if (left := engines.backoff_left(model.id)) > 0:
                raise engines.failed_error(model.id, retry_after=math.ceil(left))
            if not checked:   # a start that cannot happen must evict nobody first
                try:
                    engines.check_startable(model)
                except GatewayError as e:
                    log.warning("%s cannot start: %s", model.id, e.message)
                    raise
                checked = True
            where = engines.place(model)
            ram = engines.ram(model)
            usages = self._usages()
            ahead = self._ahead(model.id)
            want = self._want(model.id, self._clock())
            decision = scheduler.plan_start(
                model.id, usages, max_engines=self._config.max_engines, need_mib=need,
                free_mib=None if where is None else where.free_mib, ahead=len(ahead),
                devices=None if where is None else frozenset(where.uuids),
                ram_need_mib=needs.ram_mib,
                ram_free_mib=None if ram is None else ram.plan_free_mib,
                ahead_ram_mib=self._ahead_ram_mib(ahead) if ahead and ram else 0,
                grouped=self.grouped, overdue=want.overdue(self._clock()),
                priority=want.priority, now=self._clock())
            match decision:
                case scheduler.TryAnyway() if self._memory_coming_back():
                    # an engine just went away: its memory may not show as free yet, so
                    # what looks like "does not fit even alone" may fit in a moment
                    await asyncio.sleep(MEMORY_POLL_S)
                case scheduler.Fits() | scheduler.TryAnyway():
                    if isinstance(decision, scheduler.TryAnyway):
                        log.info("%s: %d MiB needed by estimate, more than is free with "
                                 "nothing else running; trying anyway", model.id, need)
                    try:
                        await engines.start(model.id, force=isinstance(
                            decision, scheduler.TryAnyway))
                    except (AlreadyRunning, EngineNotRunning):
                        # started by someone else, or stopped meanwhile: look again
                        await asyncio.sleep(LOOK_AGAIN_S)
                        continue
                    return
                case scheduler.Evict(victim, reason, why):
                    self._made_room(model.id)
                    self.swaps[victim] = self._swap(victim, model.id, want)
                    await self._evict(victim, reason, room_for=need, evicted_for=model.id,
                                      why=why)
                case scheduler.Drain(victim, reason):
                    log.info("draining %s (%s)", victim, reason)
                    rule = room_rule(drained=True, grouped=self.grouped,
                                     priority=want.priority, overdue=want.overdue(self._clock()),
                                     victim_priority=next((u.priority for u in usages
                                                           if u.model_id == victim), NORMAL))
                    self._drains[victim] = Swap(victim, model.id, self._waited(want), rule)
                    self._turns.get_or_add(victim).draining_for = model.id
                    self._made_room(model.id)
                case scheduler.Wait(why, turn=True) if want.turn_by is not None:
                    # the order's own rules end a turn (overdue, then aged to the highest
                    # class by turn_by); the poll's interval is its slack
                    deadline = max(deadline, self._clock() + self._config.eviction_wait_s)
                    await self._wait(want.turn_by + 2 * CHANGE_POLL_S, model, why)
                case scheduler.Wait(why):
                    await self._wait(deadline, model, why)
                case scheduler.Blocked(limit, holders):
                    if self._clock() >= deadline:
                        if limit == "ram" and ram is not None:
                            raise insufficient_ram(
                                model.id, needs.ram_mib, ram, retry_after=5,
                                running=[m for m, _ in holders],
                                held_by=", ".join(f"{m} ({why})" for m, why in holders),
                                prefix="not enough RAM within "
                                f"{self._waited_s(model.id):.0f}s: ")
                        raise self._no_room(model, limit, holders, need, where)
                    await self._wake_up.wait(deadline)

    def _swap(self, victim: str, model_id: str, want: scheduler.Want) -> Swap:
        """Why victim gives its place to model_id: the rule its drain was for, or (it
        serves nobody) that."""
        use = self._turns.peek(victim)
        drained = self._drains.pop(victim, None)
        if drained is not None and drained.model == model_id and use is not None \
                and use.draining_for == model_id:
            return drained
        return Swap(victim, model_id, self._waited(want), SERVED_NOBODY)

    def _waited(self, want: scheduler.Want) -> float:
        """How long the oldest request of the model wanting room has waited."""
        return 0.0 if want.oldest_at is None else max(0.0, self._clock() - want.oldest_at)

    def _waited_s(self, model_id: str) -> float:
        """How long model_id's oldest waiting request has waited: what a refusal says."""
        return self._waited(self._want(model_id, self._clock()))

    def _memory_coming_back(self) -> bool:
        released = self._engines.last_release
        return released is not None and self._clock() - released < MEMORY_SETTLE_S

    async def _wait(self, deadline: float, model: Model, why: str) -> None:
        if self._clock() >= deadline:
            holders = tuple(
                (u.model_id, (u.why_not_evictable() or "idle")
                 + (", draining" if u.draining else ""))
                for u in self._usages() if u.holds_place and u.model_id != model.id)
            raise self._no_room(model, "engine_limit", holders, 0, None, why=why)
        await self._wake_up.wait(deadline)

    def _no_room(self, model: Model, limit: str, holders: tuple[tuple[str, str], ...],
                 need: int, where: Placement | None, why: str | None = None) -> GatewayError:
        held = ", ".join(f"{m} ({why})" for m, why in holders) or "nobody"
        wait_s = self._waited_s(model.id)
        if limit == "engine_limit" or where is None:
            return EngineLimitReached(
                f"no engine place for {model.id!r} within {wait_s:.0f}s"
                + (f" ({why})" if why else "") + ": max_engines is "
                f"{self._config.max_engines}, held by {held}",
                retry_after=5, running=[m for m, _ in holders])
        return insufficient_gpu(model.id, need, where, running=[m for m, _ in holders],
                                retry_after=5, held_by=held,
                                prefix=f"not enough GPU memory within {wait_s:.0f}s: ")

    async def _evict(self, victim: str, reason: str, room_for: int | None = None, *,
                     evicted_for: str | None = None, why: str = "") -> None:
        """Stop the victim; then wait (up to MEMORY_SETTLE_S) until its memory shows as free
        or room_for MiB are free, whichever comes first: room enough already (a count-only
        eviction, or a victim whose process was gone before its stop: stopped behind our
        back, crashed) is no reason to wait for memory that will not show up again."""
        before = self._room()
        log.info("evicting %s (%s)", victim, reason)
        try:
            await self._engines.stop(victim, reason=eviction_reason(victim, evicted_for, why),
                                     evicted_for=evicted_for)
        except EngineNotRunning:
            pass
        except GatewayError as e:
            log.warning("evicting %s failed: %s", victim, e.message)
        finally:
            if (use := self._turns.peek(victim)) is not None:
                use.draining_for = None
        if before is not None:   # wait until its memory really shows as free
            model = self._catalog.get(victim)
            expect = (self._engines.measured_mib(model) or model_need_mib(model, 0)) \
                if model else 0
            deadline = self._clock() + MEMORY_SETTLE_S
            while self._clock() < deadline:
                now = self._room()
                if now is None or now >= before + expect * 0.9 or (
                        room_for is not None and now >= room_for):
                    break
                await asyncio.sleep(MEMORY_POLL_S)

    def _room(self) -> int | None:
        """Free GPU memory less what loads in progress will still take (may be negative):
        it rises by what a stopped engine held, even while another engine loads."""
        devices = self._gpu.devices()
        if devices is None:
            return None
        ledger = scheduler.memory_ledger(*total(devices), self._usages())
        return ledger.free_mib - ledger.pending_mib

    # -- more engines than max_engines (found by the reconciler) ------------------------

    def enforce_limit(self) -> None:
        if self._limit_task is None or self._limit_task.done():
            self._limit_task = asyncio.get_running_loop().create_task(self._enforce_limit())

    async def _enforce_limit(self) -> None:
        deadline = self._clock() + self._config.eviction_wait_s
        while self._clock() < deadline:
            usages = self._usages()
            holders = [u for u in usages if u.holds_place]
            if len(holders) <= self._config.max_engines:
                return
            victims = sorted((u for u in holders if u.why_not_evictable() is None),
                             key=lambda u: u.last_used)
            if victims:
                await self._evict(victims[0].model_id, "more engines than max_engines",
                                  why="more engines than max_engines")
            else:
                await self._wake_up.wait(deadline)


def eviction_reason(victim: str, evicted_for: str | None, why: str) -> str:
    """A victim's stop reason, what the events and the log say: always "evicted" first
    (the metrics' reason), then for whom and why, e.g. "evicted for 'b' (needs 300 MiB of
    GPU memory, 120 MiB free; 'a' least recently used)". Victims are chosen among the
    engines that serve nobody, least recently used first (grouped: of the lowest class,
    core/scheduler)."""
    if evicted_for is None:
        return f"evicted ({why})" if why else "evicted"
    because = f"{why}; " if why else ""
    return f"evicted for {evicted_for!r} ({because}{victim!r} least recently used)"
