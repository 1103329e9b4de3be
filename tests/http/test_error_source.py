"""Errors say whose they are (issue 52): every answer of status >= 400 carries
LLM-Gateway-Error-Source (gateway | engine | upstream); the gateway's own error bodies and
stream error events say `"source": "gateway"` inside `error`; an engine's or upstream's
body is relayed as it was said, and no engine can set the header itself; each failed
call's record keeps the source (`error_source`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gatewayd.core import progress
from gatewayd.core.config import ModelKind
from gatewayd.core.errors import ERROR_SOURCE_HEADER
from gatewayd.http.drain import cancel_open_requests
from tests.fake_engine import FakeEngine
from tests.fake_upstream import FakeUpstream
from tests.http.test_front_door import Gateway, _gateway, chat, events, named_events
from tests.http.test_upstreams import upstream
from tests.http.test_waiting_stream import loading, split

# llama-server's refusal of a prompt past its context (tests/fake_engine.py: "refuse N")
REFUSAL = {"error": {"code": 400, "message": "the request exceeds the available context "
                     "size, try increasing it", "type": "exceed_context_size_error",
                     "n_prompt_tokens": 9000, "n_ctx": 4096}}
MESSAGE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("a", "b"), models_config={
            "b": {"kind": ModelKind.EMBEDDING}, "c": {"queue_limit": 0}}):
        yield g


def by_code(rows: list[dict[str, Any]]) -> dict[str | None, str | None]:
    return {r["error_code"]: r["error_source"] for r in rows}


async def test_an_engines_error_is_relayed_as_it_said_it_and_says_engine(gw: Gateway) -> None:
    for stream in (False, True):   # a stream refused before it began: the same JSON answer
        resp = await gw.client.post("/v1/chat/completions",
                                    json=chat("a", prompt="refuse 400", stream=stream))
        assert resp.status == 400 and resp.headers[ERROR_SOURCE_HEADER] == "engine"
        assert resp.headers["X-Request-Id"] == "a"             # relayed from its engine
        assert await resp.json() == REFUSAL                     # byte for byte its own
    resp = await gw.client.post("/v1/embeddings", json={"model": "b", "input": "hi"})
    assert resp.status == 501 and resp.headers[ERROR_SOURCE_HEADER] == "engine"
    assert "source" not in (await resp.json())["error"]
    rows = await gw.records(3)
    assert [r["error_source"] for r in rows] == ["engine"] * 3
    assert {r["error_code"] for r in rows} == {"400", "501"}
    ok = await gw.client.post("/v1/chat/completions", json=chat("a"))
    assert ok.status == 200 and ERROR_SOURCE_HEADER not in ok.headers
    rows = await gw.records(4)
    assert rows[0]["status"] == 200 and rows[0]["error_source"] is None   # no error: none


async def test_the_gateways_own_errors_say_so_in_header_and_body(gw: Gateway) -> None:
    answers = [
        await gw.client.post("/v1/chat/completions", json=chat("gpt-5")),   # 404
        await gw.client.post("/v1/chat/completions", data=b'{"model": "a",',
                             headers={"Content-Type": "application/json"}),   # 400
        await gw.client.post("/v1/chat/completions", json=chat("c")),       # 503 no room
        await gw.client.get("/v1/nothing-here"),                             # the gate's 404
    ]
    assert [r.status for r in answers] == [404, 400, 503, 404]
    for resp in answers:
        assert resp.headers[ERROR_SOURCE_HEADER] == "gateway"
        assert (await resp.json())["error"]["source"] == "gateway"
    assert (await answers[2].json())["error"]["code"] == "queue_full"
    rows = await gw.records(3)   # (the gate's 404 reached no handler: no record)
    assert by_code(rows) == {"model_not_found": "gateway", "invalid_request": "gateway",
                             "queue_full": "gateway"}


async def test_an_engine_cannot_say_its_answer_is_the_gateways(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def spoof(self: FakeEngine, request: web.Request,
                    response: web.StreamResponse) -> None:
        response.headers["X-Request-Id"] = self.name
        response.headers[ERROR_SOURCE_HEADER] = "gateway"
    monkeypatch.setattr(FakeEngine, "_mark", spoof)
    async for gw in _gateway(tmp_path, ("a",)):
        resp = await gw.client.post("/v1/chat/completions", json=chat("a", prompt="refuse 400"))
        assert resp.status == 400 and resp.headers["X-Request-Id"] == "a"
        assert resp.headers.getall(ERROR_SOURCE_HEADER) == ["engine"]
        for stream in (False, True):   # nor put it on an answer that is no error
            resp = await gw.client.post("/v1/chat/completions", json=chat("a", stream=stream))
            assert resp.status == 200 and ERROR_SOURCE_HEADER not in resp.headers
            await resp.read()
        rows = await gw.records(3)
        assert [r["error_source"] for r in rows] == [None, None, "engine"]


async def test_a_remote_upstreams_error_says_upstream(tmp_path: Path) -> None:
    box = FakeUpstream("box", models=["big"])
    await box.start()
    try:
        async for gw in _gateway(tmp_path, (), upstreams=(upstream(box, models=("big",)),)):
            resp = await gw.client.post("/v1/chat/completions",
                                        json=chat("big", prompt="refuse 400"))
            assert resp.status == 400 and resp.headers[ERROR_SOURCE_HEADER] == "upstream"
            assert await resp.json() == REFUSAL
            box.status, box.retry_after = 429, "7"
            resp = await gw.client.post("/v1/chat/completions", json=chat("big"))
            assert resp.status == 429 and resp.headers[ERROR_SOURCE_HEADER] == "upstream"
            assert resp.headers["Retry-After"] == "7"
            assert await resp.json() == {"error": {"message": "upstream says 429",
                                                   "type": "server_error", "code": "boom"}}
            rows = await gw.records(2)
            assert {(r["status"], r["error_source"], r["upstream"]) for r in rows} == {
                (400, "upstream", "box"), (429, "upstream", "box")}
    finally:
        await box.stop()


async def test_a_stream_broken_off_ends_with_the_gateways_own_event(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions",
                                json=chat("a", prompt="die after 2", stream=True))
    assert resp.status == 200 and ERROR_SOURCE_HEADER not in resp.headers   # (sent before)
    error = events(await resp.read())[-1]["error"]
    assert error["code"] == "engine_failed" and error["source"] == "gateway"
    resp = await gw.client.post("/v1/responses", json={
        "model": "a", "stream": True, "input": "die after 2", "max_output_tokens": 6})
    name, data = named_events(await resp.read())[-1]
    assert name == "error" and data["error"]["source"] == "gateway"
    rows = await gw.records(2)
    assert [(r["status"], r["error_code"], r["error_source"]) for r in rows] == [
        (200, "engine_failed", "gateway")] * 2


async def test_an_engines_refusal_after_a_waits_lines_is_the_gateways_event(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream told of its wait has its 200 out: the engine's refusal that follows can
    only be told as an error event, the gateway's, in the engine's words."""
    monkeypatch.setattr(progress, "FIRST_S", 0.05)
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2):
        gw.health.all_ready = False      # c loads until the test lets it be ready
        resp = await gw.client.post(
            "/v1/chat/completions", json=chat("c", prompt="refuse 400", stream=True),
            headers={progress.HEADER: "1"})
        await loading(gw)
        assert resp.status == 200 and ERROR_SOURCE_HEADER not in resp.headers  # (a line's)
        gw.health.all_ready = True
        lines, rest = split(await resp.read())
        ((_, data),) = named_events(rest)
        assert lines and data["error"]["source"] == "gateway"
        assert data["error"]["message"].startswith("the engine answered 400 instead of a "
                                                   "stream: the request exceeds")
        (row,) = await gw.records(1)
        assert (row["status"], row["error_code"], row["error_source"]) == (
            200, "invalid_request", "gateway")


async def test_anthropic_shaped_errors_say_whose_too(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/messages", json={"model": "nope", **MESSAGE})
    body = await resp.json()
    assert resp.status == 404 and resp.headers[ERROR_SOURCE_HEADER] == "gateway"
    assert body["type"] == "error" and body["error"]["source"] == "gateway"
    # an engine's own refusal, retold in Anthropic's shape: its words, the header says whose
    resp = await gw.client.post("/v1/messages", json={
        "model": "a", **MESSAGE, "messages": [{"role": "user", "content": "refuse 400"}]})
    body = await resp.json()
    assert resp.status == 400 and resp.headers[ERROR_SOURCE_HEADER] == "engine"
    assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                               "message": REFUSAL["error"]["message"]}}
    resp = await gw.client.post("/v1/messages/count_tokens", json={"model": "a", **MESSAGE})
    assert resp.status == 404 and resp.headers[ERROR_SOURCE_HEADER] == "engine"
    # a stream broken off: Anthropic's error event, the gateway's own
    resp = await gw.client.post("/v1/messages", json={
        "model": "a", "stream": True, "max_tokens": 6,
        "messages": [{"role": "user", "content": "die after 3"}]})
    name, data = named_events(await resp.read())[-1]
    assert name == "error" and data["error"]["source"] == "gateway"
    rows = await gw.records(4)
    assert [r["error_source"] for r in reversed(rows)] == [
        "gateway", "engine", "engine", "gateway"]


async def test_admin_records_carry_the_source(gw: Gateway) -> None:
    await gw.client.post("/v1/chat/completions", json=chat("a", prompt="refuse 400"))
    await gw.client.post("/v1/chat/completions", json=chat("nope"))
    await gw.records(2)
    rows = (await (await gw.client.get("/admin/records")).json())["records"]
    assert [(r["status"], r["error_source"]) for r in rows] == [
        (404, "gateway"), (400, "engine")]


async def test_a_request_answered_at_the_drain_deadline_is_recorded_as_the_gateways(
        tmp_path: Path) -> None:
    """A request waiting for its engine's load when the drain time runs out: the 503
    shutting_down is the gateway's, in its header and in its record."""
    async for g in _gateway(tmp_path, ("a", "b"), max_engines=2):
        g.health.all_ready = False      # c loads until the drain deadline
        asked = asyncio.ensure_future(g.client.post("/v1/chat/completions", json=chat("c")))
        await loading(g)
        cancel_open_requests(g.client.app)
        resp = await asyncio.wait_for(asked, 5)
        assert resp.status == 503 and resp.headers[ERROR_SOURCE_HEADER] == "gateway"
        (row,) = await g.records(1)
        assert (row["error_code"], row["error_source"]) == ("shutting_down", "gateway")
