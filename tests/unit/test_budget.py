from __future__ import annotations

import pytest

from gatewayd.core.budget import check_admission, required_mib
from gatewayd.core.engines import Engine, EngineState, Failure
from gatewayd.core.errors import AlreadyRunning, EngineLimitReached, InsufficientGpu
from gatewayd.core.placement import DeviceMemory, Placement, place, rooms


def eng(model: str, state: EngineState) -> Engine:
    failure = Failure("x") if state in (EngineState.FAILED, EngineState.RESTARTING) else None
    return Engine(model, f"llm-engine-{model}.service", "/s", state=state, failure=failure)


def test_required_is_file_rounded_up_plus_margin() -> None:
    assert required_mib(1, 1024) == 1025
    assert required_mib(4 * 1024 * 1024, 0) == 4
    assert required_mib(4 * 1024 * 1024 + 1, 100) == 105


def test_already_running() -> None:
    with pytest.raises(AlreadyRunning) as err:
        check_admission("a", [eng("a", EngineState.LOADING)], max_engines=4, need_mib=1,
                        placement=None)
    assert err.value.status == 409 and err.value.extra["state"] == "loading"


def test_a_failed_engine_may_be_started_again_unless_systemd_restarts_it() -> None:
    check_admission("a", [eng("a", EngineState.FAILED)], max_engines=1, need_mib=1, placement=None)
    with pytest.raises(AlreadyRunning) as err:
        check_admission("a", [eng("a", EngineState.RESTARTING)], max_engines=4,
                        need_mib=1, placement=None)
    assert err.value.extra["state"] == "restarting"


def test_engine_limit_counts_active_engines_only() -> None:
    engines = [eng("a", EngineState.READY), eng("b", EngineState.STARTING),
               eng("c", EngineState.FAILED), eng("d", EngineState.STOPPED)]
    check_admission("x", engines, max_engines=3, need_mib=1, placement=None)
    with pytest.raises(EngineLimitReached) as err:
        check_admission("x", engines, max_engines=2, need_mib=1, placement=None)
    assert err.value.extra["running"] == ["a", "b"] and err.value.code == "engine_limit_reached"


def one_device(need: int, total: int, free: int) -> Placement:
    return place(need, rooms([DeviceMemory(0, "GPU-a", "Fake", total, free)], []))


def test_vram_budget_against_fresh_free_memory() -> None:
    check_admission("x", [], max_engines=4, need_mib=3000,
                    placement=one_device(3000, 24576, 3000))
    with pytest.raises(InsufficientGpu) as err:
        check_admission("x", [], max_engines=4, need_mib=3001,
                        placement=one_device(3001, 24576, 3000))
    body = err.value.body()["error"]
    assert err.value.status == 503 and body["code"] == "insufficient_gpu"
    assert body["required_mib"] == 3001 and body["free_mib"] == 3000
    assert body["total_mib"] == 24576
    assert body["devices"] == [{"index": 0, "uuid": "GPU-a", "name": "Fake", "total_mib": 24576,
                                "free_mib": 3000, "free_for_planning_mib": 3000}]
    assert "Per device: GPU 0 (Fake): 3000 of 24576 MiB free" in body["message"]


def test_no_gpu_means_no_vram_check() -> None:
    with pytest.raises(InsufficientGpu):                 # the same need with a device ...
        check_admission("x", [], max_engines=1, need_mib=10**9,
                        placement=one_device(10**9, 1000, 1000))
    check_admission("x", [], max_engines=1, need_mib=10**9, placement=None)   # ... none: admitted
