"""Waits for an engine (core/waits): what a request waits for, its wait split by reason,
the bound's near misses, and why a swap happened in words; and the dispatcher measuring
them where they happen, on virtual time (a load of 2 s takes 2 s of the loop's clock)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gatewayd.adapters.gpu import NoGpu
from gatewayd.core.engines import EngineState
from gatewayd.core.priority import HIGH, LOW, NORMAL
from gatewayd.core.waits import (
    FIFO,
    HIGHER_CLASS,
    LOAD,
    MAX_WAIT,
    QUEUE,
    ROOM,
    SERVED_NOBODY,
    Swap,
    WaitClock,
    Waited,
    near_miss,
    reason_of,
    room_rule,
    seconds,
)
from gatewayd.service.dispatcher import Dispatcher
from gatewayd.service.engine_manager import EngineManager
from tests.fakes import FakeHealth, engine_manager_on_fakes, on_virtual_time

# -- pure ---------------------------------------------------------------------------------


def test_what_a_request_waits_for_by_its_engines_state() -> None:
    assert reason_of(None, False) == ROOM
    for state in (EngineState.STOPPED, EngineState.STOPPING, EngineState.FAILED):
        assert reason_of(state, False) == ROOM
    for state in (EngineState.STARTING, EngineState.LOADING, EngineState.RESTARTING):
        assert reason_of(state, False) == LOAD
    assert reason_of(EngineState.READY, False) == QUEUE
    assert reason_of(EngineState.READY, True) == ROOM   # giving its place to another model


def test_a_wait_is_split_by_what_it_waited_for() -> None:
    clock = WaitClock(100.0, ROOM)
    clock.switch(ROOM, 101.0)       # no change: one part
    clock.switch(LOAD, 103.0)
    clock.switch(ROOM, 104.0)       # restarted from scratch: room again
    clock.switch(LOAD, 104.5)
    assert clock.end(106.0) == {ROOM: 3.5, LOAD: 2.5}
    assert WaitClock(5.0, QUEUE).end(5.0) == {}     # no time spent: nothing to observe


def test_near_misses_of_the_bound() -> None:
    assert near_miss(17.9, 20) is None
    assert near_miss(18.0, 20) == "near"
    assert near_miss(19.99, 20) == "near"
    assert near_miss(20.0, 20) == "reached"
    assert near_miss(0.0, 20) is None
    assert near_miss(5.0, 0) is None


def test_the_rule_that_gave_room() -> None:
    def rule(**kw: Any) -> str:
        facts = {"drained": True, "grouped": True, "priority": NORMAL,
                 "victim_priority": NORMAL, "overdue": False, **kw}
        return room_rule(**facts)
    assert rule(drained=False) == SERVED_NOBODY
    assert rule(drained=False, overdue=True, priority=HIGH) == SERVED_NOBODY
    assert rule(grouped=False) == FIFO
    assert rule(priority=HIGH) == HIGHER_CLASS
    assert rule(priority=HIGH, overdue=True) == HIGHER_CLASS   # the class needs no wait
    assert rule(overdue=True) == MAX_WAIT
    assert rule(overdue=True, priority=NORMAL, victim_priority=LOW) == HIGHER_CLASS


def test_why_a_swap_happened_in_words() -> None:
    assert Swap("x", "chat", 30.2, MAX_WAIT).because == "'chat' waited 30 s: max_wait_s"
    assert Swap("x", "chat", 1.24, HIGHER_CLASS).because == (
        "'chat' waited 1.2 s: of a higher class than 'x'")
    assert Swap("x", "chat", 0.0, SERVED_NOBODY).because == "'chat' waited 0.0 s: 'x' served nobody"
    assert Swap("x", "chat", 3, FIFO).because == "'chat' waited 3.0 s: first in line (fifo)"
    assert Swap("x", "chat", 185, MAX_WAIT).describe() == {
        "because": "'chat' waited 3 min 5 s: max_wait_s", "rule": "max_wait_s",
        "waited_s": 185}
    assert seconds(9.96) == "10.0 s" and seconds(10) == "10 s" and seconds(120) == "2 min 0 s"


# -- the dispatcher measures them -----------------------------------------------------------


def approx(value: float) -> Any:
    return pytest.approx(value, abs=0.2)   # the fakes' polls: a tenth of a second or so


def manager_of(d: Dispatcher) -> EngineManager:
    """The engine layer the dispatcher was built on (it sees only what it uses of it)."""
    assert isinstance(d._engines, EngineManager)
    return d._engines


def on_fakes(tmp_path: Path, **config: Any) -> tuple[Dispatcher, FakeHealth, list[Waited]]:
    mgr, _, health = engine_manager_on_fakes(tmp_path, max_engines=1, **config)
    d = Dispatcher(mgr, catalog=mgr.catalog, gpu=NoGpu("test"), config=mgr.config,
                   clock=asyncio.get_running_loop().time)
    seen: list[Waited] = []
    d.subscribe_waits(seen.append)
    return d, health, seen


async def until(check: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never")


def state(d: Dispatcher, model: str) -> EngineState | None:
    engine = d._engines.registry.get(model)
    return engine.state if engine is not None else None


@on_virtual_time
async def test_a_wait_for_its_turn_then_the_load_and_the_bound_that_made_room(
        tmp_path: Path) -> None:
    """a serves a long request; b waits its turn (grouped) until its max_wait_s, a is
    drained and evicted, and b loads for 2 s: b's wait is 5 s of room and 2 s of load,
    the bound reached, and a's eviction says why: b waited its max_wait_s."""
    d, health, seen = on_fakes(tmp_path, schedule="grouped", max_wait_s=3.0)
    await d.acquire("a", autoload=True)            # held: a is busy
    health.all_ready = False
    b = asyncio.ensure_future(d.acquire("b", autoload=True))
    await asyncio.sleep(5.0)                        # b waits; at 3 s it is overdue: a drains
    assert d._turns.get_or_add("a").draining_for == "b"
    d.release("a")                                  # a serves nobody: evicted, b starts
    await until(lambda: state(d, "b") in (EngineState.STARTING, EngineState.LOADING))
    await asyncio.sleep(2.0)
    health.all_ready = True
    await b
    wait = seen[-1]
    assert (wait.model, wait.priority, wait.handed, wait.miss) == ("b", NORMAL, True, "reached")
    assert wait.parts[ROOM] == approx(5.0)
    assert 2.0 <= wait.parts[LOAD] <= 3.0          # (and the readiness poll that saw it)
    swap = d.swap("a")
    assert swap is not None and (swap.model, swap.rule) == ("b", MAX_WAIT)
    assert swap.waited_s == approx(3.0)     # when the bound drained a
    assert swap.because == "'b' waited 3.0 s: max_wait_s"
    await d.close()
    await manager_of(d).close()


@on_virtual_time
async def test_a_higher_class_drains_at_once_and_an_idle_engine_served_nobody(
        tmp_path: Path) -> None:
    d, _, seen = on_fakes(tmp_path, schedule="grouped", max_wait_s=30.0)
    await d.acquire("a", autoload=True, priority=LOW)
    b = asyncio.ensure_future(d.acquire("b", autoload=True, priority=HIGH))
    await asyncio.sleep(1.0)
    assert d._turns.get_or_add("a").draining_for == "b"
    d.release("a", priority=LOW)
    await b
    swap = d.swap("a")
    assert swap is not None and swap.rule == HIGHER_CLASS and swap.waited_s < 0.1
    assert seen[-1].priority == HIGH and seen[-1].miss is None
    assert seen[-1].parts[ROOM] == approx(1.0)
    d.release("b", priority=HIGH)
    await asyncio.sleep(5.0)                       # b idle for a while: it serves nobody
    await d.acquire("c", autoload=True)
    swap = d.swap("b")
    assert swap is not None and (swap.model, swap.rule) == ("c", SERVED_NOBODY)
    await d.close()
    await manager_of(d).close()


@on_virtual_time
async def test_a_request_at_a_ready_engine_waits_for_nothing(tmp_path: Path) -> None:
    d, _, seen = on_fakes(tmp_path)
    await d.acquire("a", autoload=True)
    d.release("a")
    n = len(seen)
    await d.acquire("a", autoload=True)
    assert len(seen) == n        # the request path: no wait, nothing observed
    d.release("a")
    await d.close()
    await manager_of(d).close()

