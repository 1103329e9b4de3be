"""One lifecycle at a time per model: start, stop, kill, and what follows a change.

Decisions (admission, state transitions) are synchronous calls into the pure
core (`budget`, `engines`); only the effects await (D-Bus, /health, journal).

A start and a stop of the same model never overlap. Each takes the model's
lifecycle lock (FIFO) around its effect, so the next StartTransientUnit for a
unit name is sent only once the previous instance's stop job is done and the
unit is gone (systemd refuses to create a transient unit whose name is still
loaded). A stop marks the engine `stopping` *before* it waits for the lock, so
from that moment no request is handed the engine; a start checks admission only
once it holds the lock, so it sees what the stop left. Within the lock,
admission and registration do not await, so two starts of different models
cannot both take the last place.

State comes from three sources, all turned into `engines` events in the
registry (service/engine_registry.py):
- systemd's PropertiesChanged signals → UnitChanged;
- the readiness poller while starting/loading → HealthReady / LoadTimedOut;
- the journal, read once when an engine fails → LogsRead (service/failure_logs.py).
and, for what signals cannot say (a unit started or removed while we were not
looking), the reconciler's listings (service/restore.py) → `take_over`/`observe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from gatewayd.core.catalog import Catalog, Model, health_of
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engines import (
    COMING_STATES,
    Engine,
    EngineState,
    HealthReady,
    LoadTimedOut,
    StartFailed,
    StartRequested,
    StopRequested,
    UnitGone,
    Unresponsive,
)
from gatewayd.core.errors import (
    EngineNotRunning,
    GatewayError,
    ModelDownloading,
    ModelNotFound,
    UnitAlreadyActive,
)
from gatewayd.core.ports import (
    DesiredList,
    EngineUnitInfo,
    HealthProbe,
    UnitControl,
)
from gatewayd.service.engine_capacity import EngineCapacity
from gatewayd.service.engine_hooks import EngineHooks
from gatewayd.service.engine_registry import EngineRegistry
from gatewayd.service.failure_logs import FailureLogs
from gatewayd.service.memory_watch import MemoryWatch
from gatewayd.service.park_queue import ParkQueue
from gatewayd.service.readiness import Readiness

log = logging.getLogger("gatewayd.engines")
READY_GRACE_S = 5.0        # a waiter's deadline beyond load_timeout_s


def configured(catalog: Catalog, model_id: str) -> Model:
    """The catalog's model of that id; ModelNotFound (404) names those there are."""
    model = catalog.get(model_id)
    if model is None:
        raise ModelNotFound(f"model {model_id!r} does not exist", param="model",
                            available_models=catalog.ids)
    if not model.config.downloaded:   # its engine would have no file to load
        raise ModelDownloading(f"model {model_id!r} is not downloaded yet: a request for it "
                               f"pulls it from {model.config.source} (or `llm-gateway pull "
                               f"{model.config.source} --name {model_id}`)", param="model",
                               retry_after=10)
    return model


class EngineLifecycle:
    def __init__(self, *, catalog: Catalog, config: GatewayConfig, units: UnitControl,
                 health: HealthProbe, desired: DesiredList, hooks: EngineHooks,
                 registry: EngineRegistry, capacity: EngineCapacity, logs: FailureLogs,
                 clock: Callable[[], float]) -> None:
        self._catalog = catalog
        self._config = config
        self._units = units
        self._desired = desired
        self._hooks = hooks
        self._registry = registry
        self._capacity = capacity
        self._logs = logs
        self._clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._in_lifecycle: dict[str, int] = {}     # operations holding or awaiting the lock
        self._tasks: set[asyncio.Task[None]] = set()
        self.stop_reasons: dict[str, str] = {}   # why each engine was last stopped
        self.evicted_for: dict[str, str] = {}    # the model each last eviction made room for
        self._readiness = Readiness(health, load_timeout_s=config.load_timeout_s, clock=clock,
                                    engine=registry.get, on_ready=self._on_ready,
                                    on_timeout=self._on_load_timeout,
                                    ready_when=lambda model_id: health_of(catalog, model_id))
        self._parking = ParkQueue(units, catalog, registry, quiet=self._quiet,
                                  lock=self._lock)
        self._memory = MemoryWatch(catalog=catalog, units=units, registry=registry,
                                   capacity=capacity, clock=clock, info=self.info,
                                   lifecycle=self._lifecycle)
        registry.react_with(self._react)

    def reconfigure(self, config: GatewayConfig) -> None:
        self._config = config
        self._readiness.reconfigure(config.load_timeout_s)

    def busy(self, model_id: str) -> bool:
        """A start or stop of this model is under way (or waiting for its turn)."""
        return self._in_lifecycle.get(model_id, 0) > 0

    # -- start / stop / kill ---------------------------------------------------------

    async def start(self, model_id: str, *, wait: bool = True, force: bool = False) -> Engine:
        """Start a model's engine; with wait, return once it is ready (or raise).

        force skips the VRAM estimate (the scheduler's "nothing else is running,
        try anyway"); the engine limit and one-instance rule always hold.
        """
        model = configured(self._catalog, model_id)
        async with self._lifecycle(model.id):
            where = self._capacity.admit(model, force=force)
            self.stop_reasons.pop(model.id, None)
            self.evicted_for.pop(model.id, None)
            layout = self._units.layout(model.id)
            self._capacity.note_start(model.id)
            self._registry.register(Engine(
                model.id, layout.unit, layout.socket, devices=where.uuids if where else (),
                adapters=tuple(a.name for a in model.config.adapters)))
            self._registry.event(model.id, StartRequested(self._clock()))
            visible = where.visible_devices() if where else None
            log.info("starting %s as %s%s", model.id, layout.unit,
                     f" on {', '.join(f'GPU {d.index}' for d in where.devices)}"
                     if where and visible else "")
            try:
                await self._units.start_engine(model, visible)
            except UnitAlreadyActive:
                # systemd runs it already (we lost track): that is the truth, adopt it
                log.warning("%s: %s is already running; adopting it", model.id, layout.unit)
                if (info := await self._units.engine_info(layout.unit)) is not None:
                    self._registry.apply_info(model.id, info)
            except Exception as e:   # every failed effect ends in a clear state and answer
                current = self._registry.get(model.id)
                if isinstance(e, GatewayError) and current is not None and current.restarting:
                    # the start job failed because its process died, and systemd restarts
                    # it (its signals came before the job's end): a wait, like any restart
                    log.info("%s: its start job failed (%s); systemd restarts it", model.id,
                             e.message)
                    self._desired.add(model.id)
                    return await self.wait_ready(model.id) if wait else current
                reason = e.message if isinstance(e, GatewayError) else f"{type(e).__name__}: {e}"
                if not isinstance(e, GatewayError):
                    log.exception("starting %s failed", model.id)
                self._registry.event(model.id, StartFailed(self._clock(), reason))
                if settling := self._logs.settling(model.id):
                    await asyncio.shield(settling)
                raise self._registry.failed_error(model.id) from e
            self._desired.add(model.id)   # only a start that happened is wanted after a reboot
            self._readiness.watch(model.id, new_start=True)
            self._spawn(self._memory.track(model.id, layout.unit))   # off the start's path
        return await self.wait_ready(model.id) if wait else self._registry[model.id]

    def refuse_start(self, model_id: str, error: GatewayError) -> GatewayError:
        """A start that cannot happen, said before anything ran (check_startable: the
        engine server missing, the model's files unreadable): the engine failed as a
        start that failed at once would have (its state, its backoff, its 502), with no
        room made for it first."""
        if (current := self._registry.get(model_id)) is not None and current.holds_place:
            return error   # (not asked of a running engine; never touch one)
        layout = self._units.layout(model_id)
        self._registry.register(Engine(model_id, layout.unit, layout.socket))
        self._registry.event(model_id, StartRequested(self._clock()))
        self._registry.event(model_id, StartFailed(self._clock(), error.message))
        return self._registry.failed_error(model_id)

    async def wait_ready(self, model_id: str, timeout: float | None = None) -> Engine:
        """The engine once ready; its failure, its stop, or the deadline otherwise."""
        limit = self._config.load_timeout_s + READY_GRACE_S if timeout is None else timeout
        return await self._registry.wait_ready(model_id, limit)

    async def stop(self, model_id: str, *, reason: str = "requested",
                   evicted_for: str | None = None) -> Engine:
        """Stop a model's engine; returns once its unit is stopped and gone. evicted_for:
        the model an eviction makes room for (the events say it)."""
        engine = self._registry.get(model_id)
        if engine is None:
            raise EngineNotRunning(f"no engine for {model_id!r} is running", model=model_id)
        if evicted_for is None:
            self.evicted_for.pop(model_id, None)
        else:   # before the stopping mark: its event names the model
            self.evicted_for[model_id] = evicted_for
        self._desired.remove(model_id)   # not running at the next boot either
        log.info("stopping %s (%s): %s", model_id, engine.unit, reason)
        was_ready = engine.state is EngineState.READY
        self._mark_stopping(model_id, reason)
        async with self._lifecycle(model_id):
            current = self._registry.get(model_id)
            if current is None:
                return engine   # stopped by the operation before ours
            # a start that had its turn before ours ran: this stop is for that engine now
            self._mark_stopping(model_id, reason)
            if was_ready and current.main_pid == engine.main_pid:
                await self._hooks.stopping(current)   # its KV cache saved, bounded
            try:
                await self._units.stop_engine(current.unit)
            except Exception as e:
                info = await self.info(current.unit)
                if info is not None and info.active_state not in ("inactive", "failed"):
                    log.warning("stopping %s failed: %s", model_id, e)
                    self._registry.apply_info(model_id, info)
                    raise
            self._registry.event(model_id, UnitGone(self._clock()))
            stopped = self._registry.forget(model_id)
        self._parking.later(model_id)
        return stopped

    def _mark_stopping(self, model_id: str, reason: str) -> None:
        """From now on nobody is handed this engine; whoever waits for it hears why."""
        self.stop_reasons[model_id] = reason
        self._registry.event(model_id, StopRequested(self._clock()))
        self._registry.fail_waiters(model_id, EngineNotRunning(
            f"the engine for {model_id!r} was stopped ({reason})", model=model_id))

    async def kill_unresponsive(self, model_id: str, main_pid: int, silent_s: float) -> None:
        """The engine (still that process) hangs: restarting, with the reason; its unit
        killed, and systemd restarts it. Serialised with starts and stops of the model."""
        async with self._lifecycle(model_id):
            engine = self._registry.get(model_id)
            if engine is None or engine.state is not EngineState.READY \
                    or engine.main_pid != main_pid:
                return   # stopped, restarted or failed meanwhile
            log.warning("%s: no answer to /health for %gs: killing %s (PID %d) so systemd "
                        "restarts it", model_id, silent_s, engine.unit, main_pid)
            self._registry.event(model_id, Unresponsive(self._clock(), silent_s))
            try:
                await self._units.kill_engine(engine.unit)
            except Exception as e:
                # no restart is coming from this kill: what systemd says now decides (the
                # unit gone: stopped, and its waiters told, not left waiting for a restart)
                log.warning("%s: could not kill %s: %s", model_id, engine.unit, e)
                self._registry.reconcile(model_id, await self.info(engine.unit))

    async def _on_load_timeout(self, model_id: str) -> None:
        """Failed (with the reason), then its unit stopped, as one lifecycle operation,
        so a retry cannot start the unit while it is still going away."""
        self._registry.event(model_id, LoadTimedOut(self._clock(), self._config.load_timeout_s))
        async with self._lifecycle(model_id):
            engine = self._registry.get(model_id)
            if engine is not None and engine.state is EngineState.FAILED:
                try:
                    await self._units.stop_engine(engine.unit)
                except Exception as e:
                    log.warning("stopping %s after its load timeout failed: %s", model_id, e)

    @contextlib.asynccontextmanager
    async def _lifecycle(self, model_id: str) -> AsyncIterator[None]:
        self._in_lifecycle[model_id] = self._in_lifecycle.get(model_id, 0) + 1
        try:
            async with self._lock(model_id):
                self._registry.bump(model_id)
                yield
        finally:
            self._in_lifecycle[model_id] -= 1
            engine = self._registry.get(model_id)
            if engine is not None and engine.exit_unconfirmed and not self.busy(model_id):
                self._spawn(self._confirm_exit(model_id))

    def _lock(self, model_id: str) -> asyncio.Lock:
        return self._locks.setdefault(model_id, asyncio.Lock())

    def _quiet(self) -> bool:
        return not any(self._in_lifecycle.values()) and not any(
            e.state in COMING_STATES for e in self._registry.engines())

    # -- what systemd says (adoption, reconciliation, a shut socket) -------------------

    def take_over(self, info: EngineUnitInfo) -> Engine | None:
        """Adopt a unit systemd runs for one of our models, without restarting it."""
        if info.model_id is None or info.socket is None or self.busy(info.model_id):
            return None
        current = self._registry.get(info.model_id)
        if current is not None and current.unit != info.unit:
            return None   # another unit for the same model: not ours to guess about
        self._registry.register(
            Engine(info.model_id, info.unit, info.socket, adopted=True,
                   restarts=info.n_restarts, devices=self._capacity.devices_of(
                       info.visible_devices), adapters=info.adapters),
            unit_props={"ActiveState": info.active_state, "SubState": info.sub_state})
        self._registry.apply_info(info.model_id, info)
        self._capacity.track(info.model_id, info.control_group)
        self._readiness.watch(info.model_id)
        return self._registry[info.model_id]

    def observe(self, model_id: str, info: EngineUnitInfo | None) -> None:
        """What a listing says about a model's unit (None: systemd has no such unit).
        The caller makes sure nothing happened to the model since the listing began."""
        if self._registry.get(model_id) is None or self.busy(model_id):
            return
        if info is not None:
            self._capacity.track(model_id, info.control_group)
        self._registry.reconcile(model_id, info)

    async def coming_back(self, model_id: str, main_pid: int) -> bool:
        """A request found the engine's socket shut (it reached no process): whether the
        engine is on its way back, systemd restarting it, so that the request can wait for
        it. Its process may have died a moment ago, before systemd's signal came: ask
        systemd (one GetAll; it reaps a child before it answers the bus)."""
        engine = self._registry.get(model_id)
        if engine is not None and engine.state is EngineState.READY \
                and engine.main_pid == main_pid and not self.busy(model_id):
            info = await self.info(engine.unit)
            current = self._registry.get(model_id)
            if info is not None and current is not None and current.main_pid == main_pid:
                self._registry.apply_info(model_id, info)
        engine = self._registry.get(model_id)
        return engine is not None and engine.state in COMING_STATES

    async def _confirm_exit(self, model_id: str) -> None:
        """A signal said the unit ended (not our stop): ask systemd before the place is
        released. Real D-Bus keeps one connection's signals in order, so this is one
        round trip per engine exit that confirms; it guards against the lost or late one."""
        engine = self._registry.get(model_id)
        if engine is None:
            return
        info = await self.info(engine.unit)
        current = self._registry.get(model_id)
        if current is None or not current.exit_unconfirmed or self.busy(model_id):
            return
        self._registry.reconcile(model_id, info)

    async def info(self, unit: str) -> EngineUnitInfo | None:
        """What systemd says of the unit now (None: no such unit, or no answer)."""
        try:
            return await self._units.engine_info(unit)
        except GatewayError:
            return None

    # -- what follows a change ---------------------------------------------------------

    def _react(self, old: Engine, new: Engine) -> None:
        if new.exit_unconfirmed and not old.exit_unconfirmed and not self.busy(new.model_id):
            self._spawn(self._confirm_exit(new.model_id))
        if new.state is old.state:
            return
        if new.state is EngineState.READY:
            self._registry.wake_waiters(new)
        elif new.state is EngineState.FAILED:
            self._logs.settle_later(new.model_id)
        elif new.state is EngineState.RESTARTING and self._memory.killed_for_memory(new):
            self._spawn(self._memory.out_of_memory(new.model_id))
        elif new.state is EngineState.RESTARTING:   # its waiters wait on
            self._logs.reread_later(new.model_id, EngineState.RESTARTING, now=True)
        elif new.state is EngineState.STOPPED:   # gone, and not by our stop (that forgets)
            self._registry.fail_waiters(new.model_id, EngineNotRunning(
                f"the engine for {new.model_id!r} stopped outside the gateway",
                model=new.model_id))
        elif new.state is EngineState.LOADING:
            self._readiness.watch(new.model_id)

    async def _on_ready(self, model_id: str) -> None:
        """Healthy: ready once what the first request must find done is done."""
        await self._hooks.ready(self._registry.get(model_id))
        self._registry.event(model_id, HealthReady(self._clock()))
        self._capacity.learn_gpu_memory()
        if (engine := self._registry.get(model_id)) is not None:
            await self._memory.ready(engine)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        self._readiness.close()
        self._parking.close()
        for task in list(self._tasks):
            task.cancel()
