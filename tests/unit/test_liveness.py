"""Liveness: a ready engine that stops answering /health is killed; systemd restarts it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gatewayd.core.engines import Engine, EngineState
from gatewayd.service.liveness import Liveness
from tests.fakes import engine_manager_on_fakes


async def _settled(mgr_get: object, model: str, state: EngineState) -> Engine:
    for _ in range(200):
        engine = mgr_get(model)  # type: ignore[operator]
        if engine is not None and engine.state is state:
            return engine  # type: ignore[no-any-return]
        await asyncio.sleep(0.01)
    raise AssertionError(f"{model} never became {state}")


async def test_a_hung_engine_is_killed_after_the_misses_and_comes_back(tmp_path: Path) -> None:
    mgr, units, health = engine_manager_on_fakes(tmp_path)
    await mgr.lifecycle.start("a")
    b = await mgr.lifecycle.start("b")
    a = mgr.registry.get("a")
    assert a is not None
    states: list[tuple[str, str]] = []
    mgr.registry.subscribe(lambda old, new: states.append(
        (new.state.value, new.failure.reason if new.failure else "")))
    liveness = Liveness(mgr, health, interval_s=1, timeout_s=0.5, misses=3)
    health.hung.add(a.socket)
    assert await liveness.check() == [] and await liveness.check() == []
    assert not any(line.startswith("kill") for line in units.log)
    assert await liveness.check() == ["a"]
    await _settled(mgr.registry.get, "a", EngineState.LOADING)      # systemd restarted it
    assert f"kill {a.unit}" in units.log
    assert ("restarting", "did not answer /health for 3s (hung): killed, and systemd "
            "restarts it") in states
    health.hung.clear()
    again = await mgr.lifecycle.wait_ready("a", timeout=5)
    # one kill, one restart: never failed on the way
    walk = [state for i, (state, _) in enumerate(states) if i == 0 or states[i - 1][0] != state]
    assert walk == ["restarting", "loading", "ready"], states
    assert again.main_pid != a.main_pid
    assert mgr.registry.get("b") == b                                 # the others untouched
    await liveness.close()
    await mgr.close()


async def test_any_answer_is_alive_and_a_miss_streak_restarts_with_an_answer(
        tmp_path: Path) -> None:
    mgr, units, health = engine_manager_on_fakes(tmp_path)
    a = await mgr.lifecycle.start("a")
    liveness = Liveness(mgr, health, interval_s=1, timeout_s=0.5, misses=2)
    health.all_ready = False                     # 503: busy or unhappy, but answering
    for _ in range(3):
        assert await liveness.check() == []
    health.hung.add(a.socket)
    assert await liveness.check() == []          # one miss
    health.hung.clear()
    assert await liveness.check() == []          # answered: the streak is over
    health.hung.add(a.socket)
    assert await liveness.check() == []          # one miss again, not two
    assert not any(line.startswith("kill") for line in units.log)
    await liveness.close()
    await mgr.close()


async def test_misses_of_an_earlier_process_do_not_count(tmp_path: Path) -> None:
    mgr, units, health = engine_manager_on_fakes(tmp_path)
    a = await mgr.lifecycle.start("a")
    liveness = Liveness(mgr, health, interval_s=1, timeout_s=0.5, misses=2)
    health.hung.add(a.socket)
    assert await liveness.check() == []
    await units.kill_engine(a.unit)              # crashed and restarted on its own
    await units.delivered()                      # (systemd's signals come after the kill)
    health.hung.clear()
    await mgr.lifecycle.wait_ready("a", timeout=5)
    health.hung.add(a.socket)                    # (the new process, on the same socket)
    units.log.clear()
    assert await liveness.check() == []          # the new process's first miss
    assert units.log == []
    await liveness.close()
    await mgr.close()
