"""The admin API over real HTTP (aiohttp test server), with the engine layer on fakes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gatewayd import cli
from gatewayd.http import admin_api, router
from gatewayd.http.middleware import error_middleware
from tests.fakes import engine_manager_on_fakes
from tests.http.test_front_door import _gateway, chat
from tests.unit.test_ram_budget import FakeHost, FakeMeter

Client = TestClient[web.Request, web.Application]


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[Client]:
    mgr, _, _ = engine_manager_on_fakes(tmp_path, max_engines=2)
    app = web.Application(middlewares=[error_middleware])
    app[admin_api.ENGINES] = mgr
    router.install(app)
    async with TestClient(TestServer(app)) as c:
        yield c
    await mgr.close()


async def test_start_list_logs_stop(client: Client) -> None:
    c = client
    resp = await c.post("/admin/engines/start", json={"model": "A"})   # names resolve
    assert resp.status == 200
    engine = (await resp.json())["engine"]
    assert engine["model"] == "a" and engine["state"] == "ready" and engine["pid"] == 101
    listed = (await (await c.get("/admin/engines")).json())["engines"]
    assert [e["model"] for e in listed] == ["a"]
    logs = await (await c.get("/admin/engines/logs", params={"model": "a", "lines": "5"})).json()
    assert logs["lines"][-1] == "last line"
    resp = await c.post("/admin/engines/stop", json={"model": "a"})
    assert resp.status == 200 and (await resp.json())["engine"]["state"] == "stopped"
    status = await (await c.get("/admin/status")).json()
    assert status["unit_mode"] == "transient" and status["engines"] == {}
    deadline = asyncio.get_running_loop().time() + 5
    while status["parked"] != ["a"]:   # its unit parked once the stop is done
        assert asyncio.get_running_loop().time() < deadline, status
        await asyncio.sleep(0.01)
        status = await (await c.get("/admin/status")).json()


@pytest.mark.parametrize("method,path,body,status,code", [
    ("POST", "/admin/engines/start", {"model": "nope"}, 404, "model_not_found"),
    ("POST", "/admin/engines/start", {}, 400, "invalid_request"),
    ("POST", "/admin/engines/start", "not json", 400, "invalid_request"),
    ("POST", "/admin/engines/stop", {"model": "b"}, 409, "engine_not_running"),
    ("GET", "/admin/engines/logs?model=a&lines=0", None, 400, "invalid_request"),
    ("GET", "/admin/nothing-here", None, 404, "not_found"),
    ("DELETE", "/admin/engines", None, 405, "method_not_allowed"),
])
async def test_errors_are_openai_shaped(client: Client, method: str, path: str,
                                        body: object, status: int, code: str) -> None:
    c = client
    kwargs = {"data": body} if isinstance(body, str) else {"json": body}
    resp = await c.request(method, path, **kwargs)
    assert resp.status == status
    assert resp.content_type == "application/json"
    error = (await resp.json())["error"]
    assert error["code"] == code and error["message"] and "type" in error


async def test_already_running_and_engine_limit(client: Client) -> None:
    c = client
    assert (await c.post("/admin/engines/start", json={"model": "a"})).status == 200
    resp = await c.post("/admin/engines/start", json={"model": "a"})
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "already_running"
    assert (await c.post("/admin/engines/start", json={"model": "b"})).status == 200
    resp = await c.post("/admin/engines/start", json={"model": "c"})
    error = (await resp.json())["error"]
    assert resp.status == 503 and error["code"] == "engine_limit_reached"
    assert error["running"] == ["a", "b"]


async def test_top_shows_engines_traffic_and_calls(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`llm-gateway top --once` against a real gateway: the memory budgets, the engines with
    human figures (RAM as their cgroup holds it), the traffic per model from
    /admin/metrics, the last calls."""
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
    async for gw in _gateway(tmp_path, ("a", "b"), host=FakeHost(), meter=FakeMeter()):
        for model in ("a", "a", "b"):
            assert (await gw.client.post("/v1/chat/completions", json=chat(model))).status \
                == 200
        assert (await gw.client.post("/v1/chat/completions", json=chat("nope"))).status == 404
        await gw.records(4)
        url = str(gw.client.make_url("")).rstrip("/")
        assert await asyncio.to_thread(cli.main, ["--url", url, "top", "--once"]) == 0
        out = capsys.readouterr().out
        assert "\x1b[" not in out                      # one frame: no screen control
        lines = out.splitlines()
        assert "engines: 2 ready (at most 4)" in lines[0]
        assert lines[1:3] == ["GPU memory: -", "RAM: 57.6 GiB free of 62.5 GiB (engines "
                              "518.0 MiB, loading 0 B, reserve 1.0 GiB)"]
        engines = lines[lines.index(next(x for x in lines if x.startswith("MODEL  STATE"))):]
        assert engines[1].split()[:2] == ["a", "ready"]
        assert "3 MiB (cgroup)  259 MiB" in engines[1]
        traffic = {x.split()[0]: x.split()[1:] for x in lines
                   if x.split()[:1] in (["a"], ["b"]) and len(x.split()) == 5}
        assert traffic == {"a": ["2", "0", "22", "8"], "b": ["1", "0", "11", "4"]}
        assert sum("/v1/chat/completions" in x for x in lines) == 4   # the last calls
