"""Fakes of the outside world shared by the fast tests: unit control that behaves like
systemd for engine units, a health probe, a journal, and an EngineManager built on them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from gatewayd.adapters.desired import DesiredEngines
from gatewayd.adapters.gpu import NoGpu
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import GatewayConfig, ModelConfig
from gatewayd.core.engine_units import EngineLayout
from gatewayd.core.errors import UnitOperationFailed
from gatewayd.core.ports import EngineUnitInfo, UnitWatcher
from gatewayd.service.dispatcher import Dispatcher
from gatewayd.service.engine_manager import EngineManager

MODELS = ("a", "b", "c")


class FakeUnits:
    """Behaves like systemd for engine units: signals state changes to watchers."""

    mode, manager = "transient", "system"

    def __init__(self, run_root: str = "/run") -> None:
        self.run_root = run_root
        self.log: list[str] = []
        self.watchers: list[UnitWatcher] = []
        self.units: dict[str, EngineUnitInfo] = {}
        self.fail_start: str | BaseException | None = None   # BaseException: raised as is
        self.next_pid = 100
        self.visible_devices: dict[str, str | None] = {}   # model -> CUDA_VISIBLE_DEVICES
        self.parks: list[str] = []                         # models parked, in order
        self.on_park: Callable[[str], Any] | None = None   # what a park does meanwhile

    def layout(self, model_id: str) -> EngineLayout:
        return EngineLayout.for_model(model_id, run_root=self.run_root)

    def emit(self, unit: str, **props: Any) -> None:
        for watcher in list(self.watchers):
            watcher(unit, props)

    async def start_engine(self, model: Model,
                           visible_devices: str | None = None) -> EngineLayout:
        layout = self.layout(model.id)
        self.log.append(f"start {model.id}")
        self.visible_devices[model.id] = visible_devices
        if isinstance(self.fail_start, BaseException):
            raise self.fail_start
        if self.fail_start:
            raise UnitOperationFailed(self.fail_start)
        self.emit(layout.unit, ActiveState="inactive", SubState="dead")
        self.emit(layout.unit, ActiveState="activating", SubState="start")
        self.next_pid += 1
        self.emit(layout.unit, MainPID=self.next_pid)
        self.emit(layout.unit, ActiveState="active", SubState="running")
        return layout

    async def stop_engine(self, unit: str) -> None:
        self.log.append(f"stop {unit}")
        self.emit(unit, ActiveState="deactivating", SubState="stop-sigterm")
        self.emit(unit, ActiveState="inactive", SubState="dead")

    def parked(self) -> list[str]:
        return list(self.parks)

    async def park(self, model: Model) -> bool:
        if self.on_park is not None:
            await self.on_park(model.id)
        self.parks.append(model.id)
        return True

    async def kill_engine(self, unit: str) -> None:
        """SIGKILL: Restart=on-failure brings the engine back as a new process."""
        self.log.append(f"kill {unit}")
        self.emit(unit, ActiveState="activating", SubState="auto-restart", MainPID=0,
                  ExecMainCode=2, ExecMainStatus=9)
        self.next_pid += 1
        self.emit(unit, MainPID=self.next_pid)
        self.emit(unit, ActiveState="active", SubState="running")

    async def list_engines(self) -> list[EngineUnitInfo]:
        return list(self.units.values())

    async def engine_info(self, unit: str) -> EngineUnitInfo | None:
        return self.units.get(unit)

    def watch(self, callback: UnitWatcher) -> Callable[[], None]:
        self.watchers.append(callback)
        return lambda: self.watchers.remove(callback)


class FakeHealth:
    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.all_ready = True
        self.hung: set[str] = set()    # sockets whose engine answers nothing (frozen)

    async def status(self, socket: str, timeout: float = 2.0) -> int | None:
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


def engine_manager_on_fakes(tmp_path: Path, *, gpu: Any = None, max_engines: int = 4,
         load_timeout_s: float = 5.0, run_root: str = "/run",
         models_config: dict[str, dict[str, Any]] | None = None,
         **config: Any) -> tuple[EngineManager, FakeUnits, FakeHealth]:
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
    mgr = EngineManager(catalog=Catalog(models, {}), config=settings, units=units,
                        health=health, gpu=gpu or NoGpu("test"), journal=FakeJournal(),
                        desired=DesiredEngines(settings.state_dir))
    return mgr, units, health


def dispatcher_for(mgr: EngineManager) -> Dispatcher:
    """A dispatcher over mgr, given what it uses as the gateway's app.py does."""
    return Dispatcher(mgr, catalog=mgr.catalog, gpu=mgr.gpu, config=mgr.config)


def engine_layer_on(mgr: EngineManager) -> Callable[[web.Application], AsyncIterator[None]]:
    """build_app's engines_ctx for an EngineManager on fakes: it and its dispatcher."""
    from gatewayd.app import DISPATCHER
    from gatewayd.http import admin_api

    async def engines_ctx(app: web.Application) -> AsyncIterator[None]:
        app[admin_api.ENGINES] = mgr
        app[DISPATCHER] = dispatcher_for(mgr)
        yield
        await app[DISPATCHER].close()
        await mgr.close()
    return engines_ctx
