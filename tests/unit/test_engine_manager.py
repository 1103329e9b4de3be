"""The engine manager against fakes of systemd, /health, the journal and the GPU."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from pathlib import Path

import pytest

from gatewayd.adapters.desired import DesiredEngines
from gatewayd.adapters.gpu import FakeGpu
from gatewayd.adapters.learned_memory import LearnedMemory
from gatewayd.core.engine_units import settings_stamp
from gatewayd.core.engines import CLD_KILLED, EngineState
from gatewayd.core.errors import (
    AlreadyRunning,
    EngineFailed,
    EngineLimitReached,
    EngineNotRunning,
    InsufficientGpu,
)
from gatewayd.core.ports import EngineUnitInfo
from gatewayd.service import failure_logs, park_queue
from gatewayd.service.restore import adopt, restore
from tests.fakes import engine_manager_on_fakes, on_virtual_time


async def test_start_waits_until_ready(tmp_path: Path) -> None:
    desired = DesiredEngines(tmp_path / "state")
    mgr, units, _ = engine_manager_on_fakes(tmp_path, desired=desired)
    engine = await mgr.lifecycle.start("a")
    assert engine.state is EngineState.READY and engine.main_pid == 101
    assert units.log == ["start a"]
    assert desired.ids == ["a"]
    await desired.flush()
    assert DesiredEngines(tmp_path / "state").ids == ["a"]  # persisted


async def test_the_journal_says_how_long_the_unit_and_the_model_took(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Where a cold start went, in the engine's two transitions: unit start, model load."""
    mgr, _, health = engine_manager_on_fakes(tmp_path)
    health.all_ready = False
    with caplog.at_level(logging.INFO, logger="gatewayd.engines"):
        start = asyncio.ensure_future(mgr.lifecycle.start("a"))
        await asyncio.sleep(0.05)                  # the model "loads" for 50 ms
        health.all_ready = True
        await start
    lines = caplog.text
    assert re.search(r"a: starting -> loading after \d+ ms", lines), lines
    took = re.search(r"a: loading -> ready after (\d+) ms", lines)
    assert took and int(took.group(1)) >= 45, lines
    assert "stopped -> starting after" not in lines   # only the phases a start waits on
    await mgr.close()


async def test_concurrent_starts_of_one_model_start_one_unit(tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    results = await asyncio.gather(mgr.lifecycle.start("a"), mgr.lifecycle.start("a"),
                                   return_exceptions=True)
    assert units.log == ["start a"]
    assert sum(isinstance(r, AlreadyRunning) for r in results) == 1


async def test_unit_start_failure_reaches_the_caller_with_log_lines(tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    units.fail_start = "StartTransientUnit failed: Access denied"
    with pytest.raises(EngineFailed) as err:
        await mgr.lifecycle.start("a")
    failure = err.value.body()["error"]["failure"]
    assert "Access denied" in failure["reason"]
    assert failure["log_tail"][-1] == "last line"
    assert mgr.registry.get("a") is not None and mgr.registry.get("a").state is EngineState.FAILED  # type: ignore[union-attr]


@pytest.mark.parametrize("error", [ValueError("argv[0] must be an absolute path"),
                                   TimeoutError(), OSError(28, "No space left on device"),
                                   RuntimeError("File descriptor 7 is used by transport")])
async def test_a_start_is_a_transaction_whatever_the_adapter_raises(
        tmp_path: Path, error: BaseException) -> None:
    """Failed with the reason, waiters told, not on the list restored after a reboot; and
    the next start is tried (after the backoff), not waited on forever."""
    desired = DesiredEngines(tmp_path / "state")
    mgr, units, _ = engine_manager_on_fakes(tmp_path, desired=desired)
    units.fail_start = error
    waiter = None

    def wait_when_starting(old: object, new: object) -> None:
        nonlocal waiter
        if waiter is None:
            waiter = asyncio.ensure_future(mgr.lifecycle.wait_ready("a"))
    mgr.registry.subscribe(wait_when_starting)
    with pytest.raises(EngineFailed) as err:
        await mgr.lifecycle.start("a")
    assert type(error).__name__ in err.value.message
    engine = mgr.registry.get("a")
    assert engine is not None and engine.state is EngineState.FAILED and not engine.holds_place
    assert waiter is not None
    with pytest.raises(EngineFailed):
        await asyncio.wait_for(waiter, 1)
    await desired.flush()
    assert DesiredEngines(tmp_path / "state").ids == []
    assert mgr.registry.backoff_left("a") > 0
    units.fail_start = None
    assert (await mgr.lifecycle.start("a")).state is EngineState.READY   # an explicit start retries


async def test_an_unwritable_state_directory_does_not_fail_a_start(tmp_path: Path) -> None:
    mgr, _, _ = engine_manager_on_fakes(tmp_path)
    (tmp_path / "state").write_text("a file where the directory should be")  # even for root
    engine = await mgr.lifecycle.start("a")
    assert engine.state is EngineState.READY


async def test_crash_while_loading_fails_every_waiter(tmp_path: Path) -> None:
    mgr, units, health = engine_manager_on_fakes(tmp_path)
    health.all_ready = False
    await mgr.lifecycle.start("a", wait=False)
    waiters = [asyncio.ensure_future(mgr.lifecycle.wait_ready("a")) for _ in range(3)]
    while len(mgr.registry._waiters.get("a", [])) < 3:       # all three are waiting
        await asyncio.sleep(0.005)
    unit = units.layout("a").unit
    units.emit(unit, ExecMainCode=1, ExecMainStatus=3, Result="exit-code")
    units.emit(unit, ActiveState="failed", SubState="failed")
    results = await asyncio.gather(*waiters, return_exceptions=True)
    for r in results:
        assert isinstance(r, EngineFailed)
        # (no auto-restart followed: systemd, asked, says it is failed and gone)
        assert r.body()["error"]["failure"]["reason"] == (
            "exited with status 3; systemd gave up restarting it after 0 restart(s)")
        assert r.body()["error"]["failure"]["log_tail"]


async def test_the_failure_gets_the_journal_lines_written_after_the_exit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """journald writes a dead engine's last stderr lines after systemd reports its exit:
    the first read misses them; the failure ends up with them all the same."""
    monkeypatch.setattr(failure_logs, "LOG_REREAD_S", (0.01, 0.02))
    written = ["llama-server starting"]

    class LaggingJournal:
        async def tail(self, unit: str, lines: int) -> list[str]:
            return list(written)
    mgr, units, health = engine_manager_on_fakes(tmp_path, journal=LaggingJournal())
    health.all_ready = False
    await mgr.lifecycle.start("a", wait=False)
    unit = units.layout("a").unit
    units.emit(unit, ExecMainCode=1, ExecMainStatus=3, Result="exit-code")
    units.emit(unit, ActiveState="failed", SubState="failed")
    with pytest.raises(EngineFailed):
        await mgr.lifecycle.wait_ready("a", timeout=2)
    written.append("error: cannot load the model")     # journald caught up
    deadline = asyncio.get_running_loop().time() + 2
    while "error: cannot load the model" not in mgr.registry.get("a").failure.log_tail:  # type: ignore[union-attr]
        assert asyncio.get_running_loop().time() < deadline, mgr.registry.get("a")
        await asyncio.sleep(0.005)
    await mgr.close()


async def test_kill_and_systemd_restart_go_restarting_then_ready(tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    seen: list[EngineState] = []
    mgr.registry.subscribe(
        lambda old, new: seen.append(new.state) if old.state != new.state else None)
    await mgr.lifecycle.start("a")
    unit = units.layout("a").unit
    units.emit(unit, MainPID=0, ExecMainCode=CLD_KILLED, ExecMainStatus=signal.SIGKILL)
    units.emit(unit, ActiveState="activating", SubState="auto-restart")
    await units.delivered()
    engine = mgr.registry.get("a")
    assert engine is not None and engine.state is EngineState.RESTARTING
    assert engine.failure is not None and engine.failure.reason == "killed by SIGKILL"
    waiter = asyncio.ensure_future(mgr.lifecycle.wait_ready("a", timeout=2))   # waits, not failed
    units.emit(unit, ActiveState="activating", SubState="start", NRestarts=1)
    units.emit(unit, MainPID=555)
    units.emit(unit, ActiveState="active", SubState="running")
    engine = await waiter
    assert engine.restarts == 1 and engine.main_pid == 555
    assert seen[-3:] == [EngineState.RESTARTING, EngineState.LOADING, EngineState.READY]


async def test_stop(tmp_path: Path) -> None:
    desired = DesiredEngines(tmp_path / "state")
    mgr, _, _ = engine_manager_on_fakes(tmp_path, desired=desired)
    await mgr.lifecycle.start("a")
    stopped = await mgr.lifecycle.stop("a")
    assert stopped.state is EngineState.STOPPED and mgr.registry.get("a") is None
    await desired.flush()
    assert DesiredEngines(tmp_path / "state").ids == []
    with pytest.raises(EngineNotRunning):
        await mgr.lifecycle.stop("a")


async def test_limits_and_budget(tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path, max_engines=1, gpu=FakeGpu(8000, 102))
    with pytest.raises(InsufficientGpu) as err:   # 3 MiB file + 100 MiB margin > 102
        await mgr.lifecycle.start("a")
    assert err.value.extra["required_mib"] == 103 and units.log == []
    mgr, units, _ = engine_manager_on_fakes(tmp_path, max_engines=1, gpu=FakeGpu(8000, 4000))
    await mgr.lifecycle.start("a")
    with pytest.raises(EngineLimitReached, match="limit \\(max_engines\\) is 1"):
        await mgr.lifecycle.start("b")


async def test_adopt_running_units_without_restarting(tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    layout = units.layout("b")
    units.units[layout.unit] = EngineUnitInfo(
        unit=layout.unit, model_id="b", socket=layout.socket, active_state="active",
        sub_state="running", main_pid=4242, n_restarts=2, memory_bytes=None, started_at_us=1)
    units.units["llm-engine-demo.service"] = EngineUnitInfo(
        unit="llm-engine-demo.service", model_id=None, socket=None, active_state="active",
        sub_state="running", main_pid=7, n_restarts=0, memory_bytes=None, started_at_us=1)
    adopted = await adopt(mgr)
    assert [e.model_id for e in adopted] == ["b"]
    engine = await mgr.lifecycle.wait_ready("b", timeout=2)
    assert engine.main_pid == 4242 and engine.restarts == 2 and engine.adopted
    assert units.log == []    # nothing started


async def test_restore_starts_one_at_a_time_in_order(tmp_path: Path) -> None:
    desired = DesiredEngines(tmp_path / "state")
    for name in ("c", "a", "gone"):
        desired.add(name)
    mgr, units, health = engine_manager_on_fakes(tmp_path, desired=desired)
    health.all_ready = False
    order: list[str] = []
    mgr.registry.subscribe(lambda old, new: order.append(f"{new.model_id} {new.state.value}")
                  if old.state != new.state else None)

    async def become_ready_later() -> None:
        for name in ("c", "a"):
            while f"{name} loading" not in order:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            health.ready.add(units.layout(name).socket)
    helper = asyncio.ensure_future(become_ready_later())
    await asyncio.wait_for(restore(mgr), 5)
    await helper
    assert units.log == ["start c", "start a"]
    assert order.index("c ready") < order.index("a starting")


async def test_load_timeout_fails_and_stops_the_unit(tmp_path: Path) -> None:
    mgr, units, health = engine_manager_on_fakes(tmp_path, load_timeout_s=0.2)
    health.all_ready = False
    with pytest.raises(EngineFailed, match="load timeout"):
        await mgr.lifecycle.start("a")
    assert units.log == ["start a", f"stop {units.layout('a').unit}"]




class MeasuringGpu(FakeGpu):
    """A device whose per-process figures the test sets."""

    def __init__(self, total_mib: int, free_mib: int) -> None:
        super().__init__(total_mib, free_mib)
        self.per_process: dict[int, int] = {}

    def process_mib(self) -> dict[int, int] | None:
        return dict(self.per_process)


async def test_gpu_memory_is_learned_from_the_engine_and_replaces_the_estimate(
        tmp_path: Path) -> None:
    gpu = MeasuringGpu(8000, 4000)
    mgr, _, _ = engine_manager_on_fakes(tmp_path, gpu=gpu,
                                        learned=LearnedMemory(tmp_path / "state"))
    model = mgr.catalog.get("a")
    assert model is not None
    # 3 + 100 margin
    assert mgr.capacity.need_mib(model) == 103 and mgr.capacity.measured_mib(model) is None
    engine = await mgr.lifecycle.start("a")
    gpu.per_process = {engine.main_pid: 1500}      # what its process really holds
    assert mgr.learn_memory() == ["a"] and mgr.learn_memory() == []
    assert mgr.capacity.measured_mib(model) == 1500 and mgr.capacity.need_mib(model) == 1600
    # kept in the state directory for the next gateway, per engine setup
    assert LearnedMemory(tmp_path / "state").get(settings_stamp(model, mgr.config)) == 1500
    await mgr.lifecycle.stop("a")
    gpu.free_mib = 1599                            # the estimate (103) would fit; the truth not
    with pytest.raises(InsufficientGpu) as err:
        await mgr.lifecycle.start("a")
    assert err.value.extra["required_mib"] == 1600


async def test_gpu_memory_held_by_the_units_other_processes_is_learned_too(
        tmp_path: Path) -> None:
    """A TCP engine's main process is the launcher, and vLLM's GPU work runs in its
    workers: what NVML shows is summed over every process of the unit's cgroup."""
    from tests.unit.test_ram_budget import FakeMeter
    gpu, meter = MeasuringGpu(8000, 4000), FakeMeter()
    mgr, _, _ = engine_manager_on_fakes(tmp_path, gpu=gpu, meter=meter,
                                            learned=LearnedMemory(tmp_path / "state"))
    model = mgr.catalog.get("a")
    assert model is not None
    engine = await mgr.lifecycle.start("a")
    meter.processes[f"/system.slice/{engine.unit}"] = [engine.main_pid, 4242, 4243]
    gpu.per_process = {4242: 1200, 4243: 300, 999: 7000}   # 999: another unit's
    assert mgr.learn_memory() == ["a"]
    assert mgr.capacity.measured_mib(model) == 1500


# -- parking: a stopped engine's unit is parked once nothing is starting -------------


async def _wait(predicate: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():   # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_a_stopped_engine_is_parked_after_its_stop(tmp_path: Path) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    await mgr.lifecycle.start("a")
    await mgr.lifecycle.stop("a")
    await _wait(lambda: units.parks == ["a"])
    assert units.log == ["start a", f"stop {units.layout('a').unit}"]
    await mgr.close()


@on_virtual_time
async def test_parking_waits_until_no_engine_is_starting(tmp_path: Path) -> None:
    """Creating a unit is systemd's work too: it must not slow someone's start."""
    mgr, units, health = engine_manager_on_fakes(tmp_path)
    await mgr.lifecycle.start("a")
    health.all_ready = False
    loading = asyncio.ensure_future(mgr.lifecycle.start("b"))
    await _wait(lambda: (e := mgr.registry.get("b")) is not None and e.state is EngineState.LOADING)
    await mgr.lifecycle.stop("a")
    await asyncio.sleep(4 * park_queue.PARK_QUIET_POLL_S)   # (virtual) the parker's looks
    assert units.parks == []
    assert (e := mgr.registry.get("b")) is not None and e.state is EngineState.LOADING   # still
    health.all_ready = True
    await loading
    await _wait(lambda: units.parks == ["a"])
    await mgr.close()


@on_virtual_time
async def test_a_model_started_again_before_its_park_is_not_parked(tmp_path: Path) -> None:
    mgr, units, health = engine_manager_on_fakes(tmp_path)
    await mgr.lifecycle.start("b")
    health.all_ready = False
    loading = asyncio.ensure_future(mgr.lifecycle.start("a"))   # the park of b waits for it
    await _wait(lambda: (e := mgr.registry.get("a")) is not None and e.state is EngineState.LOADING)
    await mgr.lifecycle.stop("b")
    again = asyncio.ensure_future(mgr.lifecycle.start("b"))
    await _wait(lambda: (e := mgr.registry.get("b")) is not None and e.state is EngineState.LOADING)
    health.all_ready = True
    await asyncio.gather(loading, again)
    await asyncio.sleep(4 * park_queue.PARK_QUIET_POLL_S)   # (virtual) the parker's looks
    assert units.parks == [] and units.refused == []   # not parked, not even tried
    assert units.log.count("start b") == 2
    await mgr.close()


@on_virtual_time
async def test_a_start_during_a_park_waits_for_it_then_starts(tmp_path: Path) -> None:
    """The park holds the model's lifecycle: the start that comes meanwhile follows it
    (and wakes the parked unit, in the adapter), never overlaps it."""
    mgr, units, _ = engine_manager_on_fakes(tmp_path)
    parking, release = asyncio.Event(), asyncio.Event()

    async def slow_park(model_id: str) -> None:
        parking.set()
        await release.wait()
    units.on_park = slow_park
    await mgr.lifecycle.start("a")
    await mgr.lifecycle.stop("a")
    await asyncio.wait_for(parking.wait(), 5)
    start = asyncio.ensure_future(mgr.lifecycle.start("a"))
    await asyncio.sleep(1.0)   # (virtual) long enough for a whole start, were it not held
    assert not start.done() and units.log.count("start a") == 1
    release.set()
    engine = await asyncio.wait_for(start, 5)
    assert engine.state is EngineState.READY and units.parks == ["a"]
    assert units.log.count("start a") == 2
    await mgr.close()


async def test_a_failed_park_leaves_the_next_start_as_it_was(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr, units, _ = engine_manager_on_fakes(tmp_path)

    async def broken(model_id: str) -> None:
        raise OSError(28, "No space left on device")
    units.on_park = broken
    await mgr.lifecycle.start("a")
    with caplog.at_level(logging.WARNING, logger="gatewayd.engines"):
        await mgr.lifecycle.stop("a")
        await _wait(lambda: "could not park" in caplog.text)
    assert "No space left" in caplog.text
    engine = await mgr.lifecycle.start("a")
    assert engine.state is EngineState.READY
    await mgr.close()


async def test_a_ready_hook_that_raises_leaves_the_engine_ready_not_loading(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """What runs before an engine is ready (the front door's question about its parallel
    slots, the KV restore) must never keep it loading: its poller has ended, nothing would
    time it out."""
    mgr, _, _ = engine_manager_on_fakes(tmp_path)

    async def broken(model: object, socket: str) -> None:
        raise RuntimeError("the engine answered nonsense")
    mgr.hooks.before_ready(broken)
    with caplog.at_level(logging.WARNING, logger="gatewayd.engines"):
        engine = await asyncio.wait_for(mgr.lifecycle.start("a"), 5)
    assert engine.state is EngineState.READY
    assert "the engine answered nonsense" in caplog.text
    await mgr.close()


async def test_the_gateways_stop_keeps_the_last_start_for_the_next_boot(tmp_path: Path) -> None:
    """The desired list is written in the background: the stop waits for it."""
    mgr, _, _ = engine_manager_on_fakes(tmp_path)
    await mgr.lifecycle.start("a")
    await mgr.close()
    assert DesiredEngines(tmp_path / "state").ids == ["a"]
