"""Journals followed for real: the gateway runs as a unit of the container's systemd, its
engine is the real llama-server, the journal is journald's, and journalctl is the real one.

A line written after the follow began arrives (the engine logs each request it serves:
"prompt eval time"), the journalctl process is gone once the client leaves, the gateway's
own journal is found from its cgroup, and the event history tells of a reload.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.gateway_helpers import GatewayService

pytestmark = [pytest.mark.systemd, pytest.mark.engine]


def journalctl_follows(unit: str) -> list[int]:
    """PIDs of the `journalctl -f` processes following unit."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue   # ended meanwhile
        if argv[0].endswith(b"journalctl") and b"-f" in argv and unit.encode() in argv:
            found.append(int(cmdline.parent.name))
    return found


async def lines_until(resp: aiohttp.ClientResponse, pred: Any, timeout: float
                      ) -> list[str]:
    """The follow's lines read until one matches pred (then returned, that one last)."""
    got: list[str] = []

    async def read() -> list[str]:
        while True:
            raw = await resp.content.readline()
            assert raw, f"the follow ended; it said: {got}"
            if raw.startswith(b"data: "):
                event = json.loads(raw[6:])
                assert "line" in event, event
                got.append(event["line"])
                if pred(event["line"]):
                    return got
    try:
        return await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise AssertionError(f"no such line within {timeout}s; the follow said: {got}") \
            from None


async def quiet(resp: aiohttp.ClientResponse, for_s: float = 1.5) -> list[str]:
    """The lines that come until none has come for for_s (the backlog of the last N)."""
    got: list[str] = []
    while True:
        try:
            raw = await asyncio.wait_for(resp.content.readline(), for_s)
        except TimeoutError:
            return got
        if raw.startswith(b"data: "):
            got.append(json.loads(raw[6:])["line"])


async def gone(unit: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while pids := journalctl_follows(unit):
        assert time.monotonic() < deadline, f"journalctl still follows {unit}: {pids}"
        await asyncio.sleep(0.05)


async def test_a_real_engines_journal_followed_as_it_is_written(
        gateway: GatewayService) -> None:
    proc = gateway.cli("start", "tiny-alpha")
    assert proc.returncode == 0, proc.stderr
    unit = gateway.engines()["tiny-alpha"]["unit"]
    async with aiohttp.ClientSession(gateway.url) as http:
        resp = await http.get("/admin/engines/logs",
                              params={"model": "tiny-alpha", "follow": "1", "lines": "20"})
        assert resp.status == 200, await resp.text()
        backlog = await quiet(resp)
        assert backlog, "the last lines of its journal came first"
        assert len(journalctl_follows(unit)) == 1
        # a line written after the follow began: the engine logs each request it serves
        chat = {"model": "tiny-alpha", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hello"}]}
        status, _ = await asyncio.to_thread(gateway.api, "POST", "/v1/chat/completions", chat)
        assert status == 200
        await lines_until(resp, lambda line: "prompt eval time" in line, 20)
        assert not any("prompt eval time" in line for line in backlog)
        resp.close()                      # the client leaves: its journalctl ends
        await gone(unit)

        # grep, in the gateway, plain text in any case
        resp = await http.get("/admin/engines/logs", params={
            "model": "tiny-alpha", "follow": "1", "lines": "1000",
            "grep": "PROMPT EVAL TIME"})
        assert resp.status == 200
        matched = await lines_until(resp, lambda line: True, 20)   # the earlier request's
        assert all("prompt eval time" in line for line in matched)
        resp.close()
        await gone(unit)


async def test_the_gateways_own_journal_and_its_event_history(
        gateway: GatewayService) -> None:
    status, body = gateway.api("GET", "/admin/logs?lines=5")
    assert status == 200 and body["unit"] == gateway.unit, body
    assert body["lines"], body
    async with aiohttp.ClientSession(gateway.url) as http:
        resp = await http.get("/admin/logs", params={"follow": "1", "grep": "reloaded"})
        assert resp.status == 200, await resp.text()
        await quiet(resp, 1.0)
        assert len(journalctl_follows(gateway.unit)) == 1
        status, _ = await asyncio.to_thread(gateway.api, "POST", "/admin/reload")
        assert status == 200
        said = await lines_until(resp, lambda line: "configuration reloaded" in line, 20)
        assert all("reloaded" in line for line in said)   # (the grep)
        resp.close()
        await gone(gateway.unit)
    status, body = gateway.api("GET", "/admin/events/history")
    assert status == 200
    reloads = [e for e in body["events"] if e["type"] == "reload"]
    assert [e["ok"] for e in reloads] == [True]
