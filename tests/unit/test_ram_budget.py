"""RAM as a budget beside the GPU's (issue 36): the ledger, the scheduler's decisions,
admission and eviction on a fake systemd, and an OOM kill as its own outcome."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gatewayd.core import scheduler
from gatewayd.core.catalog import Model
from gatewayd.core.engines import CLD_KILLED, EngineState
from gatewayd.core.errors import EngineOutOfMemory, InsufficientMemory
from gatewayd.core.memory_estimate import EngineSettings, MemoryEstimate, estimate
from gatewayd.core.placement import DeviceMemory
from gatewayd.core.ports import MemoryUse
from gatewayd.core.ram_budget import EngineRam, HostMemory, ram_ledger
from gatewayd.service.dispatcher import Dispatcher
from gatewayd.service.engine_manager import EngineManager
from tests.fakes import FakeUnits, dispatcher_for, engine_manager_on_fakes

MIB = 1024 * 1024

# -- the ledger ------------------------------------------------------------------------


def test_free_ram_is_what_is_available_less_the_reserve_and_what_loads_will_take() -> None:
    ledger = ram_ledger(HostMemory(total_mib=16000, available_mib=9000), [
        EngineRam("a", ready=True, need_mib=4000, measured_mib=4100),
        EngineRam("b", ready=False, need_mib=3000, measured_mib=1000)],
        reserve_mib=1000)
    assert ledger.pending_mib == 2000 and ledger.claimed_mib == 7100
    assert ledger.plan_free_mib == 9000 - 1000 - 2000


def test_an_engines_mapped_weights_counted_as_available_are_still_its_own() -> None:
    """llama-server's weights are page cache, which MemAvailable counts as free: the
    engines' claims against the total keep a new model out of them."""
    ledger = ram_ledger(HostMemory(total_mib=16000, available_mib=15000), [
        EngineRam("a", ready=True, need_mib=8000, measured_mib=8000)], reserve_mib=1000)
    assert ledger.plan_free_mib == 16000 - 1000 - 8000


def test_a_budget_caps_what_the_engines_hold_together() -> None:
    ledger = ram_ledger(HostMemory(total_mib=64000, available_mib=60000), [
        EngineRam("a", ready=True, need_mib=3000)], reserve_mib=1000, budget_mib=8000)
    assert ledger.plan_free_mib == 5000
    assert ledger.ceiling_mib == 8000    # every engine stopped: the budget


def test_nothing_free_is_zero_not_negative() -> None:
    ledger = ram_ledger(HostMemory(total_mib=4000, available_mib=500), [], reserve_mib=1000)
    assert ledger.plan_free_mib == 0 and ledger.ceiling_mib == 0

# -- the scheduler ---------------------------------------------------------------------


def usage(model: str, **kw: Any) -> scheduler.Usage:
    return scheduler.Usage(model_id=model, state=kw.pop("state", EngineState.READY), **kw)


def test_short_of_ram_the_least_recently_used_idle_engine_goes_whatever_its_device() -> None:
    usages = [usage("a", last_used=1, devices=("GPU-1",)), usage("b", last_used=2),
              usage("c", last_used=0, in_flight=1)]
    decision = scheduler.plan_start("d", usages, max_engines=8, need_mib=10, free_mib=100,
                                    devices=frozenset({"GPU-0"}), ram_need_mib=500,
                                    ram_free_mib=200)
    assert decision == scheduler.Evict("a", "making room for d: needs 500 MiB of RAM, "
                                            "200 MiB free")


def test_short_of_ram_with_nothing_that_may_go_is_blocked_never_tried_anyway() -> None:
    decision = scheduler.plan_start("d", [], max_engines=8, need_mib=10, free_mib=None,
                                    ram_need_mib=500, ram_free_mib=200)
    assert decision == scheduler.Blocked("ram", ())


def test_a_model_behind_the_line_takes_ram_only_beyond_what_those_ahead_need() -> None:
    kw: dict[str, Any] = dict(max_engines=8, need_mib=0, free_mib=None, ahead=1,
                              ram_need_mib=300, ram_free_mib=1000)
    assert scheduler.plan_start("d", [], ahead_ram_mib=600, **kw) == scheduler.Fits()
    assert isinstance(scheduler.plan_start("d", [], ahead_ram_mib=800, **kw), scheduler.Wait)

# -- admission and eviction on a fake systemd ------------------------------------------


class FakeHost:
    def __init__(self, total_mib: int = 64000, available_mib: int = 60000) -> None:
        self.total, self.available = total_mib, available_mib
        self.ooms: int | None = 0     # the kernel's OOM kills on the machine

    def read(self) -> HostMemory:
        return HostMemory(self.total, self.available)

    def oom_kills(self) -> int | None:
        return self.ooms


class FakeMeter:
    """Each engine's cgroup holds `holds` MiB; `oom_kills` per cgroup as the kernel counts."""

    def __init__(self, holds: int = 3) -> None:
        self.holds = holds
        self.oom_kills: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.processes: dict[str, list[int]] = {}   # per cgroup (None: MainPID alone)
        self.gone = False

    def read(self, control_group: str) -> MemoryUse | None:
        if self.gone:
            return None   # systemd removed the empty cgroup (it does, restart pending)
        return MemoryUse(self.holds * MIB, self.peak.get(control_group, self.holds) * MIB,
                         "cgroup", self.oom_kills.get(control_group, 0))

    def pids(self, control_group: str) -> list[int] | None:
        return None if self.gone else self.processes.get(control_group)


class Book:
    def __init__(self) -> None:
        self.figures: dict[str, int] = {}
        self.models: dict[str, str] = {}

    def get(self, key: str) -> int | None:
        return self.figures.get(key)

    def record(self, key: str, model_id: str, mib: int) -> bool:
        changed = self.figures.get(key) != mib
        self.figures[key] = mib
        self.models[key] = model_id
        return changed

    def forget_model(self, model_id: str) -> int:
        gone = [k for k, m in self.models.items() if m == model_id]
        for key in gone:
            del self.figures[key], self.models[key]
        return len(gone)


def on_ram(tmp_path: Path, budget_mib: int, host: FakeHost | None = None, **kw: Any
           ) -> tuple[Dispatcher, EngineManager, FakeUnits, FakeMeter, Book]:
    """Models a..d, 3 MiB files each; no GPU, so each needs its files in RAM (no margin)."""
    meter, book = FakeMeter(), Book()
    mgr, units, _ = engine_manager_on_fakes(
        tmp_path, host=host or FakeHost(), meter=meter, learned_ram=book, ram_budget_mib=budget_mib,
        ram_reserve_mib=0, ram_margin_mib=0, **kw)
    return dispatcher_for(mgr), mgr, units, meter, book


async def use(d: Dispatcher, model: str) -> None:
    async with d.serve(model, autoload=True):
        pass


async def test_a_ram_budget_for_two_evicts_the_least_recently_used_for_the_third(
        tmp_path: Path) -> None:
    d, mgr, units, _, book = on_ram(tmp_path, budget_mib=7)
    await use(d, "a")
    await use(d, "b")
    await use(d, "a")                       # b is now the least recently used
    await use(d, "c")
    assert units.log == ["start a", "start b", "stop llm-engine-b.service", "start c"]
    assert set(book.figures.values()) == {3}   # learned from the cgroups
    await d.close()
    await mgr.close()


async def test_a_busy_engine_is_never_evicted_for_ram(tmp_path: Path) -> None:
    d, mgr, units, _, _ = on_ram(tmp_path, budget_mib=7)
    await use(d, "a")
    await use(d, "b")
    async with d.serve("a", autoload=True, counts_as_use=False):   # a: older, but busy
        await use(d, "c")
    assert "stop llm-engine-a.service" not in units.log
    assert "stop llm-engine-b.service" in units.log
    await d.close()
    await mgr.close()


async def test_more_than_the_budget_could_ever_give_is_refused_at_once_naming_ram(
        tmp_path: Path) -> None:
    d, mgr, units, _, _ = on_ram(tmp_path, budget_mib=2, eviction_wait_s=30)
    started = time.monotonic()
    with pytest.raises(InsufficientMemory) as err:
        await use(d, "a")
    assert time.monotonic() - started < 5          # not after the eviction wait
    body = err.value.body()["error"]
    assert body["code"] == "insufficient_memory" and body["memory"] == "ram"
    assert body["required_mib"] == 3 and body["ceiling_mib"] == 2
    assert "needs about 3 MiB of RAM" in body["message"]
    assert "ram_budget_mib" in body["message"]
    assert err.value.retry_after is None and units.log == []
    await d.close()
    await mgr.close()


async def test_no_ram_left_and_nothing_may_go_names_ram_after_the_wait(tmp_path: Path) -> None:
    d, mgr, units, _, _ = on_ram(tmp_path, budget_mib=7, eviction_wait_s=0.3,
                                 models_config={"a": {"pin": True}, "b": {"pin": True}})
    await use(d, "a")
    await use(d, "b")
    with pytest.raises(InsufficientMemory) as err:
        await use(d, "c")
    body = err.value.body()["error"]
    assert body["free_mib"] == 1 and "a (pinned)" in body["message"]
    assert err.value.retry_after == 5 and units.log == ["start a", "start b"]
    await d.close()
    await mgr.close()

# -- an OOM kill ------------------------------------------------------------------------


async def oom_kill(units: FakeUnits, meter: FakeMeter, model: str) -> None:
    """The kernel kills the engine in its cgroup (v1: systemd only sees a SIGKILL)."""
    unit = units.layout(model).unit
    cgroup = f"/system.slice/{unit}"
    meter.oom_kills[cgroup] = meter.oom_kills.get(cgroup, 0) + 1
    meter.peak[cgroup] = 9
    units.emit(unit, MainPID=0, ExecMainCode=CLD_KILLED, ExecMainStatus=signal.SIGKILL,
               Result="signal")
    units.emit(unit, ActiveState="activating", SubState="auto-restart")
    await units.delivered()


async def test_an_oom_killed_engine_is_failed_not_restarted_and_learns_a_higher_need(
        tmp_path: Path) -> None:
    d, mgr, units, meter, book = on_ram(tmp_path, budget_mib=100)
    await use(d, "a")
    await oom_kill(units, meter, "a")
    waiting = asyncio.ensure_future(use(d, "a"))    # arrives while it is restarting
    with pytest.raises(EngineOutOfMemory) as err:
        await asyncio.wait_for(waiting, 5)
    body = err.value.body()["error"]
    assert err.value.status == 503 and body["code"] == "engine_out_of_memory"
    assert body["required_mib"] == round(9 * 1.25) and body["free_mib"] is not None
    engine = mgr.registry.get("a")
    assert engine is not None and engine.state is EngineState.FAILED
    assert engine.failure is not None and engine.failure.kind == "oom"
    assert units.log == ["start a", "stop llm-engine-a.service"]   # stopped, not restarted
    assert list(book.figures.values()) == [round(9 * 1.25)]
    await d.close()
    await mgr.close()


async def test_systemds_oom_kill_result_alone_is_an_oom(tmp_path: Path) -> None:
    """cgroup v2: systemd says Result=oom-kill; no counter is needed."""
    d, mgr, units, _, _ = on_ram(tmp_path, budget_mib=100)
    await use(d, "a")
    unit = units.layout("a").unit
    units.emit(unit, MainPID=0, ExecMainCode=CLD_KILLED, ExecMainStatus=signal.SIGKILL,
               Result="oom-kill")
    units.emit(unit, ActiveState="activating", SubState="auto-restart")
    await units.delivered()
    deadline = asyncio.get_running_loop().time() + 5
    while (e := mgr.registry.get("a")) is None or e.state is not EngineState.FAILED:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    assert e.failure is not None and e.failure.out_of_memory
    await d.close()
    await mgr.close()


async def test_a_plain_crash_is_still_restarted(tmp_path: Path) -> None:
    d, mgr, units, _, _ = on_ram(tmp_path, budget_mib=100)
    await use(d, "a")
    unit = units.layout("a").unit
    units.emit(unit, MainPID=0, ExecMainCode=CLD_KILLED, ExecMainStatus=signal.SIGSEGV,
               Result="signal")
    units.emit(unit, ActiveState="activating", SubState="auto-restart")
    await units.delivered()
    await asyncio.sleep(0.05)
    engine = mgr.registry.get("a")
    assert engine is not None and engine.state is EngineState.RESTARTING
    assert units.log == ["start a"]
    await d.close()
    await mgr.close()


async def test_auto_memory_high_limits_a_running_engine_at_its_learned_peak_plus_headroom(
        tmp_path: Path) -> None:
    d, mgr, units, _, _ = on_ram(tmp_path, budget_mib=100, auto_memory_high=True,
                                    memory_high_headroom_pct=50,
                                    models_config={"b": {"memory_high": 64 * MIB}})
    await use(d, "a")
    await use(d, "b")
    assert units.memory_high == {"llm-engine-a.service": round(3 * 1.5) * MIB}   # b: its own
    await d.close()
    await mgr.close()


async def test_memory_high_is_off_unless_asked_for(tmp_path: Path) -> None:
    d, mgr, units, _, _ = on_ram(tmp_path, budget_mib=100)
    await use(d, "a")
    assert units.memory_high == {}
    await d.close()
    await mgr.close()


async def killed(units: FakeUnits, model: str, sig: int) -> None:
    unit = units.layout(model).unit
    units.emit(unit, MainPID=0, ExecMainCode=CLD_KILLED, ExecMainStatus=sig, Result="signal")
    units.emit(unit, ActiveState="activating", SubState="auto-restart")
    await units.delivered()


async def settled_state(mgr: EngineManager, model: str) -> EngineState:
    for _ in range(20):   # what follows the signal (an OOM's stop) runs in a task
        await asyncio.sleep(0.01)
    engine = mgr.registry.get(model)
    assert engine is not None
    return engine.state


@pytest.mark.parametrize(("sig", "machine_oom", "state"), [
    (signal.SIGKILL, True, EngineState.FAILED),       # the kernel's OOM killer's signal
    (signal.SIGKILL, False, EngineState.RESTARTING),  # someone's kill -9: restarted
    (signal.SIGSEGV, True, EngineState.RESTARTING),   # a crash while another process OOMs
])
async def test_with_its_cgroup_gone_a_sigkill_is_an_oom_when_the_machine_counted_one(
        tmp_path: Path, sig: int, machine_oom: bool, state: EngineState) -> None:
    """cgroup v1: systemd removes the unit's empty cgroup before the restart (its OOM count
    with it) and reports a plain SIGKILL; the kernel's /proc/vmstat count remains."""
    host = FakeHost()
    d, mgr, units, meter, _ = on_ram(tmp_path, budget_mib=100, host=host)
    await use(d, "a")
    meter.gone = True
    if machine_oom:
        host.ooms = (host.ooms or 0) + 1
    await killed(units, "a", sig)
    assert await settled_state(mgr, "a") is state
    assert ("stop llm-engine-a.service" in units.log) is (state is EngineState.FAILED)
    await d.close()
    await mgr.close()

# -- partial offload: both budgets -----------------------------------------------------


class NeedsGpu:
    """One device whose free memory goes down by each placed engine's VRAM need."""

    description = "fake device"

    def __init__(self, total_mib: int) -> None:
        self.total = total_mib
        self.mgr: EngineManager | None = None

    def devices(self) -> list[DeviceMemory]:
        assert self.mgr is not None
        used = sum(self.mgr.capacity.need(m).vram_mib - 100 for e in self.mgr.registry.engines()
                   if e.holds_place and (m := self.mgr.catalog.get(e.model_id)))
        return [DeviceMemory(0, "GPU-0", "fake", self.total, self.total - used)]

    def process_mib(self) -> dict[int, int] | None:
        return None


def estimated(model: Model, *, gpu: bool) -> MemoryEstimate:
    """core.memory_estimate on a 4-block model of 100 MiB blocks, with the model's args."""
    from tests.unit.test_memory_estimate import facts
    return estimate(facts(), EngineSettings.parse(model.config.args), gpu=gpu, mmproj_bytes=0)


async def test_a_partly_offloaded_model_needs_both_budgets_and_each_shortage_evicts(
        tmp_path: Path) -> None:
    gpu = NeedsGpu(total_mib=100_000)
    host = FakeHost()
    args = {"a": ["-c", "4096", "-ngl", "0"], "b": ["-c", "4096", "-ngl", "99"],
            "c": ["-c", "4096", "-ngl", "3"]}
    mgr, units, _ = engine_manager_on_fakes(
        tmp_path, gpu=gpu, host=host, meter=FakeMeter(), estimate=estimated, ram_margin_mib=0,
        ram_reserve_mib=0, models_config={m: {"args": a} for m, a in args.items()})
    gpu.mgr = mgr
    models = {m: mgr.catalog.get(m) for m in args}
    need = {m: mgr.capacity.need(model) for m, model in models.items() if model is not None}
    assert all(n.ram_source == n.vram_source == "estimate" for n in need.values())
    # all in RAM, all on the GPU, and split: c needs some of each
    assert need["a"].vram_mib == 100 and need["b"].ram_mib < need["c"].ram_mib < need["a"].ram_mib
    assert need["a"].vram_mib < need["c"].vram_mib < need["b"].vram_mib
    d = dispatcher_for(mgr, gpu)
    await use(d, "a")
    await use(d, "b")
    ledger = mgr.capacity.ram()
    assert ledger is not None and ledger.claimed_mib == need["a"].ram_mib + need["b"].ram_mib
    # RAM short (the GPU has room): the least recently used goes, a
    mgr.reconfigure(replace(mgr.config, ram_budget_mib=ledger.claimed_mib + need["c"].ram_mib - 1))
    await use(d, "c")
    assert units.log[-2:] == ["stop llm-engine-a.service", "start c"]
    # GPU short (RAM has room): a needs only its margin of VRAM, and b, the least recently
    # used of the two on the device, goes for it
    gpu.total = need["b"].vram_mib + need["c"].vram_mib - 200 + 50
    mgr.reconfigure(replace(mgr.config, ram_budget_mib=None))
    await use(d, "a")
    assert units.log[-2:] == ["stop llm-engine-b.service", "start a"]
    await d.close()
    await mgr.close()
