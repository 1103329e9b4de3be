"""Over HTTP: a request that meets its engine just dead (its socket shut, systemd's
signal not in yet) waits for systemd's restart instead of failing; one that reached the
dying engine is never sent again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gatewayd.core.engines import EngineState
from tests.http.test_front_door import Gateway, _gateway, chat

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("a", "b")):
        yield g


async def test_a_request_meeting_a_just_dead_engine_waits_for_its_restart(
        gw: Gateway) -> None:
    unit, socket = gw.units.layout("a").unit, gw.units.layout("a").socket
    dead_pid = gw.engines.registry.get("a").main_pid   # type: ignore[union-attr]
    await gw.fakes["a"].stop()                 # the process is gone: its socket is shut
    gw.units.late_s = 0.3                      # systemd knows; its signal is on its way
    gw.units.emit(unit, ActiveState="activating", SubState="auto-restart", MainPID=0,
                  ExecMainCode=2, ExecMainStatus=9, Result="signal")
    asked = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat("a")))
    while (engine := gw.engines.registry.get("a")) is None or engine.state is EngineState.READY:
        assert not asked.done(), await (await asked).text()   # answered before it knew
        await asyncio.sleep(0.001)
    assert engine.state is EngineState.RESTARTING
    await gw.fakes["a"].start(socket)          # systemd's restart: a new process
    gw.units.emit(unit, ActiveState="activating", SubState="start", NRestarts=1,
                  MainPID=dead_pid + 100)
    gw.units.emit(unit, ActiveState="active", SubState="running")
    resp = await asked
    assert resp.status == 200, await resp.text()
    assert gw.engines.registry.get("a").main_pid == dead_pid + 100   # type: ignore[union-attr]
    assert (await gw.client.post("/v1/chat/completions", json=chat("b"))).status == 200


async def test_a_request_whose_engine_is_stopped_for_good_is_not_kept_waiting(
        gw: Gateway) -> None:
    """The socket shut and systemd says the unit failed (no restart): an error at once."""
    unit = gw.units.layout("a").unit
    await gw.fakes["a"].stop()
    gw.units.late_s = 0.3
    gw.units.emit(unit, ActiveState="failed", SubState="failed", MainPID=0,
                  ExecMainCode=1, ExecMainStatus=1, Result="exit-code")
    resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
    assert resp.status == 502, await resp.text()
    assert (await resp.json())["error"]["code"] in ("engine_unavailable", "engine_failed")
