"""Fakes of the outside world shared by the fast tests: unit control that behaves like
systemd for engine units, a health probe, a journal, and an EngineManager built on them."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from gatewayd.adapters.desired import DesiredEngines
from gatewayd.adapters.gpu import NoGpu
from gatewayd.adapters.systemd import NO_SUCH_UNIT
from gatewayd.core.catalog import Catalog, Model, ModelFile, build_catalog
from gatewayd.core.config import GatewayConfig, ModelConfig
from gatewayd.core.engine_units import EngineLayout
from gatewayd.core.errors import GatewayError, UnitAlreadyActive, UnitOperationFailed
from gatewayd.core.ports import (
    DesiredList,
    EngineUnitInfo,
    GpuProbe,
    HostMemoryProbe,
    JournalReader,
    KvCacheStore,
    MemoryBook,
    MemoryMeter,
    UnitWatcher,
)
from gatewayd.core.variants import parse_variant
from gatewayd.service.dispatcher import Dispatcher
from gatewayd.service.engine_manager import EngineManager
from tests.virtual_time import VirtualTimeLoop

MODELS = ("a", "b", "c")
GONE = ("inactive", "failed")    # a transient unit is collected in these (CollectMode=)


class FakeUnits:
    """The UnitControl port as the adapters give it over systemd, for transient engine
    units (collected once inactive or failed), with systemd's rules:
    - a start (or a park, which starts a unit too) of a unit that exists and runs is
      refused: UnitAlreadyActive (systemd's UnitExists, as unit_control maps it); a stop
      of a unit that does not exist is done at once with no signal (the adapter's
      NoSuchUnit); a kill of one fails with NoSuchUnit. `refused` lists each refusal;
    - what a listing (list_engines, engine_info) shows changes at once with a start, a
      stop, a kill or a change the test injects (emit); its PropertiesChanged signal
      comes later: a listing may see a state before its signal arrives;
    - signals are delivered by the event loop, one per loop turn, never inside the call
      that sent them, in the order sent (one D-Bus connection keeps order). A start or
      stop returns once its own signals were delivered (systemd sends a unit's pending
      change signals before the job's JobRemoved); a kill returns before (the process
      dies after KillUnit's answer).
    Opt-in: `late_s`, signals arrive that many seconds after they are sent, still in
    order, and jobs do not wait for them (a connection that lost its ordering: a bus
    restart, a signal read after a listing). `delivered()` waits for every signal sent."""

    mode, manager = "transient", "system"

    def __init__(self, run_root: str = "/run") -> None:
        self.run_root = run_root
        self.log: list[str] = []
        self.watchers: list[UnitWatcher] = []
        self.units: dict[str, EngineUnitInfo] = {}         # what a listing shows
        self.fail_start: str | BaseException | None = None   # BaseException: raised as is
        # model -> what check_startable (and so its start) raises: a missing server, file
        self.unstartable: dict[str, GatewayError] = {}
        self.refused: list[str] = []                       # what systemd refused, and why
        self.late_s: float | None = None                   # signals arrive this late (opt-in)
        self.next_pid = 100
        self.visible_devices: dict[str, str | None] = {}   # model -> CUDA_VISIBLE_DEVICES
        self.parks: list[str] = []                         # models parked, in order
        self.memory_high: dict[str, int] = {}              # unit -> MemoryHigh= set on it
        self.on_park: Callable[[str], Any] | None = None   # what a park does meanwhile
        self._parked: list[str] = []                       # parked now (a start wakes one)
        # the bus: (when due, a signal or the answer of a job waiting for its signals)
        self._outbox: deque[tuple[float, tuple[str, dict[str, Any]] | asyncio.Future[None]]] \
            = deque()
        self._pumping = False

    def layout(self, model_id: str) -> EngineLayout:
        return EngineLayout.for_model(model_id, run_root=self.run_root)

    # -- what the tests inject and wait for ------------------------------------------------

    def emit(self, unit: str, **props: Any) -> None:
        """systemd changes the unit (a crash, a restart, a failure): the listing says so
        at once, and the signal goes out (delivered later; see `delivered`). For a unit
        systemd does not have it is a stray signal only."""
        if unit in self.units:
            self._set(unit, **props)
        self._send(unit, props)

    async def delivered(self) -> None:
        """Every signal sent so far has reached the watchers."""
        await self._answer()

    # -- UnitControl -----------------------------------------------------------------------

    def check_startable(self, model: Model) -> None:
        if (error := self.unstartable.get(model.id)) is not None:
            raise error

    async def start_engine(self, model: Model,
                           visible_devices: str | None = None) -> EngineLayout:
        layout = self.layout(model.id)
        unit = layout.unit
        self.log.append(f"start {model.id}")
        self.check_startable(model)   # the adapter's start fails on it too
        self.visible_devices[model.id] = visible_devices
        if isinstance(self.fail_start, BaseException):
            raise self.fail_start
        if self.fail_start:
            raise UnitOperationFailed(self.fail_start)
        if (current := self.units.get(unit)) is not None:
            raise self._exists(f"start {model.id}", unit, current)
        if model.id in self._parked:
            self._parked.remove(model.id)   # the start wakes it
        self.next_pid += 1
        self.units[unit] = EngineUnitInfo(
            unit=unit, model_id=model.id, socket=layout.socket, active_state="activating",
            sub_state="start", main_pid=0, n_restarts=0, memory_bytes=None, started_at_us=0,
            visible_devices=visible_devices, control_group=f"/system.slice/{unit}")
        self._send(unit, {"ActiveState": "inactive", "SubState": "dead"})   # being created
        self.emit(unit, ActiveState="activating", SubState="start")
        self.emit(unit, MainPID=self.next_pid)
        self.emit(unit, ActiveState="active", SubState="running")
        await self._job()
        return layout

    async def stop_engine(self, unit: str) -> None:
        self.log.append(f"stop {unit}")
        if unit not in self.units:
            self.refused.append(f"stop {unit}: NoSuchUnit")
            await asyncio.sleep(0)   # the adapter's stop is done then: no job, no signal
            return
        self.emit(unit, ActiveState="deactivating", SubState="stop-sigterm")
        await self._job()            # the engine exits on SIGTERM
        if unit in self.units:
            self.emit(unit, ActiveState="inactive", SubState="dead", Result="success",
                      MainPID=0)
        await self._job()            # inactive: collected (UnitRemoved)

    def parked(self) -> list[str]:
        return list(self._parked)

    async def park(self, model: Model) -> bool:
        unit = self.layout(model.id).unit
        if (current := self.units.get(unit)) is not None:   # (its parked unit's start)
            raise self._exists(f"park {model.id}", unit, current)
        if self.on_park is not None:
            await self.on_park(model.id)
        self.parks.append(model.id)
        self._parked.append(model.id)
        return True

    async def limit_memory(self, unit: str, high_bytes: int) -> None:
        self.memory_high[unit] = high_bytes
        await asyncio.sleep(0)

    async def kill_engine(self, unit: str) -> None:
        """SIGKILL: Restart=on-failure brings the engine back as a new process."""
        self.log.append(f"kill {unit}")
        info = self.units.get(unit)
        if info is None:
            self.refused.append(f"kill {unit}: NoSuchUnit")
            raise UnitOperationFailed(f"KillUnit failed: Unit {unit} not loaded.",
                                      dbus_error=NO_SUCH_UNIT)
        self.emit(unit, ActiveState="activating", SubState="auto-restart", MainPID=0,
                  ExecMainCode=2, ExecMainStatus=9)
        self.next_pid += 1
        self.emit(unit, NRestarts=info.n_restarts + 1, MainPID=self.next_pid)
        self.emit(unit, ActiveState="active", SubState="running")

    async def list_engines(self) -> list[EngineUnitInfo]:
        listed = list(self.units.values())
        await asyncio.sleep(0)   # the answer's round trip
        return listed

    async def engine_info(self, unit: str) -> EngineUnitInfo | None:
        info = self.units.get(unit)
        await asyncio.sleep(0)
        return info

    def watch(self, callback: UnitWatcher) -> Callable[[], None]:
        self.watchers.append(callback)
        return lambda: self.watchers.remove(callback)

    # -- the bus ---------------------------------------------------------------------------

    def _exists(self, what: str, unit: str, current: EngineUnitInfo) -> UnitAlreadyActive:
        """systemd's UnitExists for a unit that runs (gone ones are collected at once), as
        unit_control raises it."""
        self.refused.append(f"{what}: UnitExists")
        return UnitAlreadyActive(f"{unit} is already {current.active_state}", unit=unit)

    def _set(self, unit: str, **props: Any) -> None:
        info = self.units[unit]
        fields = {"ActiveState": "active_state", "SubState": "sub_state",
                  "MainPID": "main_pid", "NRestarts": "n_restarts"}
        info = replace(info, **{fields[k]: v for k, v in props.items() if k in fields})
        if info.active_state in GONE:
            del self.units[unit]
        else:
            self.units[unit] = info

    def _due(self, delay: float) -> float:
        due = asyncio.get_running_loop().time() + delay
        return max(due, self._outbox[-1][0]) if self._outbox else due   # in order

    def _send(self, unit: str, props: dict[str, Any]) -> None:
        self._outbox.append((self._due(self.late_s or 0.0), (unit, dict(props))))
        self._pump_soon()

    async def _job(self) -> None:
        """A job's end (JobRemoved): after the signals it caused, unless they come late."""
        if self.late_s is None:
            await self._answer()
        else:
            await asyncio.sleep(0)

    async def _answer(self) -> None:
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._outbox.append((self._due(0.0), answer))
        self._pump_soon()
        await answer

    def _pump_soon(self) -> None:
        if self._pumping or not self._outbox:
            return
        self._pumping = True
        loop = asyncio.get_running_loop()
        if self._outbox[0][0] > loop.time():
            loop.call_at(self._outbox[0][0], self._pump)
        else:
            loop.call_soon(self._pump)   # the next loop turn

    def _pump(self) -> None:
        self._pumping = False
        _, message = self._outbox.popleft()
        try:
            if isinstance(message, asyncio.Future):
                if not message.done():
                    message.set_result(None)
            else:
                unit, props = message
                for watcher in list(self.watchers):
                    watcher(unit, props)
        finally:   # (a watcher that raises stops no later signal)
            self._pump_soon()


class FakeHealth:
    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.all_ready = True
        self.hung: set[str] = set()    # sockets whose engine answers nothing (frozen)

    async def status(self, socket: str, timeout: float = 2.0,
                     path: str = "/health") -> int | None:
        if socket in self.hung:
            return None
        return 200 if self.all_ready or socket in self.ready else 503


class MemoryDesired:
    """A desired engine list kept in memory only: for tests on virtual time, where the
    real list's writer thread is an event the virtual clock cannot see coming."""

    def __init__(self) -> None:
        self._ids: list[str] = []

    @property
    def ids(self) -> list[str]:
        return list(self._ids)

    def add(self, model_id: str) -> None:
        if model_id not in self._ids:
            self._ids.append(model_id)

    def remove(self, model_id: str) -> None:
        if model_id in self._ids:
            self._ids.remove(model_id)

    async def flush(self) -> None:
        return None


class FakeJournal:
    async def tail(self, unit: str, lines: int) -> list[str]:
        return [f"{unit}: error loading model", "last line"]


def engine_manager_on_fakes(tmp_path: Path, *, gpu: GpuProbe | None = None,
         max_engines: int = 4, load_timeout_s: float = 5.0, run_root: str = "/run",
         models_config: dict[str, dict[str, Any]] | None = None,
         desired: DesiredList | None = None, journal: JournalReader | None = None,
         kv_cache: KvCacheStore | None = None, learned: MemoryBook | None = None,
         host: HostMemoryProbe | None = None, meter: MemoryMeter | None = None,
         learned_ram: MemoryBook | None = None, estimate: Any = None,
         variants: dict[str, dict[str, Any]] | None = None,
         **config: Any) -> tuple[EngineManager, FakeUnits, FakeHealth]:
    """On virtual time (on_virtual_time) its clock is the loop's and its desired list is
    kept in memory (the real list's writer thread is an event virtual time cannot see).
    A test that looks at a collaborator (the desired list, the journal...) passes its own.
    variants: [models.NAME] tables with variant_of (core/variants), checked and named as
    the configuration's are."""
    models = []
    for name in MODELS:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"x" * (3 * 1024 * 1024))
        settings_ = (models_config or {}).get(name, {})
        models.append(Model(id=name, config=ModelConfig(name=name, path=path, **settings_),
                            names=frozenset({name}), size_bytes=path.stat().st_size))
    settings = GatewayConfig(max_engines=max_engines, vram_margin_mib=100,
                             load_timeout_s=load_timeout_s, state_dir=tmp_path / "state",
                             **config)
    units, health = FakeUnits(run_root), FakeHealth()
    loop = asyncio.get_running_loop()
    virtual = isinstance(loop, VirtualTimeLoop)
    if desired is None:
        desired = MemoryDesired() if virtual else DesiredEngines(settings.state_dir)
    catalog = Catalog(models, {})
    if variants:
        settings = replace(settings, variants=tuple(
            parse_variant(name, table, "test") for name, table in variants.items()))
        catalog = build_catalog(replace(settings, models=tuple(m.config for m in models)), (),
                                {m.config.path: ModelFile(m.size_bytes) for m in models
                                 if m.config.path is not None})
    mgr = EngineManager(catalog=catalog, config=settings, units=units,
                        health=health, gpu=gpu or NoGpu("test"),
                        journal=journal or FakeJournal(), desired=desired, kv_cache=kv_cache,
                        learned=learned, host=host, meter=meter, learned_ram=learned_ram,
                        estimate=estimate,
                        clock=loop.time if virtual else time.monotonic)
    return mgr, units, health


def on_virtual_time(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """The test runs on virtual time (tests/virtual_time.py), not pytest-asyncio's loop: a
    sleep in it is the clock moving on with every timer due meanwhile fired, however slow
    the machine, so a sleep there proves that something did not happen. Fakes only."""
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        loop = VirtualTimeLoop()
        try:
            loop.run_until_complete(test(*args, **kwargs))
        finally:
            loop.close()
    return run


def dispatcher_for(mgr: EngineManager, gpu: GpuProbe | None = None) -> Dispatcher:
    """A dispatcher over mgr, given what it uses as the gateway's app.py does; gpu: the
    one mgr was built on (engine_manager_on_fakes's default when None)."""
    return Dispatcher(mgr, catalog=mgr.catalog, gpu=gpu or NoGpu("test"), config=mgr.config)


def engine_layer_on(mgr: EngineManager, gpu: GpuProbe | None = None
                    ) -> Callable[[web.Application], AsyncIterator[None]]:
    """build_app's engines_ctx for an EngineManager on fakes: it and its dispatcher."""
    from gatewayd.app import DISPATCHER
    from gatewayd.http import admin_api

    async def engines_ctx(app: web.Application) -> AsyncIterator[None]:
        app[admin_api.ENGINES] = mgr
        app[DISPATCHER] = dispatcher_for(mgr, gpu)
        yield
        await app[DISPATCHER].close()
        await mgr.close()
    return engines_ctx
