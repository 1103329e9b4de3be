"""An engine restart is a wait, not an error (issue 41): requests that arrive while
systemd restarts an engine are served by the restarted one; only systemd giving up, or
the wait running out, answers an error, and that error says why."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from gatewayd.adapters.metrics import GatewayMetrics
from gatewayd.core.engines import CLD_EXITED, CLD_KILLED, EngineState
from gatewayd.core.errors import (
    EngineFailed,
    EngineNotRunning,
    ModelNotLoaded,
    UnitOperationFailed,
)
from gatewayd.service.dispatcher import Dispatcher
from tests.fakes import FakeUnits, dispatcher_for, engine_manager_on_fakes


async def crash(units: FakeUnits, model: str, *, code: int = CLD_KILLED,
                status: int = signal.SIGKILL) -> None:
    """The engine's process dies; systemd will restart it (RestartSec pending)."""
    unit = units.layout(model).unit
    units.emit(unit, MainPID=0, ExecMainCode=code, ExecMainStatus=status, Result="signal"
               if code == CLD_KILLED else "exit-code")
    units.emit(unit, ActiveState="activating", SubState="auto-restart")
    await units.delivered()


async def restart(units: FakeUnits, model: str, pid: int) -> None:
    """systemd's restart: the start job, then the new process running."""
    unit = units.layout(model).unit
    units.emit(unit, ActiveState="activating", SubState="start", NRestarts=1, MainPID=pid)
    units.emit(unit, ActiveState="active", SubState="running")
    await units.delivered()


async def served(d: Dispatcher, model: str, *, autoload: bool = True) -> int:
    async with d.serve(model, autoload=autoload) as engine:
        return engine.main_pid


async def queued(d: Dispatcher, model: str, count: int,
                 requests: list[asyncio.Future[int]]) -> None:
    """Until count requests wait for model (each still unanswered)."""
    deadline = asyncio.get_running_loop().time() + 5
    while d._turns.queued(model) < count:
        answered = [r for r in requests if r.done()]
        assert not answered, [r.exception() or r.result() for r in answered]
        assert asyncio.get_running_loop().time() < deadline, "never queued"
        await asyncio.sleep(0.001)


async def test_requests_during_a_restart_wait_and_are_served_by_the_restarted_engine(
        tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    d = dispatcher_for(mgr)
    first = await served(d, "a")
    await crash(units, "a")
    assert mgr.registry.get("a").state is EngineState.RESTARTING   # type: ignore[union-attr]
    requests: list[asyncio.Future[int]] = [
        asyncio.ensure_future(served(d, "a")) for _ in range(3)]
    await queued(d, "a", 3, requests)
    assert not any(r.done() for r in requests)            # waiting, not answered
    assert units.log == ["start a"]                       # and no start of our own
    await restart(units, "a", pid=first + 50)
    assert await asyncio.gather(*requests) == [first + 50] * 3
    await d.close()
    await mgr.close()


async def test_autoload_false_during_a_restart_is_a_503_with_retry_after(
        tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    d = dispatcher_for(mgr)
    await served(d, "a")
    await crash(units, "a")
    with pytest.raises(ModelNotLoaded) as err:
        await served(d, "a", autoload=False)
    assert err.value.status == 503 and err.value.retry_after == 1
    assert "restarting" in err.value.message
    await d.close()
    await mgr.close()


async def test_when_systemd_gives_up_every_waiter_hears_why(tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    d = dispatcher_for(mgr)
    await served(d, "a")
    await crash(units, "a", code=CLD_EXITED, status=3)
    requests: list[asyncio.Future[int]] = [
        asyncio.ensure_future(served(d, "a")) for _ in range(2)]
    await queued(d, "a", 2, requests)
    unit = units.layout("a").unit
    # systemd 252 at the start limit: "failed", the result still the last exit's; asked,
    # it says the unit is failed (collected, here)
    units.emit(unit, ActiveState="activating", SubState="start", NRestarts=4)
    units.emit(unit, ActiveState="failed", SubState="failed", Result="exit-code")
    for r in await asyncio.gather(*requests, return_exceptions=True):
        assert isinstance(r, EngineFailed), r
        assert r.status == 502
        assert ("exited with status 3; systemd gave up restarting it after 4 restart(s)"
                in r.message)
    await d.close()
    await mgr.close()


async def test_a_wait_that_runs_out_during_a_restart_says_it_is_restarting(
        tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    await mgr.lifecycle.start("a")
    await crash(units, "a", code=CLD_KILLED, status=signal.SIGSEGV)
    with pytest.raises(EngineFailed) as err:
        await mgr.lifecycle.wait_ready("a", timeout=0.05)
    assert "was not ready within 0.05s: systemd is restarting it (killed by SIGSEGV" \
        in err.value.message
    await mgr.close()


async def test_a_restart_is_counted_as_a_restart_not_a_failed_start(tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    metrics = GatewayMetrics()
    mgr.registry.subscribe(lambda old, new: metrics.on_engine_change(old, new, None))
    await mgr.lifecycle.start("a")
    await crash(units, "a")
    await restart(units, "a", pid=777)
    await mgr.lifecycle.wait_ready("a", timeout=2)
    assert metrics.restarts.values == {("a", "signal"): 1}
    assert metrics.starts.values == {("a", "ok"): 1}      # the one start, not two
    await mgr.close()


async def test_a_kill_that_finds_no_unit_leaves_no_one_waiting_for_a_restart(
        tmp_path: Path) -> None:
    """The hung engine's unit is already gone (its signals lost): KillUnit says NoSuchUnit,
    no restart is coming, so it is stopped and its waiters are told at once."""
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    engine = await mgr.lifecycle.start("a")
    del units.units[engine.unit]                       # gone behind the gateway's back
    await mgr.lifecycle.kill_unresponsive("a", engine.main_pid, 3.0)
    after = mgr.registry.get("a")
    assert after is not None and after.state is EngineState.STOPPED, after
    with pytest.raises(EngineNotRunning):
        await mgr.lifecycle.wait_ready("a", timeout=1)
    await mgr.close()


async def test_a_start_job_that_fails_because_systemd_restarts_its_process_is_a_wait(
        tmp_path: Path) -> None:
    """The process dies while its start job runs (killed mid-load): the job fails, but
    systemd restarts the unit (its signals come before the job's end). That is the
    restart, and the caller waits for it; not a failed start."""
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    real_start = units.start_engine

    async def start_that_dies(model: Any, visible: str | None = None) -> Any:
        layout = await real_start(model, visible)
        await crash(units, model.id)                  # then the job's end says failed
        raise UnitOperationFailed(f"job for {layout.unit} failed", unit=layout.unit)
    units.start_engine = start_that_dies  # type: ignore[method-assign, assignment]
    starting = asyncio.ensure_future(mgr.lifecycle.start("a"))
    while (e := mgr.registry.get("a")) is None or not e.restarting:
        assert not starting.done(), starting
        await asyncio.sleep(0.001)
    await restart(units, "a", pid=4242)
    engine = await starting
    assert engine.state is EngineState.READY and engine.main_pid == 4242
    assert mgr.desired() == ["a"]                     # a start that happened: wanted
    await mgr.close()
