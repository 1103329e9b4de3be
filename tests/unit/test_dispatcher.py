"""The dispatcher against a fake systemd: autoload, one loader, eviction, limits, TTL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.errors import (
    ConcurrencyLimit,
    EngineBinaryMissing,
    EngineFailed,
    EngineLimitReached,
    EngineUnavailable,
    GatewayError,
    InsufficientGpu,
    ModelNotLoaded,
    QueueFull,
)
from gatewayd.core.placement import DeviceMemory
from gatewayd.core.ports import EngineUnitInfo
from gatewayd.service.dispatcher import Dispatcher
from gatewayd.service.engine_manager import EngineManager
from tests.fakes import FakeHealth, FakeUnits, dispatcher_for, engine_manager_on_fakes


class LedgerGpu:
    """A device whose free memory follows the engines running (103 MiB each, 3 + margin)."""

    description = "ledger"

    def __init__(self, total_mib: int) -> None:
        self.total = total_mib
        self.mgr: EngineManager | None = None

    def devices(self) -> list[DeviceMemory]:
        assert self.mgr is not None
        used = 103 * sum(1 for e in self.mgr.registry.engines() if e.holds_place)
        return [DeviceMemory(0, "GPU-0", "ledger", self.total, self.total - used)]

    def process_mib(self) -> dict[int, int] | None:
        return None


class PlacedGpus:
    """Several devices; each engine holds 103 MiB on the device(s) it was placed on."""

    description = "placed"

    def __init__(self, *totals: int) -> None:
        self.totals = totals
        self.mgr: EngineManager | None = None

    def devices(self) -> list[DeviceMemory]:
        assert self.mgr is not None
        engines = [e for e in self.mgr.registry.engines() if e.holds_place]
        return [DeviceMemory(i, f"GPU-{i}", f"Fake {i}", total,
                             total - sum(103 // len(e.devices) for e in engines
                                         if f"GPU-{i}" in e.devices))
                for i, total in enumerate(self.totals)]

    def process_mib(self) -> dict[int, int] | None:
        return None


def dispatcher_on_fakes(tmp_path: Path, **kw: Any) -> tuple[Dispatcher, FakeUnits, FakeHealth]:
    mgr, units, health = engine_manager_on_fakes(tmp_path, **kw)
    if isinstance(kw.get("gpu"), LedgerGpu | PlacedGpus):
        kw["gpu"].mgr = mgr
    return dispatcher_for(mgr, kw.get("gpu")), units, health


async def use(d: Dispatcher, model: str) -> None:
    async with d.serve(model, autoload=True):
        pass


async def test_lru_idle_engine_is_evicted_when_places_run_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", "gatewayd.dispatcher")
    d, units, _ = dispatcher_on_fakes(tmp_path, max_engines=2)
    await use(d, "a")
    await use(d, "b")
    await use(d, "a")          # a is now the most recently used
    await use(d, "c")
    assert units.log == ["start a", "start b", "stop llm-engine-b.service", "start c"]
    assert "evicting b (making room for c: max_engines reached)" in caplog.messages


async def test_a_busy_engine_is_never_evicted(tmp_path: Path) -> None:
    """a is the least recently used and busy (a request that does not count as use, like
    a long poll): the idle b goes, not a."""
    d, units, _ = dispatcher_on_fakes(tmp_path, max_engines=2)
    await use(d, "a")
    await use(d, "b")
    async with d.serve("a", autoload=True, counts_as_use=False):
        await use(d, "c")
    assert "stop llm-engine-a.service" not in units.log
    assert "stop llm-engine-b.service" in units.log


async def test_pinned_engines_stay_busy_ones_drain_and_the_wait_is_bounded(
        tmp_path: Path) -> None:
    # (fifo: the drain at once; grouped waits for c's turn first, tests/unit/
    # test_dispatcher_model.py's grouped scenarios)
    d, units, _ = dispatcher_on_fakes(tmp_path, max_engines=2, eviction_wait_s=0.3,
                                      schedule="fifo", models_config={"a": {"pin": True}})
    await use(d, "a")
    async with d.serve("b", autoload=True):
        with pytest.raises(EngineLimitReached) as err:
            await use(d, "c")
    body = err.value.body()["error"]
    assert "a (pinned)" in body["message"]
    assert "b (serving 1 request(s), draining)" in body["message"]
    assert err.value.retry_after is not None
    assert units.log == ["start a", "start b"]
    await asyncio.wait_for(use(d, "b"), 1)   # c gave up: b is no longer draining


async def test_a_start_waits_for_a_busy_engine_to_become_idle(tmp_path: Path) -> None:
    d, units, _ = dispatcher_on_fakes(tmp_path, max_engines=1, eviction_wait_s=5)
    await d.acquire("a", autoload=True)                 # a busy
    wanted = asyncio.ensure_future(use(d, "b"))
    while not d._turns.queued("b"):                    # b waits ...
        await asyncio.sleep(0.01)
    for _ in range(20):                                # ... through many loader turns
        await asyncio.sleep(0)
    assert units.log == ["start a"]                    # a is never preempted
    d.release("a")
    await asyncio.wait_for(wanted, 5)
    assert units.log == ["start a", "stop llm-engine-a.service", "start b"]


async def test_vram_budget_evicts_until_it_fits(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", "gatewayd.dispatcher")
    gpu = LedgerGpu(total_mib=250)                      # room for two engines
    d, units, _ = dispatcher_on_fakes(tmp_path, gpu=gpu)
    await use(d, "a")
    await use(d, "b")
    await use(d, "c")
    assert units.log == ["start a", "start b", "stop llm-engine-a.service", "start c"]
    assert any(m.startswith("evicting a") and "MiB free" in m for m in caplog.messages)


async def test_engines_go_where_they_fit_best(tmp_path: Path) -> None:
    d, units, _ = dispatcher_on_fakes(tmp_path, gpu=PlacedGpus(250, 120))
    for model in ("a", "b", "c"):
        await use(d, model)
    # a: the 120 MiB device is the best fit; b: only the big one has room; c: still room there
    assert units.visible_devices == {"a": "GPU-1", "b": "GPU-0", "c": "GPU-0"}
    assert units.log == ["start a", "start b", "start c"]
    placed = d._engines.registry.get("a")
    assert placed is not None and placed.devices == ("GPU-1",)


async def test_eviction_frees_the_device_that_needs_the_memory(tmp_path: Path) -> None:
    """c must run on GPU 1 (cuda_visible_devices): b is stopped there, not the least
    recently used a on GPU 0, which would free nothing c can use."""
    d, units, _ = dispatcher_on_fakes(tmp_path, gpu=PlacedGpus(120, 120),
                                      models_config={"c": {"cuda_visible_devices": "1"}})
    await use(d, "a")
    await use(d, "b")
    assert units.visible_devices == {"a": "GPU-0", "b": "GPU-1"}
    await use(d, "c")
    assert units.log == ["start a", "start b", "stop llm-engine-b.service", "start c"]
    assert units.visible_devices["c"] is None     # its own setting is in its environment


async def test_an_adopted_engine_is_counted_on_its_own_device(tmp_path: Path) -> None:
    d, units, _ = dispatcher_on_fakes(tmp_path, gpu=PlacedGpus(120, 120))
    assert isinstance(d._engines, EngineManager)
    adopted = d._engines.lifecycle.take_over(EngineUnitInfo(
        unit="llm-engine-a.service", model_id="a", socket="/run/llm-engine-a/engine.sock",
        active_state="active", sub_state="running", main_pid=55, n_restarts=0,
        memory_bytes=None, started_at_us=0, visible_devices="0"))
    assert adopted is not None and adopted.devices == ("GPU-0",)
    await use(d, "b")
    assert units.visible_devices == {"b": "GPU-1"}


async def test_no_room_on_any_device_names_each_device(tmp_path: Path) -> None:
    d, units, _ = dispatcher_on_fakes(
        tmp_path, gpu=PlacedGpus(120, 120), eviction_wait_s=0.3,
        models_config={"a": {"pin": True}, "b": {"pin": True}})
    await use(d, "a")
    await use(d, "b")
    with pytest.raises(InsufficientGpu) as err:
        await use(d, "c")
    body = err.value.body()["error"]
    assert [dev["free_mib"] for dev in body["devices"]] == [17, 17]
    assert "GPU 0 (Fake 0): 17 of 120 MiB free; GPU 1 (Fake 1): 17 of 120 MiB free" \
        in body["message"]
    assert body["required_mib"] == 103 and units.log == ["start a", "start b"]


async def test_too_big_with_nothing_else_running_is_tried_anyway(tmp_path: Path) -> None:
    d, units, _ = dispatcher_on_fakes(tmp_path, gpu=LedgerGpu(total_mib=50))
    await use(d, "a")
    assert units.log == ["start a"]


async def test_concurrency_limit_is_429_with_retry_after(tmp_path: Path) -> None:
    d, _, _ = dispatcher_on_fakes(tmp_path, models_config={"a": {"max_concurrency": 1}})
    async with d.serve("a", autoload=True):
        with pytest.raises(ConcurrencyLimit) as err:
            await d.acquire("a", autoload=True)
    assert err.value.status == 429 and err.value.retry_after == 1
    await use(d, "a")                                    # free again afterwards


async def test_queue_limit_and_fair_wakeup(tmp_path: Path) -> None:
    d, units, health = dispatcher_on_fakes(tmp_path, models_config={"c": {"queue_limit": 2}})
    health.all_ready = False
    order: list[int] = []

    async def request(n: int) -> None:
        async with d.serve("c", autoload=True):
            order.append(n)
    first = [asyncio.ensure_future(request(n)) for n in range(2)]
    await _until(lambda: d._turns.queued("c") == 2)
    with pytest.raises(QueueFull) as err:
        await d.acquire("c", autoload=True)
    assert err.value.status == 503 and err.value.retry_after
    health.all_ready = True
    await asyncio.wait_for(asyncio.gather(*first), 5)
    assert order == [0, 1] and units.log == ["start c"]


async def test_a_waiter_that_leaves_does_not_cancel_the_load(tmp_path: Path) -> None:
    d, units, health = dispatcher_on_fakes(tmp_path)
    health.all_ready = False
    leaving = asyncio.ensure_future(use(d, "c"))
    staying = asyncio.ensure_future(use(d, "c"))
    await _until(lambda: d._turns.queued("c") == 2)
    leaving.cancel()
    await _until(lambda: d._turns.queued("c") == 1)
    health.all_ready = True
    await asyncio.wait_for(staying, 5)
    assert units.log == ["start c"]
    engine = d._engines.registry.get("c")
    assert engine is not None and engine.state is EngineState.READY


async def test_load_failure_reaches_every_waiter(tmp_path: Path) -> None:
    d, units, _ = dispatcher_on_fakes(tmp_path)
    units.fail_start = "no such file: /models/c.gguf"
    results = await asyncio.gather(*(use(d, "c") for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, EngineFailed) and "no such file" in r.message for r in results)
    assert units.log == ["start c"]


async def test_a_start_that_cannot_happen_evicts_nobody(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """b's engine server is missing: a was evicted for a start that then failed at once.
    Now b fails as that start would have (engine_failed, its backoff), and a stays."""
    d, units, _ = dispatcher_on_fakes(tmp_path, max_engines=1)
    await use(d, "a")
    units.unstartable["b"] = EngineBinaryMissing(
        "llama_server = 'llama-server': not found in PATH (/usr/bin)", key="llama_server")
    with pytest.raises(EngineFailed, match="not found in PATH") as failed:
        await use(d, "b")
    assert failed.value.status == 502 and failed.value.code == "engine_failed"
    assert units.log == ["start a"]
    engine = d._engines.registry.get("a")
    assert engine is not None and engine.state is EngineState.READY
    b = d._engines.registry.get("b")
    assert b is not None and b.state is EngineState.FAILED
    assert any("b cannot start:" in m and "llama_server" in m for m in caplog.messages)
    units.unstartable.clear()   # fixed: once its backoff is over, a makes room for it
    deadline = time.monotonic() + 10
    while d._engines.registry.backoff_left("b") > 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await use(d, "b")
    assert units.log == ["start a", "stop llm-engine-a.service", "start b"]


async def test_autoload_off(tmp_path: Path) -> None:
    d, units, _ = dispatcher_on_fakes(tmp_path)
    with pytest.raises(ModelNotLoaded) as err:
        await d.acquire("c", autoload=False)
    assert err.value.status == 503 and err.value.extra["state"] == "stopped"
    assert units.log == []


async def test_idle_ttl_stops_an_idle_engine(tmp_path: Path) -> None:
    d, units, _ = dispatcher_on_fakes(tmp_path, models_config={"a": {"idle_ttl_s": 0.3}})
    d.start_timers()
    await use(d, "a")
    async with d.serve("b", autoload=True):
        for _ in range(40):
            if "stop llm-engine-a.service" in units.log:
                break
            await asyncio.sleep(0.05)
    assert "stop llm-engine-a.service" in units.log
    assert "stop llm-engine-b.service" not in units.log     # b has no TTL
    await d.close()


async def test_polls_do_not_count_as_use(tmp_path: Path) -> None:
    d, units, _ = dispatcher_on_fakes(tmp_path, max_engines=2)
    await use(d, "a")
    await use(d, "b")
    async with d.serve("a", autoload=False, counts_as_use=False):   # GET /props?model=a
        pass
    await use(d, "c")
    assert "stop llm-engine-a.service" in units.log   # a is still the least recently *used*


async def _until(condition: Callable[[], bool], timeout: float = 5) -> None:
    """Wait for a condition (never for a fixed time)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never met"
        await asyncio.sleep(0.005)


async def test_a_request_for_a_model_being_parked_makes_room_meanwhile(
        tmp_path: Path) -> None:
    """The park of a's unit holds a's lifecycle; a request for a evicts b (b and c hold
    the two places) meanwhile, not once the park is over; then its start follows the park."""
    mgr, units, _ = engine_manager_on_fakes(tmp_path, max_engines=2)
    d = dispatcher_for(mgr)
    parking, release = asyncio.Event(), asyncio.Event()

    async def slow_park(model_id: str) -> None:
        parking.set()
        await release.wait()
    await use(d, "a")
    await use(d, "b")
    units.on_park = slow_park
    await mgr.lifecycle.stop("a")
    await asyncio.wait_for(parking.wait(), 5)
    await use(d, "c")
    request = asyncio.ensure_future(use(d, "a"))
    deadline = asyncio.get_running_loop().time() + 5
    while "stop llm-engine-b.service" not in units.log:   # while the park still runs
        assert asyncio.get_running_loop().time() < deadline, units.log
        await asyncio.sleep(0.005)
    assert not request.done() and units.log[-1] == "stop llm-engine-b.service"
    release.set()
    await asyncio.wait_for(request, 5)
    assert units.log[-1] == "start a"
    await d.close()
    await mgr.close()


async def test_a_journey_gives_its_turn_back_however_it_ends(tmp_path: Path) -> None:
    """Dispatcher.journey, the one owner of a request's way to a local engine: the turn it
    takes is given back on an answer, on an error, and on the error that is no reason to
    send again (a request an engine took and then dropped); a request refused before it
    reached any process, by an engine that is not coming back, is not sent twice; where
    no turn can be had, the caller's no_turn answers (spill-over) instead."""
    d, units, _ = dispatcher_on_fakes(tmp_path, max_engines=2)
    sent: list[str] = []

    def in_flight() -> int:
        use = d._turns.peek("a")
        return use.in_flight if use is not None else 0

    async def answer(engine: Engine) -> str:
        sent.append(engine.model_id)
        assert in_flight() == 1
        return "answer"
    assert await d.journey("a", answer, autoload=True) == "answer"
    assert in_flight() == 0 and sent == ["a"]

    for reached in (False, True):   # dropped after it was sent; refused, nothing restarts
        async def refused(engine: Engine, reached: bool = reached) -> str:
            sent.append(engine.model_id)
            error = EngineUnavailable("the engine did not take the request")
            error.reached_no_process = reached
            raise error
        sent.clear()
        with pytest.raises(EngineUnavailable):
            await d.journey("a", refused, autoload=True)
        assert in_flight() == 0 and sent == ["a"]   # once: its engine is not coming back

    async def no_turn(e: GatewayError) -> str:
        return f"elsewhere ({e.code})"
    assert await d.journey("b", answer, autoload=False, no_turn=no_turn) == \
        "elsewhere (model_not_loaded)"
    with pytest.raises(ModelNotLoaded):
        await d.journey("b", answer, autoload=False)
    assert "start b" not in units.log
