"""The event feed's kept window (/admin/events/history) and journals followed as they are
written (/admin/engines/logs?follow=1, /admin/logs), over real HTTP with the engine layer
on fakes; journalctl is a stand-in script first on PATH."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gatewayd import cli
from gatewayd.adapters import journal
from gatewayd.core.waits import seconds
from gatewayd.http import admin_api
from tests.http.test_front_door import Gateway, _gateway, chat

EVICTED_A = "evicted for 'c' (max_engines reached; 'a' least recently used)"

def runs(calls: Path) -> dict[int, list[str]]:
    """The stand-in's runs so far: PID -> argv."""
    return {int(p.stem): json.loads(p.read_text()) for p in calls.glob("*.json")}


async def next_event(resp: aiohttp.ClientResponse, timeout: float = 5) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        while True:
            line = await resp.content.readline()
            assert line, "the stream ended"
            if line.startswith(b"data: "):
                event: dict[str, Any] = json.loads(line[6:])
                return event
    return await asyncio.wait_for(read(), timeout)


async def gone(pid: int, timeout: float = 5) -> None:
    """The process has ended and been reaped: its PID no longer exists."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"PID {pid} is still there"
        await asyncio.sleep(0.02)


async def follow(gw: Gateway, path: str = "/admin/engines/logs", **params: str
                 ) -> aiohttp.ClientResponse:
    params = {"model": "a", **params} if path == "/admin/engines/logs" else params
    resp = await gw.client.get(path, params={"follow": "1", **params})
    assert resp.status == 200, await resp.text()
    return resp


# -- the event history ---------------------------------------------------------------------


async def _evict_a_for_c(gw: Gateway) -> None:
    """a and b hold both places; a request for c evicts a (the least recently used), and
    c loads for a while before it is ready."""
    gw.health.all_ready = False
    ask = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat("c")))
    deadline = time.monotonic() + 5
    while (c := gw.engines.registry.get("c")) is None \
            or c.state.value not in ("starting", "loading"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)   # c loads
    gw.health.all_ready = True
    assert (await ask).status == 200


async def test_the_history_says_who_was_evicted_for_whom_and_how_long_loads_took(
        tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2):
        await _evict_a_for_c(gw)
        resp = await gw.client.get("/admin/events/history")
        assert resp.status == 200
        body = await resp.json()
        assert body["kept_s"] == 86400 and body["kept_max"] == 10000
        events = body["events"]
        assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)   # oldest first
        assert not any(e["type"] == "queue" for e in events)   # live only
        a_stop = [e for e in events if e["type"] == "engine" and e["model"] == "a"
                  and e["state"] in ("stopping", "stopped")]
        assert [(e["state"], e["reason"], e["evicted_for"]) for e in a_stop] == [
            ("stopping", EVICTED_A, "c"), ("stopped", EVICTED_A, "c")]
        # why c got room, in words: a served nobody; how long c's request had waited
        assert [(e["rule"], e["because"]) for e in a_stop] == [
            ("served_nobody", f"'c' waited {seconds(a_stop[0]['waited_s'])}: 'a' served "
                              "nobody")] * 2
        c_states = [e for e in events if e["type"] == "engine" and e["model"] == "c"]
        assert [e["state"] for e in c_states] == ["starting", "loading", "ready"]
        assert c_states[-1]["load_s"] >= 0.3   # from its start, through its load
        assert all("load_s" in e for e in events if e.get("state") == "ready")
        assert not any("evicted_for" in e for e in c_states)
        # since and limit: the newest N from then on, oldest first
        since = c_states[0]["ts"]
        resp = await gw.client.get("/admin/events/history", params={"since": str(since)})
        assert (await resp.json())["events"] == [e for e in events if e["ts"] >= since]
        resp = await gw.client.get("/admin/events/history", params={"limit": "2"})
        assert (await resp.json())["events"] == events[-2:]
        for query, param in (({"since": "yesterday"}, "since"), ({"since": "nan"}, "since"),
                             ({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"),
                             ({"limit": "10001"}, "limit")):
            resp = await gw.client.get("/admin/events/history", params=query)
            error = (await resp.json())["error"]
            assert resp.status == 400 and error["param"] == param, error


async def test_a_failed_engines_lines_and_cause_are_on_the_timeline(tmp_path: Path) -> None:
    """The state event comes at the failure; its journal lines (the fake journal's) a
    little later, once read: an engine_failure event with them and the cause they say,
    once (not at each re-read of the tail)."""
    async for gw in _gateway(tmp_path, ()):
        gw.units.fail_start = "no such file"
        resp = await gw.client.post("/v1/chat/completions", json=chat("b"))
        assert resp.status == 502
        await asyncio.sleep(0.6)   # past failure_logs' first re-read
        events = (await (await gw.client.get("/admin/events/history")).json())["events"]
        failures = [e for e in events if e["type"] == "engine_failure"]
        assert len(failures) == 1, failures
        failure = failures[0]
        assert failure["model"] == "b" and failure["state"] == "failed"
        assert failure["log_tail"][-1] == "last line"
        assert failure["cause"]["code"] == "model_load"
        assert "(its server could not load the model); its log ends: last line" in \
            cli.describe_event(failure)


async def test_reloads_are_on_the_timeline(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "gateway.toml"
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(config))
    async for gw in _gateway(tmp_path, ("a",)):
        config.write_text("max_engines = [")   # not TOML: refused, the old one stays
        assert (await gw.client.post("/admin/reload")).status == 422
        config.write_text(
            f"state_dir = {json.dumps(str(tmp_path / 'state'))}\nmax_engines = 3\n"
            + "".join(f"[models.{m}]\npath = {json.dumps(str(tmp_path / f'{m}.gguf'))}\n"
                      for m in ("a", "b"))
            + "[admin]\npublic = true\n")
        resp = await gw.client.post("/admin/reload")
        assert resp.status == 200, await resp.text()
        events = (await (await gw.client.get("/admin/events/history")).json())["events"]
        reloads = [e for e in events if e["type"] == "reload"]
        assert [e["ok"] for e in reloads] == [False, True]
        assert "not valid TOML" in reloads[0]["error"]
        assert reloads[1]["changes"]["removed"] == ["c"]
        assert set(reloads[1]["changes"]) == {"added", "removed", "restarting", "kept",
                                              "needs_restart"}


async def test_a_crash_and_its_restart_are_kept_with_the_reason(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        unit, pid = gw.units.layout("a").unit, gw.engines.registry.get("a").main_pid  # type: ignore[union-attr]
        gw.units.emit(unit, ActiveState="activating", SubState="auto-restart", MainPID=0,
                      ExecMainCode=2, ExecMainStatus=9, Result="signal")   # killed by SIGKILL
        gw.units.emit(unit, ActiveState="activating", SubState="start", NRestarts=1,
                      MainPID=pid + 100)
        gw.units.emit(unit, ActiveState="active", SubState="running")
        deadline = time.monotonic() + 5
        while True:
            events = (await (await gw.client.get("/admin/events/history")).json())["events"]
            events = [e for e in events if e["type"] == "engine"]   # (engine_failure too)
            said = [(e["from"], e["state"]) for e in events if e.get("model") == "a"]
            if said[-1:] == [("loading", "ready")] and ("ready", "restarting") in said:
                break
            assert time.monotonic() < deadline, said
            await asyncio.sleep(0.02)
        restarting = next(e for e in events if e["state"] == "restarting")
        assert "SIGKILL" in restarting["reason"] and restarting["restarts"] == 0
        assert events[-1]["restarts"] == 1 and events[-1]["load_s"] > 0   # from the restart


async def test_the_cli_prints_the_kept_events(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2):
        await _evict_a_for_c(gw)
        url = str(gw.client.make_url("")).rstrip("/")
        argv = ["--url", url, "events", "--since", "1h", "--no-follow"]
        assert await asyncio.to_thread(cli.main, argv) == 0
        lines = capsys.readouterr().out.splitlines()
        said = [line.split(" ", 1)[1] for line in lines]   # (each begins with its time)
        assert f"a: ready -> stopping ({EVICTED_A})" in said
        assert f"a: stopping -> stopped ({EVICTED_A})" in said
        assert any(x.startswith("c: loading -> ready (in 0.") for x in said), said
        assert said.index("c: stopped -> starting") > said.index(
            f"a: stopping -> stopped ({EVICTED_A})")
        # a time after them all: nothing; --json: the events themselves
        assert await asyncio.to_thread(cli.main, [
            "--url", url, "--json", "events", "--since", str(time.time() + 60),
            "--no-follow"]) == 0
        assert capsys.readouterr().out == ""
        assert await asyncio.to_thread(cli.main, [
            "--url", url, "--json", "events", "--no-follow"]) == 0
        printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert any(e.get("evicted_for") == "c" for e in printed)
        # following: the kept events, then the snapshot, then what comes, each once
        cli_run = asyncio.ensure_future(asyncio.to_thread(
            cli.main, ["--url", url, "events", "--since", "1h"]))
        out = ""
        while "engines: " not in out:
            assert not cli_run.done()
            await asyncio.sleep(0.05)
            out += capsys.readouterr().out
        hub = gw.client.app[admin_api.EVENTS]
        hub.publish({"type": "reload", "ok": False, "error": "not valid TOML"})
        while "reload refused" not in out:
            assert not cli_run.done()
            await asyncio.sleep(0.05)
            out += capsys.readouterr().out
        hub.close()   # the gateway stops: the feed ends, and the command
        assert await asyncio.wait_for(cli_run, 5) == 0
        said = [line.split(" ", 1)[1] for line in out.splitlines()]
        assert said.count(f"a: ready -> stopping ({EVICTED_A})") == 1
        snapshot = next(i for i, x in enumerate(said) if x.startswith("engines: "))
        assert said.index(f"a: ready -> stopping ({EVICTED_A})") < snapshot
        assert said[-1] == "reload refused: not valid TOML"


# -- journals followed --------------------------------------------------------------------


async def test_an_engine_log_followed_as_it_is_written(tmp_path: Path, calls: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        resp = await follow(gw, lines="5")
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert [(await next_event(resp))["line"] for _ in range(2)] == [
            "2024-05-01T10:00:00+0000 host srv[7]: first line",
            "2024-05-01T10:00:01+0000 host srv[7]: ERROR second line"]
        [(pid, argv)] = runs(calls).items()
        # the unit is the engine's (not the query's text), as a list of arguments
        unit = gw.engines.log_unit("a")[0]
        assert argv == ["--unit", unit, "-f", "-n", "5", "-o", "short-iso", "--no-pager",
                        "--quiet"]
        (calls / "more").touch()   # a line written after the follow began arrives
        assert (await next_event(resp)) == {
            "line": "2024-05-01T10:00:02+0000 host srv[7]: written after the follow began"}
        resp.close()               # the client goes away: its journalctl ends by its PID
        await gone(pid)
        assert gw.client.app[admin_api.JOURNALS].following == 0


async def test_grep_filters_lines_in_the_gateway(tmp_path: Path, calls: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        resp = await follow(gw, grep="error")
        (calls / "more").touch()
        assert (await next_event(resp))["line"].endswith("ERROR second line")
        resp.close()
        [(pid, argv)] = runs(calls).items()
        assert "error" not in " ".join(argv).lower()   # never handed to journalctl
        assert "-n" in argv and argv[argv.index("-n") + 1] == "50"   # the default
        await gone(pid)


async def test_at_most_eight_follows_and_the_ninth_is_refused(tmp_path: Path,
                                                              calls: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        follows = [await follow(gw) for _ in range(8)]
        for resp in follows:
            await next_event(resp)
        resp = await gw.client.get("/admin/engines/logs",
                                   params={"model": "a", "follow": "1"})
        assert resp.status == 429
        error = (await resp.json())["error"]
        assert error["code"] == "too_many_log_follows" and error["type"] == "rate_limit_error"
        assert "8 journal follows" in error["message"]
        assert len(runs(calls)) == 8   # no journalctl for the refused one
        for resp in follows:
            resp.close()
        for pid in runs(calls):
            await gone(pid)
        resp = await follow(gw)        # room again
        await next_event(resp)
        resp.close()


async def test_a_stopping_gateway_ends_every_follow(tmp_path: Path, calls: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        resp = await follow(gw)
        await next_event(resp)
        [pid] = runs(calls)
        gw.client.app[admin_api.JOURNALS].close()   # what the stop does, beside the hub's
        event = await next_event(resp)
        while "line" in event:   # (lines already written may come first)
            event = await next_event(resp)
        assert event["type"] == "shutdown"
        assert (await resp.content.read()).strip() == b""    # and the stream ends
        await gone(pid)
        resp = await gw.client.get("/admin/engines/logs", params={"model": "a", "follow": "1"})
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "shutting_down"


async def test_the_gateways_own_log(tmp_path: Path, calls: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    async for gw in _gateway(tmp_path, ()):
        monkeypatch.delenv("INVOCATION_ID", raising=False)   # not started by systemd
        resp = await gw.client.get("/admin/logs")
        error = (await resp.json())["error"]
        assert resp.status == 409 and error["code"] == "not_a_systemd_unit"
        assert error["message"] == ("the gateway is not running as a systemd unit: its log "
                                    "is its standard error")
        monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
        cgroup = tmp_path / "cgroup"
        cgroup.write_text("0::/user.slice/user-1000.slice/user@1000.service/app.slice/"
                          "llm-gateway.service\n")
        monkeypatch.setattr(journal, "CGROUP_FILE", cgroup)
        resp = await gw.client.get("/admin/logs", params={"lines": "3", "grep": "ERROR"})
        assert resp.status == 200
        assert await resp.json() == {"unit": "llm-gateway.service", "lines": [
            "2024-05-01T10:00:01+0000 host srv[7]: ERROR second line"]}
        assert list(runs(calls).values()) == [["--user-unit", "llm-gateway.service", "-n", "3",
                                               "-o", "short-iso", "--no-pager", "--quiet"]]
        resp = await follow(gw, "/admin/logs")
        assert (await next_event(resp))["line"].endswith("first line")
        resp.close()
        [pid] = [p for p, argv in runs(calls).items() if "-f" in argv]
        await gone(pid)


@pytest.mark.parametrize("query,param", [
    ({"model": "a", "follow": "yes"}, "follow"),
    ({"model": "a", "follow": "1", "lines": "0"}, "lines"),
    ({"follow": "1"}, "model"),
])
async def test_a_bad_follow_is_refused_before_any_journalctl(
        tmp_path: Path, calls: Path, query: dict[str, str], param: str) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        resp = await gw.client.get("/admin/engines/logs", params=query)
        assert resp.status == 400 and (await resp.json())["error"]["param"] == param
        assert runs(calls) == {}


async def test_the_cli_follows_a_log(tmp_path: Path, calls: Path,
                                     capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
    async for gw in _gateway(tmp_path, ("a",)):
        url = str(gw.client.make_url("")).rstrip("/")
        (calls / "more").touch()
        cli_run = asyncio.ensure_future(asyncio.to_thread(
            cli.main, ["--url", url, "logs", "a", "-f", "--grep", "SRV[7]", "-n", "10"]))
        deadline = time.monotonic() + 5
        out = ""
        while "written after" not in out:
            assert time.monotonic() < deadline, (out, cli_run)
            await asyncio.sleep(0.05)
            out += capsys.readouterr().out
        assert out.splitlines() == [
            "2024-05-01T10:00:00+0000 host srv[7]: first line",
            "2024-05-01T10:00:01+0000 host srv[7]: ERROR second line",
            "2024-05-01T10:00:02+0000 host srv[7]: written after the follow began"]
        gw.client.app[admin_api.JOURNALS].close()   # the gateway stops: the CLI ends
        assert await asyncio.wait_for(cli_run, 5) == 0
        assert "the gateway is stopping" in capsys.readouterr().err
        assert await asyncio.to_thread(cli.main, ["--url", url, "logs"]) == 1
        assert "give a model, or --gateway" in capsys.readouterr().err
