"""Parked engine units for real: a stopped engine's unit is parked, the next request
wakes it in place (the same process becomes the engine), and a restarted gateway
finds parked units without taking them for engines."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from gatewayd.core.engine_units import PARKED_COMM, EngineLayout
from tests.integration.conftest import GatewayFactory
from tests.integration.engine_helpers import cgroup_procs, process_ended
from tests.integration.gateway_helpers import GatewayService, journal_until, unit_property

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

CHAT = {"model": "tiny-alpha", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]}


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _wait_parked(unit: str, timeout: float = 20) -> int:
    """The unit's MainPID once it waits parked (the engine held by the preloaded wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = int(unit_property(unit, "MainPID") or 0)
        if pid and _comm(pid) == PARKED_COMM:
            return pid
        time.sleep(0.05)
    raise AssertionError(f"{unit} was not parked within {timeout}s")


def _metrics(gw: GatewayService) -> str:
    with urllib.request.urlopen(gw.url + "/admin/metrics", timeout=30) as resp:
        return str(resp.read().decode())


def _chat(gw: GatewayService) -> None:
    status, body = gw.api("POST", "/v1/chat/completions", CHAT)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] is not None


def test_a_stopped_engine_is_parked_and_the_next_request_wakes_it(
        gateway: GatewayService) -> None:
    layout = EngineLayout.for_model("tiny-alpha")
    unit = layout.unit
    _chat(gateway)
    engine_pid = gateway.engines()["tiny-alpha"]["pid"]
    assert gateway.api("POST", "/admin/engines/stop", {"model": "tiny-alpha"})[0] == 200
    assert process_ended(engine_pid)
    parked = _wait_parked(unit)
    # the stopped engine is gone; the unit of that name holds the waiting one alone
    assert cgroup_procs(unit_property(unit, "ControlGroup")) == [parked]
    assert not Path(layout.socket).exists()
    journal_until("tiny-alpha: its unit is parked", "-u", gateway.unit)
    assert "tiny-alpha" not in gateway.engines() or \
        gateway.engines()["tiny-alpha"]["state"] == "stopped"
    # said where an operator looks: status (and the CLI's status) and the metrics
    assert gateway.api("GET", "/admin/status")[1]["parked"] == ["tiny-alpha"]
    assert "parked (their next start is fast): tiny-alpha" in gateway.cli("status").stdout
    assert "llm_gateway_parked_engines 1.0" in _metrics(gateway)
    _chat(gateway)
    engine = gateway.engines()["tiny-alpha"]
    assert engine["state"] == "ready" and engine["pid"] == parked
    assert _comm(parked) == "llama-server"
    assert gateway.api("GET", "/admin/status")[1]["parked"] == []
    assert "llm_gateway_parked_engines 0.0" in _metrics(gateway)


def test_a_restarted_gateway_leaves_a_parked_unit_parked_then_wakes_it(
        gateway_factory: GatewayFactory) -> None:
    unit = EngineLayout.for_model("tiny-alpha").unit
    gw = gateway_factory()
    _chat(gw)
    assert gw.api("POST", "/admin/engines/stop", {"model": "tiny-alpha"})[0] == 200
    parked = _wait_parked(unit)
    gw.stop()
    gw.start()
    # the adoption's listing ran before the gateway answered: a parked unit is no engine
    assert "tiny-alpha" not in gw.engines()
    assert _comm(parked) == PARKED_COMM
    _chat(gw)
    assert gw.engines()["tiny-alpha"]["pid"] == parked
