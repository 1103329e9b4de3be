"""The bounds at the front door (issue 33, "Bounded by default"), against hostile fake engines:
framing that breaks the rules, an event that never ends, an answer too large to hold, more
requests waiting for a busy engine than its queue limit. Each is refused or cut off clearly
(an OpenAI-shaped error, or the stream's own error event), counted in
llm_gateway_bounded_total, and the gateway goes on serving."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gatewayd.http import openai_api
from gatewayd.http.middleware import ClientBytesRefused
from tests.fake_upstream import FakeUpstream
from tests.http.test_front_door import (
    Gateway,
    _gateway,
    _samples,
    _value,
    chat,
    events,
)
from tests.http.test_upstreams import upstream

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])
KIB = 1024


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("a",), max_event_bytes=256 * KIB,
                            max_answer_bytes=1024 * KIB):
        yield g


async def _until(condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def _bounded(gw: Gateway, bound: str) -> float | None:
    samples = _samples(await (await gw.client.get("/admin/metrics")).text())
    return _value(samples, "llm_gateway_bounded_total", bound=bound)


async def _serves_on(gw: Gateway, model: str = "a") -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat(model))
    assert resp.status == 200, await resp.text()
    resp = await gw.client.post("/v1/chat/completions", json=chat(model, stream=True))
    assert (await resp.read()).endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("size", ["-6", "0x2", "1_0", "1" * 16])
async def test_a_chunk_size_that_is_not_plain_hex_is_a_502(gw: Gateway, size: str) -> None:
    resp = await gw.client.post("/v1/chat/completions",
                                json=chat("a", prompt=f"chunk size {size}"))
    assert resp.status == 502, await resp.text()
    error = (await resp.json())["error"]
    assert error["code"] == "engine_unavailable" and "chunk size" in error["message"]
    await _serves_on(gw)
    assert await _bounded(gw, "engine_framing") == 1


@pytest.mark.parametrize("after_an_event", [False, True], ids=["first", "after-an-event"])
async def test_an_event_that_never_ends_ends_the_stream_with_an_error_event(
        gw: Gateway, after_an_event: bool) -> None:
    """4 MiB of one event with no blank line, against a 256 KiB max_event_mb: the client
    gets the events before it and an error event (the status was sent), the engine's
    connection is let go, and the gateway serves on."""
    prompt = "endless event 4096" + ("!" if after_an_event else "")
    resp = await gw.client.post("/v1/chat/completions",
                                json=chat("a", prompt=prompt, stream=True))
    assert resp.status == 200
    body = await resp.read()
    assert len(body) < 256 * KIB   # nothing of the endless event went out
    got = events(body)
    assert got[-1]["error"]["code"] == "event_too_large", got[-1]
    assert "max_event_mb" in got[-1]["error"]["message"]
    assert len(got) == (2 if after_an_event else 1)
    await _until(lambda: gw.fakes["a"].disconnects == 1, "the engine's answer was held on")
    await _serves_on(gw)
    (record,) = [r for r in await gw.records(3) if r["error_code"] == "event_too_large"]
    assert record["status"] == 200 and record["outcome"] == "error"
    assert await _bounded(gw, "max_event_mb") == 1


async def test_an_answer_over_max_answer_mb_is_a_502_and_one_under_it_passes(
        gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat("a", prompt="huge 2048"))
    assert resp.status == 502, await resp.text()
    error = (await resp.json())["error"]
    assert error["code"] == "answer_too_large" and "max_answer_mb" in error["message"]
    resp = await gw.client.post("/v1/chat/completions", json=chat("a", prompt="huge 512"))
    assert resp.status == 200 and len(await resp.read()) > 512 * KIB
    await _serves_on(gw)
    await gw.records(4)
    assert await _bounded(gw, "max_answer_mb") == 1


async def test_requests_waiting_for_a_busy_engine_are_bounded_by_its_queue_limit(
        tmp_path: Path) -> None:
    """Its connections all in use, one request waits for a turn (the model's queue_limit,
    1); the next is refused at once with 503 queue_full and Retry-After, not held with its
    body for read_timeout_s. The others are served."""
    async for gw in _gateway(tmp_path, (), models_config={"c": {"queue_limit": 1}}):
        await _one_waits_the_next_is_refused(gw)


async def _one_waits_the_next_is_refused(gw: Gateway) -> None:
    client = gw.client.app[openai_api.FRONT].engine_client
    socket = gw.units.layout("c").socket
    gw.fakes["c"].slots = 1   # two connections at once
    assert (await gw.client.post("/v1/chat/completions", json=chat("c"))).status == 200
    await _until(lambda: client.limit(socket) == 2, "its parallel slots were never learned")
    streams = [asyncio.ensure_future(gw.client.post(   # ~2 s each, a token per 0.1 s
        "/v1/chat/completions", json=chat("c", prompt="slow 100", stream=True,
                                         max_tokens=20))) for _ in range(2)]
    await _until(lambda: client.in_use(socket) == 2, "the streams never took both")
    waiter = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat("c")))
    await _until(lambda: client.waiting(socket) == 1, "the request never waited")
    t0 = time.monotonic()
    resp = await gw.client.post("/v1/chat/completions", json=chat("c"))
    assert resp.status == 503, await resp.text()
    assert (await resp.json())["error"]["code"] == "queue_full"
    assert resp.headers["Retry-After"] == "5" and time.monotonic() - t0 < 1
    assert client.in_use(socket) == 2 and client.waiting(socket) == 1
    assert (await waiter).status == 200
    for answer in await asyncio.gather(*streams):
        assert (await answer.read()).endswith(b"data: [DONE]\n\n")
    await _serves_on(gw, "c")
    await gw.records(7)
    assert await _bounded(gw, "queue_limit") == 1


async def test_a_remote_upstreams_answers_are_bounded_the_same(tmp_path: Path) -> None:
    """A remote upstream's (aiohttp's client) answer read whole, and its stream's events,
    meet the same bounds as an engine's."""
    box = FakeUpstream("box", models=["big"])
    await box.start()
    try:
        async for gw in _gateway(tmp_path, ("a",), upstreams=(upstream(box, models=("big",)),),
                                 max_event_bytes=256 * KIB, max_answer_bytes=1024 * KIB):
            resp = await gw.client.post("/v1/chat/completions",
                                        json=chat("big", prompt="huge 2048"))
            assert resp.status == 502, await resp.text()
            error = (await resp.json())["error"]
            assert error["code"] == "answer_too_large" and "'box'" in error["message"]
            resp = await gw.client.post("/v1/chat/completions", json=chat(
                "big", prompt="endless event 4096!", stream=True))
            got = events(await resp.read())
            assert got[0]["choices"][0]["delta"]["content"] == "hi"
            assert got[-1]["error"]["code"] == "event_too_large"
            resp = await gw.client.post("/v1/chat/completions", json=chat("big"))
            assert resp.status == 200, await resp.text()
            await _serves_on(gw)
            await gw.records(5)
            assert await _bounded(gw, "max_answer_mb") == 1
            assert await _bounded(gw, "max_event_mb") == 1
    finally:
        await box.stop()


async def test_a_head_the_parser_refuses_is_one_warning_line_not_a_traceback(
        gw: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    """Past the parser's own bounds (a field over 64 KiB) aiohttp answers itself and logs
    an ERROR with a traceback per request: with serve()'s filter, one warning line."""
    server = logging.getLogger("aiohttp.server")
    quiet = ClientBytesRefused()
    server.addFilter(quiet)
    try:
        with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
            host, port = gw.client.server.host, gw.client.server.port
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: "
                         + b"a" * 70_000 + b"\r\n\r\n")
            await writer.drain()
            head = await asyncio.wait_for(reader.read(200), 10)
            writer.close()
            assert head.split(b" ", 2)[1] == b"400", head
            await _until(lambda: any(r.name == "aiohttp.server" for r in caplog.records),
                         "aiohttp logged the refusal")
    finally:
        server.removeFilter(quiet)
    (record,) = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert record.levelno == logging.WARNING and record.exc_info is None, record
    assert "refused by the HTTP parser" in record.getMessage(), record.getMessage()
    await _serves_on(gw)
