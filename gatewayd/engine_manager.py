"""The engine layer: turns start/stop requests and systemd's signals into engine states.

Decisions (admission, state transitions) are synchronous calls into the pure
core (`budget`, `engines`); only the effects await (D-Bus, /health, journal).
An engine is registered in its new state *before* the first await of a start,
so a second start of the same model sees it and gets `already_running`; the
event loop cannot interleave code that does not await, so no locks are needed.

State comes from three sources, all turned into `engines` events:
- systemd's PropertiesChanged signals (merged per unit, because the Unit and
  Service interfaces signal separately) → UnitChanged;
- the /health poller while starting/loading → HealthReady / LoadTimedOut;
- the journal, read once when an engine fails → LogsRead (the last lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from gatewayd import budget
from gatewayd.catalog import Catalog, Model
from gatewayd.config import GatewayConfig
from gatewayd.desired import DesiredEngines
from gatewayd.engines import (
    Engine,
    EngineState,
    HealthReady,
    LoadTimedOut,
    LogsRead,
    StartFailed,
    StartRequested,
    StopRequested,
    UnitChanged,
    UnitGone,
    apply,
)
from gatewayd.errors import EngineFailed, EngineNotRunning, GatewayError, ModelNotFound
from gatewayd.health import poll_delays
from gatewayd.ports import EngineUnitInfo, GpuProbe, HealthProbe, JournalReader, UnitControl

log = logging.getLogger("gatewayd.engines")
LOG_TAIL_LINES = 15

EngineListener = Callable[[Engine, Engine], None]


class EngineManager:
    def __init__(self, *, catalog: Catalog, config: GatewayConfig, units: UnitControl,
                 health: HealthProbe, gpu: GpuProbe, journal: JournalReader,
                 desired: DesiredEngines, clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog = catalog
        self.config = config
        self.units = units
        self.gpu = gpu
        self.desired = desired
        self._health = health
        self._journal = journal
        self._clock = clock
        self._engines: dict[str, Engine] = {}
        self._by_unit: dict[str, str] = {}
        self._unit_props: dict[str, dict[str, Any]] = {}
        self._waiters: dict[str, list[asyncio.Future[Engine]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._settling: dict[str, asyncio.Task[None]] = {}
        self._health_watch: dict[str, asyncio.Task[None]] = {}
        self._listeners: list[EngineListener] = []
        self.stop_reasons: dict[str, str] = {}   # why each engine was last stopped
        self._unwatch = units.watch(self._on_unit_change)

    # -- queries ---------------------------------------------------------------------

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def get(self, model_id: str) -> Engine | None:
        return self._engines.get(model_id)

    def subscribe(self, listener: EngineListener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    # -- start / stop --------------------------------------------------------------

    async def start(self, model_id: str, *, wait: bool = True, force: bool = False) -> Engine:
        """Start a model's engine; with wait, return once it is ready (or raise).

        force skips the VRAM estimate (the scheduler's "nothing else is running,
        try anyway"); the engine limit and one-instance rule always hold.
        """
        model = self._model(model_id)
        self._admit(model, force=force)
        self.stop_reasons.pop(model.id, None)
        layout = self.units.layout(model.id)
        self._register(Engine(model.id, layout.unit, layout.socket))
        self._event(model.id, StartRequested(self._clock()))
        self.desired.add(model.id)
        log.info("starting %s as %s", model.id, layout.unit)
        try:
            await self.units.start_engine(model)
        except GatewayError as e:
            self._event(model.id, StartFailed(self._clock(), e.message))
            if settling := self._settling.get(model.id):
                await asyncio.shield(settling)
            raise self._failed_error(model.id) from e
        self._watch_health(model.id)
        return await self.wait_ready(model.id) if wait else self._engines[model.id]

    async def wait_ready(self, model_id: str, timeout: float | None = None) -> Engine:
        engine = self._engines.get(model_id)
        if engine is None:
            raise EngineNotRunning(f"no engine for {model_id!r} is running or starting",
                                   model=model_id)
        if engine.state is EngineState.READY:
            return engine
        if engine.state is EngineState.FAILED:
            raise self._failed_error(model_id)
        fut: asyncio.Future[Engine] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(model_id, []).append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.get(model_id, []).remove(fut)

    async def stop(self, model_id: str, *, reason: str = "requested") -> Engine:
        engine = self._engines.get(model_id)
        if engine is None:
            raise EngineNotRunning(f"no engine for {model_id!r} is running", model=model_id)
        self.desired.remove(model_id)   # not running at the next boot either
        self.stop_reasons[model_id] = reason
        self._event(model_id, StopRequested(self._clock()))
        stopped_early = EngineNotRunning(f"the engine for {model_id!r} was stopped",
                                         model=model_id)
        for fut in self._waiters.pop(model_id, []):
            if not fut.done():
                fut.set_exception(stopped_early)
        log.info("stopping %s (%s): %s", model_id, engine.unit, reason)
        await self.units.stop_engine(engine.unit)
        self._event(model_id, UnitGone(self._clock()))
        stopped = self._engines.pop(model_id)
        self._by_unit.pop(stopped.unit, None)
        self._unit_props.pop(stopped.unit, None)
        return stopped

    # -- adoption and restore ------------------------------------------------------

    async def adopt(self) -> list[Engine]:
        """Take over the engine units that are already running, without restarting them."""
        adopted = []
        for info in await self.units.list_engines():
            if info.model_id is None or info.socket is None:
                log.warning("ignoring %s: not started by llm-gateway (no model id in its "
                            "environment)", info.unit)
                continue
            if info.active_state == "inactive" or info.model_id in self._engines:
                continue
            engine = Engine(info.model_id, info.unit, info.socket, adopted=True,
                            restarts=info.n_restarts)
            self._register(engine)
            self._unit_props[info.unit] = {"ActiveState": info.active_state,
                                           "SubState": info.sub_state}
            self._event(info.model_id, UnitChanged(
                self._clock(), active_state=info.active_state, sub_state=info.sub_state,
                main_pid=info.main_pid, n_restarts=info.n_restarts))
            if info.model_id not in self.catalog:
                log.warning("adopted %s serves %r, which is not in the catalog (config "
                            "changed?); it can be listed and stopped", info.unit, info.model_id)
            adopted.append(self._engines[info.model_id])
            self._watch_health(info.model_id)
        for engine in adopted:
            log.info("adopted %s (%s, pid %d, %s)", engine.model_id, engine.unit,
                     engine.main_pid, engine.state.value)
        return adopted

    async def restore(self) -> None:
        """Start the desired engines, then the preload ones, one at a time, in order."""
        preload = [m.id for m in self.catalog if m.config.preload]
        for model_id in [*self.desired.ids, *(p for p in preload if p not in self.desired.ids)]:
            current = self._engines.get(model_id)
            if current is not None and current.active:
                continue
            if model_id not in self.catalog:
                log.warning("restore: %r is no longer in the catalog; skipped", model_id)
                continue
            log.info("restore: starting %s", model_id)
            try:
                engine = await self.start(model_id)
                log.info("restore: %s ready", engine.model_id)
            except GatewayError as e:
                log.warning("restore: %s failed: %s", model_id, e.message)

    async def info(self, engine: Engine) -> EngineUnitInfo | None:
        return await self.units.engine_info(engine.unit)

    async def logs(self, model_id: str, lines: int) -> list[str]:
        engine = self._engines.get(model_id)
        unit = engine.unit if engine else self.units.layout(self._model(model_id).id).unit
        return await self._journal.tail(unit, lines)

    async def close(self) -> None:
        self._unwatch()
        for task in [*self._tasks, *self._health_watch.values()]:
            task.cancel()
        for fut in (f for futs in self._waiters.values() for f in futs):
            if not fut.done():
                fut.cancel()

    # -- decisions -----------------------------------------------------------------

    def _model(self, model_id: str) -> Model:
        model = self.catalog.get(model_id)
        if model is None:
            raise ModelNotFound(f"model {model_id!r} does not exist", param="model",
                                available_models=self.catalog.ids)
        return model

    def _admit(self, model: Model, *, force: bool = False) -> None:
        margin = model.config.vram_margin_mib
        need = budget.required_mib(model.size_bytes, self.config.vram_margin_mib
                                   if margin is None else margin)
        gpu = None if force else self.gpu.memory(model.config.cuda_visible_devices)
        budget.check_admission(model.id, self._engines.values(),
                               max_engines=self.config.max_engines, need_mib=need, gpu=gpu)

    def _register(self, engine: Engine) -> None:
        old = self._engines.get(engine.model_id)
        if old is not None:
            self._by_unit.pop(old.unit, None)
        self._engines[engine.model_id] = engine
        self._by_unit[engine.unit] = engine.model_id
        self._unit_props.pop(engine.unit, None)
        if old is not None:
            self._changed(old, engine)

    def _event(self, model_id: str, event: Any) -> None:
        old = self._engines.get(model_id)
        if old is None:
            return
        new = apply(old, event)
        if new is not old:
            self._engines[model_id] = new
            self._changed(old, new)

    def _changed(self, old: Engine, new: Engine) -> None:
        for listener in list(self._listeners):
            listener(old, new)
        if new.state is old.state:
            return
        failure = new.failure
        log.info("%s: %s -> %s%s", new.model_id, old.state.value, new.state.value,
                 f" ({failure.reason})" if failure and new.state is EngineState.FAILED else "")
        if new.state is EngineState.READY:
            self._resolve_waiters(new.model_id, new)
        elif new.state is EngineState.FAILED:
            task = asyncio.get_running_loop().create_task(self._settle_failure(new.model_id))
            self._settling[new.model_id] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif new.state is EngineState.LOADING:
            self._watch_health(new.model_id)

    # -- effects ---------------------------------------------------------------------

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

    async def _settle_failure(self, model_id: str) -> None:
        """Attach the engine's last log lines to its failure, then tell the waiters."""
        engine = self._engines.get(model_id)
        if engine is None:
            return
        lines = await self._journal.tail(engine.unit, LOG_TAIL_LINES)
        self._event(model_id, LogsRead(tuple(lines)))
        current = self._engines.get(model_id)
        if current is None or current.state is not EngineState.FAILED:
            return  # stopped (waiters told), or restarting/recovered (waiters wait on)
        error = self._failed_error(model_id)
        for fut in self._waiters.pop(model_id, []):
            if not fut.done():
                fut.set_exception(error)

    def _failed_error(self, model_id: str) -> EngineFailed:
        engine = self._engines[model_id]
        failure = engine.failure
        reason = failure.reason if failure else "failed"
        return EngineFailed(f"engine for {model_id!r} failed: {reason}. "
                            f"Logs: journalctl -u {engine.unit}",
                            model=model_id, unit=engine.unit,
                            failure=failure.describe() if failure else None)

    def _resolve_waiters(self, model_id: str, engine: Engine) -> None:
        for fut in self._waiters.pop(model_id, []):
            if not fut.done():
                fut.set_result(engine)

    def _watch_health(self, model_id: str) -> None:
        task = self._health_watch.get(model_id)
        if task is None or task.done():
            self._health_watch[model_id] = asyncio.get_running_loop().create_task(
                self._poll_health(model_id))

    async def _poll_health(self, model_id: str) -> None:
        deadline = self._clock() + self.config.load_timeout_s
        for delay in poll_delays():
            engine = self._engines.get(model_id)
            if engine is None or engine.state not in (EngineState.STARTING, EngineState.LOADING):
                return
            if await self._health.status(engine.socket) == 200:
                self._event(model_id, HealthReady(self._clock()))
                return
            if self._clock() > deadline:
                self._event(model_id, LoadTimedOut(self._clock(), self.config.load_timeout_s))
                with contextlib.suppress(GatewayError):
                    await self.units.stop_engine(engine.unit)
                return
            await asyncio.sleep(delay)

