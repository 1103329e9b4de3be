"""The engine layer: turns start/stop requests and systemd's signals into engine states.

Decisions (admission, state transitions) are synchronous calls into the pure
core (`budget`, `engines`); only the effects await (D-Bus, /health, journal).

One lifecycle at a time per model: a start and a stop of the same model never
overlap. Each takes the model's lifecycle lock (FIFO) around its effect, so the
next StartTransientUnit for a unit name is sent only once the previous
instance's stop job is done and the unit is gone (systemd refuses to create a
transient unit whose name is still loaded). A stop marks the engine `stopping`
*before* it waits for the lock, so from that moment no request is handed the
engine; a start checks admission only once it holds the lock, so it sees what
the stop left. Within the lock, admission and registration do not await, so
two starts of different models cannot both take the last slot.

State comes from three sources, all turned into `engines` events:
- systemd's PropertiesChanged signals (merged per unit, because the Unit and
  Service interfaces signal separately) → UnitChanged;
- the readiness poller while starting/loading → HealthReady / LoadTimedOut;
- the journal, read once when an engine fails → LogsRead (the last lines).
and, for what signals cannot say (a unit started or removed while we were not
looking), the reconciler's listings (service/restore.py) → `take_over`/`observe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from gatewayd.core import budget, placement
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engine_units import keeps_kv_cache, settings_stamp
from gatewayd.core.engines import (
    COMING_STATES,
    Engine,
    EngineState,
    Event,
    HealthReady,
    LoadTimedOut,
    LogsRead,
    Reconciled,
    StartFailed,
    StartRequested,
    StopRequested,
    UnitChanged,
    UnitGone,
    Unresponsive,
    apply,
)
from gatewayd.core.errors import (
    EngineFailed,
    EngineNotRunning,
    GatewayError,
    ModelNotFound,
    UnitAlreadyActive,
)
from gatewayd.core.ports import (
    DesiredList,
    EngineUnitInfo,
    GpuProbe,
    HealthProbe,
    JournalReader,
    MemoryBook,
    SlotStore,
    UnitControl,
)
from gatewayd.service.readiness import Readiness

log = logging.getLogger("gatewayd.engines")
LOG_TAIL_LINES = 15
# journald writes a dead engine's last lines (its stderr stream) a little after systemd
# reports the exit, and nothing unprivileged can wait for it: the tail is read again
# after these delays (seconds from the failure) while the engine stays failed, so the
# admin's view ends with the line that says why
LOG_REREAD_S = (0.5, 2.0, 5.0)
PARK_QUIET_POLL_S = 0.05   # how often a pending park looks whether starts are over
READY_GRACE_S = 5.0        # a waiter's deadline beyond load_timeout_s
RETRY_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)   # after 1, 2, 3... failed starts in a row

EngineListener = Callable[[Engine, Engine], None]
ReadyHook = Callable[[Model, str], Awaitable[object]]


class EngineManager:
    def __init__(self, *, catalog: Catalog, config: GatewayConfig, units: UnitControl,
                 health: HealthProbe, gpu: GpuProbe, journal: JournalReader,
                 desired: DesiredList, slots: SlotStore | None = None,
                 learned: MemoryBook | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog = catalog
        self.config = config
        self.units = units
        self.gpu = gpu
        self.desired = desired
        self.slots = slots
        self.learned = learned
        self._journal = journal
        self._clock = clock
        self._engines: dict[str, Engine] = {}
        self._by_unit: dict[str, str] = {}
        self._unit_props: dict[str, dict[str, Any]] = {}
        self._waiters: dict[str, list[asyncio.Future[Engine]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._settling: dict[str, asyncio.Task[None]] = {}
        self._listeners: list[EngineListener] = []
        self._ready_hooks: list[ReadyHook] = []
        self._locks: dict[str, asyncio.Lock] = {}
        self._in_lifecycle: dict[str, int] = {}     # operations holding or awaiting the lock
        self._versions: dict[str, int] = {}         # bumped by every event and operation
        self._failures: dict[str, tuple[int, float]] = {}   # model -> (in a row, retry at)
        self._state_since: dict[str, float] = {}   # model -> when it entered its state
        self.stop_reasons: dict[str, str] = {}   # why each engine was last stopped
        self.last_release: float | None = None   # when an engine last gave up its slot
        self._readiness = Readiness(health, load_timeout_s=config.load_timeout_s, clock=clock,
                                    engine=self._engines.get, on_ready=self._on_ready,
                                    on_timeout=self._on_load_timeout)
        self._unwatch = units.watch(self._on_unit_change)
        self._park_queue: dict[str, None] = {}      # models to park, in order
        self._parker: asyncio.Task[None] | None = None

    def reconfigure(self, config: GatewayConfig) -> None:
        """A reloaded configuration: for the starts, admissions and loads from now on."""
        self.config = config
        self._readiness.reconfigure(config.load_timeout_s)

    async def drop_unconfigured_kv_caches(self) -> list[str]:
        """The saved KV caches of models no longer in the catalog, deleted (off the loop):
        nothing would restore them, and kv_cache_max_mb bounds each model's directory
        only when it stops. At the start and after a reload; the instances deleted."""
        if self.slots is None:
            return []
        keep = {self.units.layout(model.id).instance for model in self.catalog}
        return await asyncio.to_thread(self.slots.prune, keep)

    # -- queries ---------------------------------------------------------------------

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def get(self, model_id: str) -> Engine | None:
        return self._engines.get(model_id)

    def subscribe(self, listener: EngineListener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def busy(self, model_id: str) -> bool:
        """A start or stop of this model is under way (or waiting for its turn)."""
        return self._in_lifecycle.get(model_id, 0) > 0

    def versions(self) -> dict[str, int]:
        """Per model, a number that changes with every event and every start or stop: a
        listing taken between two equal readings saw nothing newer than the gateway."""
        return dict(self._versions)

    def backoff_left(self, model_id: str) -> float:
        """Seconds before a failed model may be started again by a request (0: now)."""
        engine = self._engines.get(model_id)
        failed = self._failures.get(model_id)
        if engine is None or engine.state is not EngineState.FAILED or failed is None:
            return 0.0
        return max(0.0, failed[1] - self._clock())

    def failed_error(self, model_id: str, *, retry_after: int | None = None) -> EngineFailed:
        engine = self._engines[model_id]
        failure = engine.failure
        reason = failure.reason if failure else "failed"
        return EngineFailed(f"engine for {model_id!r} failed: {reason}. "
                            f"Logs: journalctl -u {engine.unit}", retry_after=retry_after,
                            model=model_id, unit=engine.unit,
                            failure=failure.describe() if failure else None)

    # -- start / stop --------------------------------------------------------------

    async def start(self, model_id: str, *, wait: bool = True, force: bool = False) -> Engine:
        """Start a model's engine; with wait, return once it is ready (or raise).

        force skips the VRAM estimate (the scheduler's "nothing else is running,
        try anyway"); the engine limit and one-instance rule always hold.
        """
        model = self._model(model_id)
        async with self._lifecycle(model.id):
            where = self._admit(model, force=force)
            self.stop_reasons.pop(model.id, None)
            layout = self.units.layout(model.id)
            self._register(Engine(model.id, layout.unit, layout.socket,
                                  devices=where.uuids if where else ()))
            self._event(model.id, StartRequested(self._clock()))
            visible = where.visible_devices() if where else None
            log.info("starting %s as %s%s", model.id, layout.unit,
                     f" on {', '.join(f'GPU {d.index}' for d in where.devices)}"
                     if where and visible else "")
            try:
                await self.units.start_engine(model, visible)
            except UnitAlreadyActive:
                # systemd runs it already (we lost track): that is the truth, adopt it
                log.warning("%s: %s is already running; adopting it", model.id, layout.unit)
                if (info := await self.units.engine_info(layout.unit)) is not None:
                    self._apply_info(model.id, info)
            except Exception as e:   # every failed effect ends in a clear state and answer
                current = self._engines.get(model.id)
                if isinstance(e, GatewayError) and current is not None and current.restarting:
                    # the start job failed because its process died, and systemd restarts
                    # it (its signals came before the job's end): a wait, like any restart
                    log.info("%s: its start job failed (%s); systemd restarts it", model.id,
                             e.message)
                    self.desired.add(model.id)
                    return await self.wait_ready(model.id) if wait else current
                reason = e.message if isinstance(e, GatewayError) else f"{type(e).__name__}: {e}"
                if not isinstance(e, GatewayError):
                    log.exception("starting %s failed", model.id)
                self._event(model.id, StartFailed(self._clock(), reason))
                if settling := self._settling.get(model.id):
                    await asyncio.shield(settling)
                raise self.failed_error(model.id) from e
            self.desired.add(model.id)   # only a start that happened is wanted after a reboot
            self._readiness.watch(model.id, new_start=True)
        return await self.wait_ready(model.id) if wait else self._engines[model.id]

    async def wait_ready(self, model_id: str, timeout: float | None = None) -> Engine:
        """The engine once ready; its failure, its stop, or the deadline otherwise."""
        engine = self._engines.get(model_id)
        if engine is None:
            raise EngineNotRunning(f"no engine for {model_id!r} is running or starting",
                                   model=model_id)
        if engine.state is EngineState.READY:
            return engine
        if engine.state is EngineState.FAILED:
            raise self.failed_error(model_id)
        if engine.state in (EngineState.STOPPING, EngineState.STOPPED):
            raise EngineNotRunning(f"the engine for {model_id!r} is {engine.state.value}",
                                   model=model_id)
        fut: asyncio.Future[Engine] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(model_id, []).append(fut)
        limit = self.config.load_timeout_s + READY_GRACE_S if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(fut), limit)
        except TimeoutError:
            raise self._late_error(model_id, limit) from None
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.get(model_id, []).remove(fut)

    def _late_error(self, model_id: str, limit: float) -> EngineFailed:
        engine = self._engines.get(model_id)
        why = ""
        if engine is not None and engine.restarting and engine.failure is not None:
            # the wait ran out while systemd restarted it: say why it is restarting
            why = (f": systemd is restarting it ({engine.failure.reason}; restarted "
                   f"{engine.restarts} time(s)). Logs: journalctl -u {engine.unit}")
        return EngineFailed(f"the engine for {model_id!r} was not ready within {limit:g}s"
                            f"{why}", model=model_id)

    async def stop(self, model_id: str, *, reason: str = "requested") -> Engine:
        """Stop a model's engine; returns once its unit is stopped and gone."""
        engine = self._engines.get(model_id)
        if engine is None:
            raise EngineNotRunning(f"no engine for {model_id!r} is running", model=model_id)
        self.desired.remove(model_id)   # not running at the next boot either
        log.info("stopping %s (%s): %s", model_id, engine.unit, reason)
        was_ready = engine.state is EngineState.READY
        self._mark_stopping(model_id, reason)
        async with self._lifecycle(model_id):
            current = self._engines.get(model_id)
            if current is None:
                return engine   # stopped by the operation before ours
            # a start that had its turn before ours ran: this stop is for that engine now
            self._mark_stopping(model_id, reason)
            if was_ready and current.main_pid == engine.main_pid:
                await self._save_slots(current)   # bounded (kv_cache.SAVE_TIMEOUT_S)
            try:
                await self.units.stop_engine(current.unit)
            except Exception as e:
                info = await self._info_quietly(current.unit)
                if info is not None and info.active_state not in ("inactive", "failed"):
                    log.warning("stopping %s failed: %s", model_id, e)
                    self._apply_info(model_id, info)
                    raise
            self._event(model_id, UnitGone(self._clock()))
            stopped = self._forget(model_id)
        self._park_later(model_id)
        return stopped

    # -- parked units: a stopped engine's next start is a wake (adapters/parked_units) ---

    def _park_later(self, model_id: str) -> None:
        """Park the model's unit once no start or stop is under way anywhere: creating a
        unit costs systemd ~30 ms of work that must not slow someone's start."""
        self._park_queue[model_id] = None
        if self._parker is None or self._parker.done():
            self._parker = asyncio.get_running_loop().create_task(self._park_pending())

    def _quiet(self) -> bool:
        return not any(self._in_lifecycle.values()) and not any(
            e.state in COMING_STATES for e in self._engines.values())

    async def _park_pending(self) -> None:
        while self._park_queue:
            while not self._quiet():
                await asyncio.sleep(PARK_QUIET_POLL_S)
            model_id = next(iter(self._park_queue))
            del self._park_queue[model_id]
            model = self.catalog.get(model_id)
            if model is None:
                continue   # removed from the catalog meanwhile
            # the model's lifecycle lock, so that a start waits for the park and then
            # wakes the unit; but not "busy": a loader that wants this model goes on
            # making room meanwhile instead of waiting for the park to end
            async with self._locks.setdefault(model_id, asyncio.Lock()):
                if model_id in self._engines:
                    continue   # started again meanwhile
                try:
                    if await self.units.park(model):
                        log.info("%s: its unit is parked for the next start", model_id)
                except Exception as e:   # a start then creates the unit, as without parking
                    log.warning("%s: could not park its unit: %s", model_id, e)

    async def kill_unresponsive(self, model_id: str, main_pid: int, silent_s: float) -> None:
        """The engine (still that process) hangs: restarting, with the reason; its unit
        killed, and systemd restarts it. Serialised with starts and stops of the model."""
        async with self._lifecycle(model_id):
            engine = self._engines.get(model_id)
            if engine is None or engine.state is not EngineState.READY \
                    or engine.main_pid != main_pid:
                return   # stopped, restarted or failed meanwhile
            log.warning("%s: no answer to /health for %gs: killing %s (PID %d) so systemd "
                        "restarts it", model_id, silent_s, engine.unit, main_pid)
            self._event(model_id, Unresponsive(self._clock(), silent_s))
            try:
                await self.units.kill_engine(engine.unit)
            except Exception as e:
                # no restart is coming from this kill: what systemd says now decides (the
                # unit gone: stopped, and its waiters told, not left waiting for a restart)
                log.warning("%s: could not kill %s: %s", model_id, engine.unit, e)
                self._reconcile(model_id, await self._info_quietly(engine.unit))

    async def unreachable(self, model_id: str, main_pid: int) -> bool:
        """A request found the engine's socket shut (it reached no process): whether the
        engine is on its way back, systemd restarting it, so that the request can wait for
        it. Its process may have died a moment ago, before systemd's signal came: ask
        systemd (one GetAll; it reaps a child before it answers the bus)."""
        engine = self._engines.get(model_id)
        if engine is not None and engine.state is EngineState.READY \
                and engine.main_pid == main_pid and not self.busy(model_id):
            info = await self._info_quietly(engine.unit)
            current = self._engines.get(model_id)
            if info is not None and current is not None and current.main_pid == main_pid:
                self._apply_info(model_id, info)
        engine = self._engines.get(model_id)
        return engine is not None and engine.state in COMING_STATES

    def _mark_stopping(self, model_id: str, reason: str) -> None:
        """From now on nobody is handed this engine; whoever waits for it hears why."""
        self.stop_reasons[model_id] = reason
        self._event(model_id, StopRequested(self._clock()))
        self._fail_waiters(model_id, EngineNotRunning(
            f"the engine for {model_id!r} was stopped ({reason})", model=model_id))

    # -- what systemd says (adoption, reconciliation) ----------------------------------

    def take_over(self, info: EngineUnitInfo) -> Engine | None:
        """Adopt a unit systemd runs for one of our models, without restarting it."""
        if info.model_id is None or info.socket is None or self.busy(info.model_id):
            return None
        current = self._engines.get(info.model_id)
        if current is not None and current.unit != info.unit:
            return None   # another unit for the same model: not ours to guess about
        self._register(Engine(info.model_id, info.unit, info.socket, adopted=True,
                              restarts=info.n_restarts,
                              devices=self._resolve_devices(info.visible_devices)))
        self._unit_props[info.unit] = {"ActiveState": info.active_state,
                                       "SubState": info.sub_state}
        self._apply_info(info.model_id, info)
        self._readiness.watch(info.model_id)
        return self._engines[info.model_id]

    def observe(self, model_id: str, info: EngineUnitInfo | None) -> None:
        """What a listing says about a model's unit (None: systemd has no such unit).
        The caller makes sure nothing happened to the model since the listing began."""
        if self._engines.get(model_id) is None or self.busy(model_id):
            return
        self._reconcile(model_id, info)

    def _reconcile(self, model_id: str, info: EngineUnitInfo | None) -> None:
        """systemd's whole truth about the model's unit (None: no such unit)."""
        self._event(model_id, Reconciled(
            self._clock(), info.active_state if info else None,
            main_pid=info.main_pid if info else 0, n_restarts=info.n_restarts if info else 0))

    def _apply_info(self, model_id: str, info: EngineUnitInfo) -> None:
        self._event(model_id, UnitChanged(
            self._clock(), active_state=info.active_state, sub_state=info.sub_state,
            main_pid=info.main_pid, n_restarts=info.n_restarts))

    async def info(self, engine: Engine) -> EngineUnitInfo | None:
        return await self._info_quietly(engine.unit)

    async def logs(self, model_id: str, lines: int) -> list[str]:
        engine = self._engines.get(model_id)
        unit = engine.unit if engine else self.units.layout(self._model(model_id).id).unit
        return await self._journal.tail(unit, lines)

    async def close(self) -> None:
        self._unwatch()
        self._readiness.close()
        if self._parker is not None:
            self._parker.cancel()
        for task in list(self._tasks):
            task.cancel()
        for fut in (f for futs in self._waiters.values() for f in futs):
            if not fut.done():
                fut.cancel()
        await self.desired.flush()   # the last start or stop is kept for the next boot

    # -- decisions -----------------------------------------------------------------

    def _model(self, model_id: str) -> Model:
        model = self.catalog.get(model_id)
        if model is None:
            raise ModelNotFound(f"model {model_id!r} does not exist", param="model",
                                available_models=self.catalog.ids)
        return model

    def measured_mib(self, model: Model) -> int | None:
        """What an engine of this model's setup was seen holding (None: not yet)."""
        if self.learned is None:
            return None
        return self.learned.get(settings_stamp(model, self.config))

    def need_mib(self, model: Model) -> int:
        """Its engine's expected GPU memory: learned once measured, estimated before."""
        return budget.model_need_mib(model, self.config.vram_margin_mib,
                                     self.measured_mib(model))

    def learn_gpu_memory(self) -> list[str]:
        """Record what each ready engine's process holds now (NVML per process, its
        MainPID): the next admission of that setup uses it. The models whose figure
        changed."""
        if self.learned is None:
            return []
        per_process = self.gpu.process_mib()
        if not per_process:
            return []
        changed = []
        for engine in self._engines.values():
            model = self.catalog.get(engine.model_id)
            held = per_process.get(engine.main_pid)
            if engine.state is EngineState.READY and model is not None and held and \
                    self.learned.record(settings_stamp(model, self.config), model.id, held):
                log.info("%s: its engine holds %d MiB of GPU memory (learned; the files "
                         "are %d MiB)", model.id, held, budget.model_need_mib(model, 0))
                changed.append(model.id)
        return changed

    def place(self, model: Model) -> placement.Placement | None:
        """Where the model's engine would go now (core/placement.py), from a fresh
        reading of every device; None: no GPU. Raises GpuUnavailable."""
        devices = self.gpu.devices()
        if devices is None:
            return None
        per_process = self.gpu.process_mib() or {}
        placed = []
        for engine in self._engines.values():
            other = self.catalog.get(engine.model_id)
            if other is None or not engine.holds_slot or engine.model_id == model.id:
                continue
            need, held = self.need_mib(other), per_process.get(engine.main_pid)
            placed.append(placement.Placed(
                engine.devices,
                # loads in progress will take memory that NVML does not show as used yet
                pending_mib=budget.still_to_load_mib(engine.state, True, need, held),
                evictable_mib=(held or need) if engine.state is EngineState.READY
                and not other.config.pin else 0))
        return placement.place(self.need_mib(model), placement.rooms(devices, placed),
                               model.config.cuda_visible_devices)

    def _admit(self, model: Model, *, force: bool = False) -> placement.Placement | None:
        """Admission (budget.check_admission); where the engine goes. force skips the
        memory check, not the placement."""
        where = self.place(model)
        budget.check_admission(model.id, self._engines.values(),
                               max_engines=self.config.max_engines, need_mib=self.need_mib(model),
                               placement=None if force else where)
        return where

    def _resolve_devices(self, spec: str | None) -> tuple[str, ...]:
        """An adopted unit's CUDA_VISIBLE_DEVICES as device UUIDs (): all or unknown."""
        if spec is None:
            return ()
        try:
            devices = self.gpu.devices() or []
        except GatewayError:
            return ()
        return tuple(d.uuid for d in placement.select(spec, devices))

    @contextlib.asynccontextmanager
    async def _lifecycle(self, model_id: str) -> AsyncIterator[None]:
        self._in_lifecycle[model_id] = self._in_lifecycle.get(model_id, 0) + 1
        try:
            async with self._locks.setdefault(model_id, asyncio.Lock()):
                self._bump(model_id)
                yield
        finally:
            self._in_lifecycle[model_id] -= 1
            engine = self._engines.get(model_id)
            if engine is not None and engine.exit_unconfirmed and not self.busy(model_id):
                self._spawn(self._confirm_exit(model_id))

    def _register(self, engine: Engine) -> None:
        old = self._engines.get(engine.model_id)
        if old is not None:
            self._by_unit.pop(old.unit, None)
        self._engines[engine.model_id] = engine
        self._by_unit[engine.unit] = engine.model_id
        self._unit_props.pop(engine.unit, None)
        if old is not None:
            self._changed(old, engine)

    def _forget(self, model_id: str) -> Engine:
        # whoever began to wait during the stop (a late signal can make a stopping engine
        # look loading for a moment) hears now, not at its deadline
        self._fail_waiters(model_id, EngineNotRunning(
            f"the engine for {model_id!r} was stopped", model=model_id))
        stopped = self._engines.pop(model_id)
        self._by_unit.pop(stopped.unit, None)
        self._unit_props.pop(stopped.unit, None)
        return stopped

    def _bump(self, model_id: str) -> None:
        self._versions[model_id] = self._versions.get(model_id, 0) + 1

    def _event(self, model_id: str, event: Event) -> None:
        old = self._engines.get(model_id)
        if old is None:
            return
        self._bump(model_id)
        new = apply(old, event)
        if new is not old:
            self._engines[model_id] = new
            self._changed(old, new)

    def _changed(self, old: Engine, new: Engine) -> None:
        if old.holds_slot and not new.holds_slot:
            self.last_release = self._clock()   # its GPU memory shows as free a bit later
        if new.state is EngineState.READY:
            self._failures.pop(new.model_id, None)
        elif new.state is EngineState.FAILED and old.state is not EngineState.FAILED:
            count = self._failures.get(new.model_id, (0, 0.0))[0] + 1
            backoff = RETRY_BACKOFF_S[min(count, len(RETRY_BACKOFF_S)) - 1]
            self._failures[new.model_id] = (count, self._clock() + backoff)
        for listener in list(self._listeners):
            listener(old, new)
        if new.exit_unconfirmed and not old.exit_unconfirmed and not self.busy(new.model_id):
            self._spawn(self._confirm_exit(new.model_id))
        if new.state is old.state:
            return
        failure = new.failure
        now = self._clock()
        since = self._state_since.get(new.model_id)
        self._state_since[new.model_id] = now
        # how long the unit took to start and the model to load: where a cold start went
        took = (f" after {(now - since) * 1000:.0f} ms" if since is not None
                and old.state in COMING_STATES else "")
        why = failure.reason if failure and new.state in (
            EngineState.FAILED, EngineState.RESTARTING) else None
        log.info("%s: %s -> %s%s%s", new.model_id, old.state.value, new.state.value, took,
                 f" ({why})" if why else "")
        if new.state is EngineState.READY:
            for fut in self._waiters.pop(new.model_id, []):
                if not fut.done():
                    fut.set_result(new)
        elif new.state is EngineState.FAILED:
            self._spawn(self._settle_failure(new.model_id), key=new.model_id)
        elif new.state is EngineState.RESTARTING:   # its waiters wait on
            self._spawn(self._reread_logs(new.model_id, EngineState.RESTARTING, now=True))
        elif new.state is EngineState.STOPPED:   # gone, and not by our stop (that forgets)
            self._fail_waiters(new.model_id, EngineNotRunning(
                f"the engine for {new.model_id!r} stopped outside the gateway",
                model=new.model_id))
        elif new.state is EngineState.LOADING:
            self._readiness.watch(new.model_id)

    # -- effects ---------------------------------------------------------------------

    def _spawn(self, coro: Any, key: str | None = None) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        if key is not None:
            self._settling[key] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_unit_change(self, unit: str, changed: Mapping[str, Any]) -> None:
        model_id = self._by_unit.get(unit)
        if model_id is None:
            return
        props = self._unit_props.setdefault(unit, {})
        props.update(changed)
        self._event(model_id, UnitChanged(
            self._clock(),
            active_state=changed.get("ActiveState"),
            sub_state=props.get("SubState") if "ActiveState" in changed else None,
            main_pid=changed.get("MainPID"),
            n_restarts=changed.get("NRestarts"),
            result=props.get("Result"),
            exec_code=props.get("ExecMainCode"),
            exec_status=props.get("ExecMainStatus")))

    def before_ready(self, hook: ReadyHook) -> Callable[[], None]:
        """hook(model, socket) is awaited when an engine answers /health, before it is
        ready: what the first request must find done (its own deadline; an exception is
        logged, and the engine is ready all the same)."""
        self._ready_hooks.append(hook)
        return lambda: self._ready_hooks.remove(hook)

    async def _on_ready(self, model_id: str) -> None:
        """Healthy: its saved KV cache goes back into its slots, and the hooks run (the
        front door learns its slots), together and bounded, so that the first request
        finds them done and does not share the engine with them."""
        engine, model = self._engines.get(model_id), self.catalog.get(model_id)
        if engine is not None and model is not None:
            work = [hook(model, engine.socket) for hook in self._ready_hooks]
            if self.slots is not None and keeps_kv_cache(model):
                work.append(self.slots.restore(model_id, engine.socket,
                                               self.units.layout(model_id).instance))
            for failed in await asyncio.gather(*work, return_exceptions=True):
                if isinstance(failed, Exception):   # ready all the same, never stuck loading
                    log.warning("%s: before it was ready: %s: %s", model_id,
                                type(failed).__name__, failed)
        self._event(model_id, HealthReady(self._clock()))
        self.learn_gpu_memory()

    async def _save_slots(self, engine: Engine) -> None:
        model = self.catalog.get(engine.model_id)
        if self.slots is not None and model is not None and keeps_kv_cache(model):
            await self.slots.save(engine.model_id, engine.socket,
                                  self.units.layout(engine.model_id).instance)

    async def _on_load_timeout(self, model_id: str) -> None:
        """Failed (with the reason), then its unit stopped, as one lifecycle operation,
        so a retry cannot start the unit while it is still going away."""
        self._event(model_id, LoadTimedOut(self._clock(), self.config.load_timeout_s))
        async with self._lifecycle(model_id):
            engine = self._engines.get(model_id)
            if engine is not None and engine.state is EngineState.FAILED:
                try:
                    await self.units.stop_engine(engine.unit)
                except Exception as e:
                    log.warning("stopping %s after its load timeout failed: %s", model_id, e)

    async def _confirm_exit(self, model_id: str) -> None:
        """A signal said the unit ended (not our stop): ask systemd before the slot is
        released. Real D-Bus keeps one connection's signals in order, so this is one
        round trip per engine exit that confirms; it guards against the lost or late one."""
        engine = self._engines.get(model_id)
        if engine is None:
            return
        info = await self._info_quietly(engine.unit)
        current = self._engines.get(model_id)
        if current is None or not current.exit_unconfirmed or self.busy(model_id):
            return
        self._reconcile(model_id, info)

    async def _settle_failure(self, model_id: str) -> None:
        """Attach the engine's last log lines to its failure, then tell the waiters."""
        engine = self._engines.get(model_id)
        if engine is None:
            return
        lines = await self._journal.tail(engine.unit, LOG_TAIL_LINES)
        self._event(model_id, LogsRead(tuple(lines)))
        current = self._engines.get(model_id)
        if current is None or current.state is not EngineState.FAILED:
            return  # stopped (waiters told), or running again (waiters wait on)
        self._spawn(self._reread_logs(model_id, EngineState.FAILED))
        self._fail_waiters(model_id, self.failed_error(model_id))

    async def _reread_logs(self, model_id: str, state: EngineState, now: bool = False) -> None:
        """The failure's log tail, read (now, and) again after LOG_REREAD_S while the
        engine stays in state."""
        waited = 0.0
        for at in (0.0,) * now + LOG_REREAD_S:
            await asyncio.sleep(at - waited)
            waited = at
            engine = self._engines.get(model_id)
            if engine is None or engine.state is not state:
                return   # it moved on (a new failure or restart reads its own)
            lines = await self._journal.tail(engine.unit, LOG_TAIL_LINES)
            self._event(model_id, LogsRead(tuple(lines)))

    def _fail_waiters(self, model_id: str, error: GatewayError) -> None:
        for fut in self._waiters.pop(model_id, []):
            if not fut.done():
                fut.set_exception(error)

    async def _info_quietly(self, unit: str) -> EngineUnitInfo | None:
        try:
            return await self.units.engine_info(unit)
        except GatewayError:
            return None
