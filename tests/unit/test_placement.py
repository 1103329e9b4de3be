"""Placement across GPUs (core/placement.py): best fit, named devices, spreading, where
room is made; and plan_start choosing victims on the device that needs the memory."""

from __future__ import annotations

from gatewayd.core.engines import EngineState
from gatewayd.core.placement import DeviceMemory, Placed, place, rooms, select
from gatewayd.core.scheduler import Evict, Usage, plan_start


def gpus(*free: int, total: int = 8000) -> list[DeviceMemory]:
    return [DeviceMemory(i, f"GPU-{i}", f"Fake {i}", total, f) for i, f in enumerate(free)]


def test_best_fit_is_the_smallest_hole_that_holds_the_model() -> None:
    where = place(2000, rooms(gpus(8000, 3000, 2500), []))
    assert where.uuids == ("GPU-2",) and where.fits and where.free_mib == 2500
    assert where.visible_devices() == "GPU-2"
    assert place(2000, rooms(gpus(3000, 3000), [])).uuids == ("GPU-0",)   # tie: lower index


def test_loads_in_progress_count_against_their_device_only() -> None:
    loading = [Placed(("GPU-1",), pending_mib=1500)]
    where = place(2000, rooms(gpus(8000, 3000), loading))
    assert where.uuids == ("GPU-0",)          # GPU-1 has 1500 left for planning
    assert [r.plan_free_mib for r in where.rooms] == [8000, 1500]
    unknown = [Placed((), pending_mib=1500)]  # adopted, devices unknown: counted on each
    assert [r.plan_free_mib for r in rooms(gpus(8000, 3000), unknown)] == [6500, 1500]
    spread = [Placed(("GPU-0", "GPU-1"), pending_mib=1001)]
    assert [r.pending_mib for r in rooms(gpus(8000, 3000), spread)] == [501, 501]


def test_named_devices_are_respected_even_where_another_fits_better() -> None:
    where = place(2000, rooms(gpus(8000, 2500), []), named="0")
    assert where.uuids == ("GPU-0",) and where.fits and where.visible_devices() is None
    too_small = place(3000, rooms(gpus(8000, 2500), []), named="GPU-1")
    assert too_small.uuids == ("GPU-1",) and not too_small.fits
    assert place(100, rooms(gpus(8000), []), named="7").devices == ()   # no such device
    assert [d.uuid for d in select("1,GPU-0", gpus(1, 2))] == ["GPU-1", "GPU-0"]


def test_spread_over_devices_before_stopping_anyone() -> None:
    where = place(5000, rooms(gpus(3000, 100, 2500), [Placed(("GPU-0",), evictable_mib=4000)]))
    assert where.uuids == ("GPU-0", "GPU-1", "GPU-2") and where.fits
    assert where.visible_devices() == "GPU-0,GPU-1,GPU-2"


def test_room_is_made_where_the_least_is_missing() -> None:
    engines = [Placed(("GPU-0",), evictable_mib=2000), Placed(("GPU-1",), evictable_mib=5000)]
    where = place(5000, rooms(gpus(1000, 500), engines))
    assert where.uuids == ("GPU-1",) and not where.fits    # 500 + 5000 beats 1000 + 2000
    pinned = [Placed(("GPU-0",), evictable_mib=2000), Placed(("GPU-1",), evictable_mib=0)]
    assert place(2500, rooms(gpus(1000, 1200), pinned)).uuids == ("GPU-0",)
    hopeless = place(90000, rooms(gpus(1000, 500), engines))
    assert hopeless.uuids == ("GPU-0", "GPU-1") and not hopeless.fits


def test_one_device_is_never_named_to_the_engine() -> None:
    where = place(100, rooms(gpus(8000), []))
    assert where.uuids == ("GPU-0",) and where.visible_devices() is None


def ready(model: str, devices: tuple[str, ...], last_used: float) -> Usage:
    return Usage(model, EngineState.READY, last_used=last_used, devices=devices)


def test_short_of_memory_the_victim_is_on_the_chosen_device() -> None:
    usages = [ready("a", ("GPU-0",), 1.0), ready("b", ("GPU-1",), 2.0)]
    decision = plan_start("c", usages, max_engines=4, need_mib=500, free_mib=100,
                          devices=frozenset({"GPU-1"}))
    assert decision == Evict("b", "making room for c: needs 500 MiB of GPU memory, 100 MiB free")
    # short of places, any engine will do: the least recently used
    decision = plan_start("c", usages, max_engines=2, need_mib=500, free_mib=100,
                          devices=frozenset({"GPU-1"}))
    assert isinstance(decision, Evict) and decision.model_id == "a"
    # an engine whose devices are not known may free memory anywhere
    unknown = [ready("a", (), 1.0), ready("b", ("GPU-1",), 2.0)]
    decision = plan_start("c", unknown, max_engines=4, need_mib=500, free_mib=100,
                          devices=frozenset({"GPU-1"}))
    assert isinstance(decision, Evict) and decision.model_id == "a"
