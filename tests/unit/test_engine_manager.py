"""The engine manager against fakes of systemd, /health, the journal and the GPU."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gatewayd.catalog import Catalog, Model
from gatewayd.config import GatewayConfig, ModelConfig
from gatewayd.desired import DesiredEngines
from gatewayd.engine_manager import EngineManager
from gatewayd.engine_units import EngineLayout
from gatewayd.engines import CLD_KILLED, EngineState
from gatewayd.errors import (
    AlreadyRunning,
    EngineFailed,
    EngineNotRunning,
    InsufficientGpu,
    UnitOperationFailed,
)
from gatewayd.gpu import FakeGpu, NoGpu
from gatewayd.ports import EngineUnitInfo, UnitWatcher

MODELS = ("a", "b", "c")


class FakeUnits:
    """Behaves like systemd for engine units: signals state changes to watchers."""

    mode, manager = "transient", "system"

    def __init__(self, run_root: str = "/run") -> None:
        self.run_root = run_root
        self.log: list[str] = []
        self.watchers: list[UnitWatcher] = []
        self.units: dict[str, EngineUnitInfo] = {}
        self.fail_start: str | None = None
        self.next_pid = 100

    def layout(self, model_id: str) -> EngineLayout:
        return EngineLayout.for_model(model_id, run_root=self.run_root)

    def emit(self, unit: str, **props: Any) -> None:
        for watcher in list(self.watchers):
            watcher(unit, props)

    async def start_engine(self, model: Model) -> EngineLayout:
        layout = self.layout(model.id)
        self.log.append(f"start {model.id}")
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

    async def status(self, socket: str) -> int | None:
        return 200 if self.all_ready or socket in self.ready else 503


class FakeJournal:
    async def tail(self, unit: str, lines: int) -> list[str]:
        return [f"{unit}: error loading model", "last line"]


def make(tmp_path: Path, *, gpu: Any = None, max_engines: int = 4,
         load_timeout_s: float = 5.0, run_root: str = "/run",
         models_config: dict[str, dict[str, Any]] | None = None,
         **config: Any) -> tuple[EngineManager, FakeUnits, FakeHealth]:
    models = []
    for name in MODELS:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"x" * (3 * 1024 * 1024))
        settings_ = (models_config or {}).get(name, {})
        models.append(Model(id=name, config=ModelConfig(name=name, path=path, **settings_),
                            names=frozenset({name})))
    settings = GatewayConfig(max_engines=max_engines, vram_margin_mib=100,
                             load_timeout_s=load_timeout_s, state_dir=tmp_path / "state",
                             **config)
    units, health = FakeUnits(run_root), FakeHealth()
    mgr = EngineManager(catalog=Catalog(models, {}), config=settings, units=units,
                        health=health, gpu=gpu or NoGpu("test"), journal=FakeJournal(),
                        desired=DesiredEngines(settings.state_dir))
    return mgr, units, health


async def test_start_waits_until_ready(tmp_path: Path) -> None:
    mgr, units, _ = make(tmp_path)
    engine = await mgr.start("a")
    assert engine.state is EngineState.READY and engine.main_pid == 101
    assert units.log == ["start a"]
    assert DesiredEngines(tmp_path / "state").ids == ["a"]  # persisted


async def test_concurrent_starts_of_one_model_start_one_unit(tmp_path: Path) -> None:
    mgr, units, _ = make(tmp_path)
    results = await asyncio.gather(mgr.start("a"), mgr.start("a"), return_exceptions=True)
    assert units.log == ["start a"]
    assert sum(isinstance(r, AlreadyRunning) for r in results) == 1


async def test_unit_start_failure_reaches_the_caller_with_log_lines(tmp_path: Path) -> None:
    mgr, units, _ = make(tmp_path)
    units.fail_start = "StartTransientUnit failed: Access denied"
    with pytest.raises(EngineFailed) as err:
        await mgr.start("a")
    failure = err.value.body()["error"]["failure"]
    assert "Access denied" in failure["reason"]
    assert failure["log_tail"][-1] == "last line"
    assert mgr.get("a") is not None and mgr.get("a").state is EngineState.FAILED  # type: ignore[union-attr]


async def test_crash_while_loading_fails_every_waiter(tmp_path: Path) -> None:
    mgr, units, health = make(tmp_path)
    health.all_ready = False
    await mgr.start("a", wait=False)
    waiters = [asyncio.ensure_future(mgr.wait_ready("a")) for _ in range(3)]
    await asyncio.sleep(0.05)
    unit = units.layout("a").unit
    units.emit(unit, ExecMainCode=1, ExecMainStatus=3, Result="exit-code")
    units.emit(unit, ActiveState="failed", SubState="failed")
    results = await asyncio.gather(*waiters, return_exceptions=True)
    for r in results:
        assert isinstance(r, EngineFailed)
        assert r.body()["error"]["failure"]["reason"] == "exited with status 3"
        assert r.body()["error"]["failure"]["log_tail"]


async def test_kill_and_systemd_restart_go_failed_then_ready(tmp_path: Path) -> None:
    mgr, units, _ = make(tmp_path)
    seen: list[EngineState] = []
    mgr.subscribe(lambda old, new: seen.append(new.state) if old.state != new.state else None)
    await mgr.start("a")
    unit = units.layout("a").unit
    units.emit(unit, MainPID=0, ExecMainCode=CLD_KILLED, ExecMainStatus=signal.SIGKILL)
    units.emit(unit, ActiveState="activating", SubState="auto-restart")
    engine = mgr.get("a")
    assert engine is not None and engine.state is EngineState.FAILED
    assert engine.failure is not None and engine.failure.reason == "killed by SIGKILL"
    units.emit(unit, ActiveState="activating", SubState="start", NRestarts=1)
    units.emit(unit, MainPID=555)
    units.emit(unit, ActiveState="active", SubState="running")
    engine = await mgr.wait_ready("a", timeout=2)
    assert engine.restarts == 1 and engine.main_pid == 555
    assert seen[-4:] == [EngineState.FAILED, EngineState.STARTING, EngineState.LOADING,
                         EngineState.READY]


async def test_stop(tmp_path: Path) -> None:
    mgr, _, _ = make(tmp_path)
    await mgr.start("a")
    stopped = await mgr.stop("a")
    assert stopped.state is EngineState.STOPPED and mgr.get("a") is None
    assert DesiredEngines(tmp_path / "state").ids == []
    with pytest.raises(EngineNotRunning):
        await mgr.stop("a")


async def test_limits_and_budget(tmp_path: Path) -> None:
    mgr, units, _ = make(tmp_path, max_engines=1, gpu=FakeGpu(8000, 102))
    with pytest.raises(InsufficientGpu) as err:   # 3 MiB file + 100 MiB margin > 102
        await mgr.start("a")
    assert err.value.extra["required_mib"] == 103 and units.log == []
    mgr, units, _ = make(tmp_path, max_engines=1, gpu=FakeGpu(8000, 4000))
    await mgr.start("a")
    with pytest.raises(Exception, match="limit \\(max_engines\\) is 1"):
        await mgr.start("b")


async def test_adopt_running_units_without_restarting(tmp_path: Path) -> None:
    mgr, units, _ = make(tmp_path)
    layout = units.layout("b")
    units.units[layout.unit] = EngineUnitInfo(
        unit=layout.unit, model_id="b", socket=layout.socket, active_state="active",
        sub_state="running", main_pid=4242, n_restarts=2, memory_bytes=None, started_at_us=1)
    units.units["llm-engine-demo.service"] = EngineUnitInfo(
        unit="llm-engine-demo.service", model_id=None, socket=None, active_state="active",
        sub_state="running", main_pid=7, n_restarts=0, memory_bytes=None, started_at_us=1)
    adopted = await mgr.adopt()
    assert [e.model_id for e in adopted] == ["b"]
    engine = await mgr.wait_ready("b", timeout=2)
    assert engine.main_pid == 4242 and engine.restarts == 2 and engine.adopted
    assert units.log == []    # nothing started


async def test_restore_starts_one_at_a_time_in_order(tmp_path: Path) -> None:
    mgr, units, health = make(tmp_path)
    for name in ("c", "a", "gone"):
        mgr.desired.add(name)
    health.all_ready = False
    order: list[str] = []
    mgr.subscribe(lambda old, new: order.append(f"{new.model_id} {new.state.value}")
                  if old.state != new.state else None)

    async def become_ready_later() -> None:
        for name in ("c", "a"):
            while f"{name} loading" not in order:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            health.ready.add(units.layout(name).socket)
    helper = asyncio.ensure_future(become_ready_later())
    await asyncio.wait_for(mgr.restore(), 5)
    await helper
    assert units.log == ["start c", "start a"]
    assert order.index("c ready") < order.index("a starting")


async def test_load_timeout_fails_and_stops_the_unit(tmp_path: Path) -> None:
    mgr, units, health = make(tmp_path, load_timeout_s=0.2)
    health.all_ready = False
    with pytest.raises(EngineFailed, match="load timeout"):
        await mgr.start("a")
    assert units.log == ["start a", f"stop {units.layout('a').unit}"]


