"""How a relayed stream's end is told: an engine answer that ends in good HTTP order
without the stream's own final event was cut short (the client is told so in an error
event); one whose final event came whole, in a chunk passed on as it came, is not. To an
HTTP/1.0 client, a stream's end is the connection's close."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.http.raw_http import HOST, Request, exchange
from tests.http.test_front_door import Gateway, _gateway, chat, events


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("a",)):
        yield g


def engine_streams(gw: Gateway, monkeypatch: pytest.MonkeyPatch, *, tokens: int,
                   done: bool) -> None:
    """Engine a's chat streams from now on: a role event, `tokens` tokens 5 ms apart, the
    final event (finish_reason) with no usage event (an engine that does not honour
    stream_options.include_usage), then `data: [DONE]` on its own 50 ms later, or (done
    False) nothing more: the body just ends, in good HTTP order."""
    async def answer(request: web.Request, payload: dict[str, Any], prompt: str,
                     chat: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "x", "object": "chat.completion.chunk", "created": int(time.time())}
        deltas = [{"role": "assistant", "content": None},
                  *({"content": f" w{i}"} for i in range(tokens))]
        for delta in deltas:
            await response.write(b"data: " + json.dumps({**base, "choices": [
                {"index": 0, "finish_reason": None, "delta": delta}]}).encode() + b"\n\n")
            await asyncio.sleep(0.005)
        if done:
            await response.write(b"data: " + json.dumps({**base, "choices": [
                {"index": 0, "finish_reason": "length", "delta": {}}]}).encode() + b"\n\n")
            await asyncio.sleep(0.05)
            await response.write(b"data: [DONE]\n\n")
            await asyncio.sleep(0.05)
        await response.write_eof()
        return response
    monkeypatch.setattr(gw.fakes["a"], "_answer", answer)


async def test_a_stream_that_ends_without_its_final_event_ends_with_an_error_event(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    engine_streams(gw, monkeypatch, tokens=6, done=False)
    resp = await gw.client.post("/v1/chat/completions", json=chat("a", stream=True))
    assert resp.status == 200
    got = events(await resp.read())
    assert [e["choices"][0]["delta"].get("content") for e in got[1:-1]] == \
        [f" w{i}" for i in range(6)]
    assert got[-1]["error"]["code"] == "engine_failed"
    (row,) = await gw.records(1)
    assert row["outcome"] == "engine_failed" and row["status"] == 200


async def test_a_final_event_passed_on_in_its_chunk_ends_the_stream_well(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    engine_streams(gw, monkeypatch, tokens=6, done=True)
    resp = await gw.client.post("/v1/chat/completions", json=chat("a", stream=True))
    got = events(await resp.read())
    assert got[-1] == "[DONE]" and not any("error" in e for e in got[:-1])
    assert got[-2]["choices"][0]["finish_reason"] == "length"
    (row,) = await gw.records(1)
    assert row["outcome"] == "ok" and row["error_code"] is None


# HTTP/1.0 has no chunked coding: an answer whose length is not known in advance (a
# stream) ends only with the connection's close, also where the client asked for keep-alive
# (found by tests/http/test_fuzz.py: the gateway kept the connection, the client waited on)
def http10_chat(stream: bool) -> Request:
    body = json.dumps(chat("a", stream=stream, max_tokens=3)).encode()
    return Request(b"POST", b"/v1/chat/completions", b"1.0", fields=(
        (b"Host", HOST), (b"Content-Type", b"application/json"),
        (b"Connection", b"keep-alive"), (b"Content-Length", b"%d" % len(body))),
        body=(body,))


@pytest.mark.parametrize("done", [True, False], ids=["whole", "cut_short"])
async def test_an_http_1_0_keep_alive_stream_ends_with_the_close(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch, done: bool) -> None:
    """The events, then [DONE] (or the error event of a stream cut short), then the close:
    no chunk framing is passed on to it."""
    engine_streams(gw, monkeypatch, tokens=3, done=done)
    host, port = gw.client.host, gw.client.port
    assert isinstance(port, int)
    # (exchange reads an answer framed by nothing but the close until the close comes)
    conn, answer, broke = await exchange(host, port, http10_chat(stream=True))
    conn.close()
    assert answer is not None, broke
    assert answer.status == 200 and answer.get(b"transfer-encoding") is None
    assert answer.get(b"content-length") is None
    assert b"keep-alive" not in answer.tokens(b"connection")
    got = events(answer.body)
    assert [e["choices"][0]["delta"].get("content") for e in got[1:4]] == [" w0", " w1", " w2"]
    if done:
        assert got[-1] == "[DONE]" and got[-2]["choices"][0]["finish_reason"] == "length"
    else:
        assert got[-1]["error"]["code"] == "engine_failed"
    (row,) = await gw.records(1)
    assert row["outcome"] == ("ok" if done else "engine_failed")


async def test_an_http_1_0_keep_alive_answer_of_known_length_keeps_the_connection(
        gw: Gateway) -> None:
    """Not a stream: its Content-Length ends it, and the connection serves the next."""
    host, port = gw.client.host, gw.client.port
    assert isinstance(port, int)
    conn, answer, broke = await exchange(host, port, http10_chat(stream=False))
    try:
        assert answer is not None, broke
        assert answer.status == 200 and answer.get(b"content-length") is not None
        assert json.loads(answer.body)["choices"][0]["message"]["content"]
        await conn.send(http10_chat(stream=False).wire(f"{host}:{port}".encode()))
        again = await asyncio.wait_for(conn.answer(head_only=False), 10)
        assert again.status == 200 and json.loads(again.body)["choices"]
    finally:
        conn.close()
