"""The OpenAI front door over real HTTP, relaying to fake engines on real unix sockets."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.adapters import records
from gatewayd.adapters.engine_wire.client import EngineResponse
from gatewayd.app import build_app
from gatewayd.core.config import Backend, ModelKind
from gatewayd.core.engines import EngineState
from gatewayd.http import openai_api
from gatewayd.http.auth import PARSER_LIMITS
from gatewayd.http.drain import cancel_open_requests
from gatewayd.service.engine_manager import EngineManager
from tests.fake_engine import FakeEngine
from tests.fakes import FakeHealth, FakeUnits, engine_layer_on, engine_manager_on_fakes

# the gateway runs on uvloop where installed: the front door is tested on it (the admin
# API, keys and upstreams tests, on the same app, run on asyncio's loop)
pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


@dataclass
class Gateway:
    client: TestClient[web.Request, web.Application]
    engines: EngineManager
    fakes: dict[str, FakeEngine]
    records_file: Path
    units: FakeUnits
    health: FakeHealth

    async def records(self, count: int, timeout: float = 5) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        rows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            rows = records.query(self.records_file, limit=1000)
            if len(rows) >= count:
                return rows
            await asyncio.sleep(0.05)
        raise AssertionError(f"expected {count} records, have {rows}")


async def _gateway(tmp_path: Path, start: tuple[str, ...], **config: Any
                   ) -> AsyncIterator[Gateway]:
    run_root = tempfile.mkdtemp(prefix="fe", dir="/tmp")  # short: sun_path is 108 bytes
    config.setdefault("records_store_text", True)
    config.setdefault("admin_public", True)   # the admin API tests use the public port
    mgr, units, health = engine_manager_on_fakes(tmp_path, run_root=run_root, **config)
    fakes = {}
    for name in ("a", "b", "c"):
        fakes[name] = FakeEngine(name)
        await fakes[name].start(units.layout(name).socket)

    app = build_app(mgr.config, engines_ctx=engine_layer_on(mgr))
    server = TestServer(app)
    await server.start_server(**PARSER_LIMITS)   # the parser's room as `serve` gives it
    async with TestClient(server) as client:
        for name in start:
            await mgr.lifecycle.start(name)
        yield Gateway(client, mgr, fakes, mgr.config.records_file, units, health)
    for fake in fakes.values():
        await fake.stop()
    shutil.rmtree(run_root, ignore_errors=True)


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("a", "b")):
        yield g


@pytest.fixture
async def gw_one(tmp_path: Path) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("b",)):
        yield g


def chat(model: str | None = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": kw.pop("prompt", "hi")}],
                            "max_tokens": 4, **kw}
    if model is not None:
        body["model"] = model
    return body


def events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[6:]
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def test_chat_is_routed_by_alias_and_recorded(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat("A"))
    assert resp.status == 200
    body = await resp.json()
    assert body["model"] == "a" and body["usage"]["completion_tokens"] == 4
    (row,) = await gw.records(1)
    assert row["model"] == "a" and row["engine"] == "llm-engine-a.service"
    assert row["endpoint"] == "/v1/chat/completions" and row["status"] == 200
    assert row["outcome"] == "ok" and row["error_code"] is None
    assert (row["prompt_tokens"], row["completion_tokens"]) == (11, 4)
    assert row["stream"] == 0 and row["disconnected"] == 0
    assert row["bytes_in"] > 50 and row["bytes_out"] == len(await resp.read())
    assert row["latency_ms"] > 0 and row["ttft_ms"] is None
    assert '"model": "A"' in row["request_text"] and "w0 w1" in row["response_text"]


async def test_stream_gets_usage_for_the_record_but_not_for_the_client(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat("b", stream=True))
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream"
    assert resp.headers["X-Accel-Buffering"] == "no"
    got = events(await resp.read())
    assert got[-1] == "[DONE]"
    assert all(e["choices"] for e in got[:-1])          # no usage-only chunk leaked
    sent = json.loads(gw.fakes["b"].requests[-1].body)
    assert sent["stream_options"] == {"include_usage": True}   # injected upstream
    (row,) = await gw.records(1)
    assert row["stream"] == 1 and row["completion_tokens"] == 4 and row["prompt_tokens"] == 11
    assert row["ttft_ms"] is not None and 0 < row["ttft_ms"] <= row["latency_ms"]


async def test_stream_with_usage_asked_keeps_the_usage_chunk(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat(
        "b", stream=True, stream_options={"include_usage": True}))
    got = events(await resp.read())
    assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 4


async def test_events_are_passed_one_by_one_not_batched(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat(
        "a", stream=True, prompt="slow 60", max_tokens=5))
    arrivals = []
    async for _ in resp.content.iter_any():
        arrivals.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(arrivals) >= 5 and sum(g > 0.04 for g in gaps) >= 4


def chunks_of(raw: bytes) -> list[bytes]:
    """The data of each chunk of a chunked body, checking the framing as it goes."""
    out: list[bytes] = []
    while True:
        line, _, raw = raw.partition(b"\r\n")
        assert re.fullmatch(rb"[0-9a-f]+", line), line
        size = int(line, 16)
        if size == 0:
            assert raw == b"\r\n"
            return out
        out.append(raw[:size])
        assert raw[size:size + 2] == b"\r\n"
        raw = raw[size + 2:]


async def test_a_stream_reaches_the_client_as_whole_chunks_of_whole_events(
        gw: Gateway) -> None:
    """Byte for byte on the wire: every chunk the client gets holds whole events, the
    events are the engine's (the usage event it was asked for by the gateway dropped), in
    order, and the body ends properly; the record has the first event's time."""
    body = json.dumps(chat("a", stream=True, prompt="slow 5", max_tokens=12)).encode()
    reader, writer = await asyncio.open_connection(gw.client.host, gw.client.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert b"transfer-encoding: chunked" in head.lower()
    raw = b""
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        raw += await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    pieces = chunks_of(raw)
    assert all(p.endswith(b"\n\n") for p in pieces)
    got = events(b"".join(pieces))
    assert [e["choices"][0]["delta"].get("content") for e in got[1:13]] == \
        [f" w{i}" for i in range(12)]
    assert got[0]["choices"][0]["delta"]["role"] == "assistant"
    assert got[13]["choices"][0]["finish_reason"] == "length" and got[14:] == ["[DONE]"]
    (row,) = await gw.records(1)
    assert row["outcome"] == "ok" and row["completion_tokens"] == 12
    assert row["bytes_out"] == sum(len(p) for p in pieces)
    assert row["ttft_ms"] is not None and 0 < row["ttft_ms"] <= row["latency_ms"]


async def test_a_stream_whose_engine_splits_its_chunks_arrives_whole(gw: Gateway) -> None:
    """The engine's chunks arrive in pieces (a read ends in the middle of one): each event
    still reaches the client whole, in order."""
    resp = await gw.client.post("/v1/chat/completions", json=chat(
        "a", stream=True, prompt="split 60 slow 5", max_tokens=12))
    got = events(await resp.read())
    assert [e["choices"][0]["delta"].get("content") for e in got[1:13]] == \
        [f" w{i}" for i in range(12)]
    assert got[-1] == "[DONE]"
    (row,) = await gw.records(1)
    assert row["outcome"] == "ok" and row["completion_tokens"] == 12


async def test_a_stream_open_at_the_drain_deadline_ends_with_an_error_chunk(
        gw: Gateway) -> None:
    """The gateway's drain deadline cancels a stream's handler with its client still there:
    the client gets the events so far, then shutting_down as an event of its own in a
    chunk of its own, and the body's proper end."""
    body = json.dumps(chat("a", stream=True, prompt="slow 30", max_tokens=200)).encode()
    reader, writer = await asyncio.open_connection(gw.client.host, gw.client.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    raw = b""
    while raw.count(b"data: {") < 4:       # the role event and 3 tokens, at 30 ms each
        raw += await asyncio.wait_for(reader.read(65536), 10)
    cancel_open_requests(gw.client.app)
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        raw += await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    pieces = chunks_of(raw)
    got = events(b"".join(pieces))
    assert got[-1]["error"]["code"] == "shutting_down" and len(got) < 100
    assert pieces[-1].startswith(b'data: {"error"')  # a chunk of its own
    (row,) = await gw.records(1)
    assert (row["outcome"], row["error_code"]) == ("error", "shutting_down")


async def test_completions_stream_usage_in_the_last_chunk(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/completions", json={"model": "a", "prompt": "x y",
                                                          "max_tokens": 3, "stream": True})
    got = events(await resp.read())
    assert got[-2]["usage"]["completion_tokens"] == 3 and got[-2]["choices"]
    (row,) = await gw.records(1)
    assert row["completion_tokens"] == 3


async def test_a_streamed_then_a_plain_request_on_one_engine(gw: Gateway) -> None:
    # the engine closes the connection after a stream; it must not be reused
    for _ in range(3):
        resp = await gw.client.post("/v1/chat/completions", json=chat("a", stream=True))
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
        assert resp.status == 200


@pytest.mark.parametrize("body,status,code", [
    (chat("gpt-5"), 404, "model_not_found"),
    (chat(), 400, "model_required"),              # two engines ready
    ({"model": 7}, 400, "invalid_request"),
])
async def test_routing_errors(gw: Gateway, body: dict[str, Any], status: int,
                              code: str) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=body)
    assert resp.status == status
    error = (await resp.json())["error"]
    assert error["code"] == code and error["type"] and error["message"]
    if body.get("model") == "gpt-5":            # what exists
        assert error["available_models"] == ["a", "b", "c"]
    (row,) = await gw.records(1)
    assert row["status"] == status and row["outcome"] == "error" and row["error_code"] == code


async def test_invalid_json_is_a_clear_400(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", data=b'{"model": "a",',
                                headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert "not valid JSON" in (await resp.json())["error"]["message"]


async def test_without_model_one_ready_engine_answers(gw_one: Gateway) -> None:
    resp = await gw_one.client.post("/v1/chat/completions", json=chat())
    assert resp.status == 200 and (await resp.json())["model"] == "b"


async def test_props_and_metrics_go_to_the_default_engine(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), default_model="B"):
        props = await (await gw.client.get("/props")).json()
        assert props["fake"] == "b"
        props = await (await gw.client.get("/props", params={"model": "a"})).json()
        assert props["fake"] == "a"
        text = await (await gw.client.get("/metrics")).text()
        assert 'fake="b"' in text


async def test_props_without_default_go_to_the_first_ready_engine(gw: Gateway) -> None:
    assert (await (await gw.client.get("/props")).json())["fake"] == "a"


async def test_body_over_the_limit_is_413(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",), max_body_bytes=1000):
        resp = await gw.client.post("/v1/chat/completions", json=chat("a", prompt="x" * 2000))
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
            for _ in range(5):
                yield b"x" * 500
        resp = await gw.client.post("/v1/chat/completions", data=chunks(),
                                    headers={"Content-Type": "application/json"})
        assert resp.status == 413
        resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
        assert resp.status == 200                  # and the gateway serves on


@pytest.fixture
async def gw_audio(tmp_path: Path) -> AsyncIterator[Gateway]:
    """a: a ready llama engine; b: a ready whisper engine."""
    async for g in _gateway(tmp_path, ("a", "b"),
                            models_config={"b": {"backend": Backend.WHISPER}}):
        yield g


async def test_requests_go_only_to_engines_that_can_answer_them(gw_audio: Gateway,
                                                                gw_one: Gateway) -> None:
    """A transcription never reaches a llama engine, a chat never a whisper one."""
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF....", filename="a.wav", content_type="audio/wav")
    resp = await gw_one.client.post("/v1/audio/transcriptions", data=form)   # b: llama
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "model_required"
    assert gw_one.fakes["b"].requests == []
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF....", filename="a.wav", content_type="audio/wav")
    resp = await gw_audio.client.post("/v1/audio/transcriptions", data=form)  # the one whisper
    assert resp.status == 200 and (await resp.json())["text"] == "hello from b"
    form = aiohttp.FormData()
    form.add_field("model", "a")
    form.add_field("file", b"RIFF....", filename="a.wav", content_type="audio/wav")
    resp = await gw_audio.client.post("/v1/audio/transcriptions", data=form)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "'a' is a chat model (llama) and cannot" in error["message"]
    resp = await gw_audio.client.post("/v1/chat/completions", json=chat("b"))
    assert resp.status == 400 and "audio model (whisper)" in (await resp.json())["error"][
        "message"]
    resp = await gw_audio.client.post("/v1/chat/completions", json=chat())   # the one llama
    assert resp.status == 200 and (await resp.json())["model"] == "a"
    assert [r.path for r in gw_audio.fakes["a"].requests] == ["/v1/chat/completions"]


async def test_multipart_model_field_not_filename(gw_audio: Gateway) -> None:
    gw = gw_audio
    form = aiohttp.FormData()
    audio = b"RIFF" + bytes(range(256)) * 50
    form.add_field("file", audio, filename="model-trap.wav", content_type="audio/wav")
    form.add_field("model", "b")
    form.add_field("response_format", "json")
    resp = await gw.client.post("/v1/audio/transcriptions", data=form)
    assert resp.status == 200
    assert (await resp.json()) == {"text": "hello from b"}   # whisper's padding removed
    seen = gw.fakes["b"].requests[-1]
    assert audio in seen.body                                # every byte of the upload
    assert b"model-trap.wav" in seen.body and b"RIFF" in seen.body   # forwarded as is
    (row,) = await gw.records(1)
    assert row["model"] == "b" and row["request_text"] is None   # audio is never recorded


async def test_multipart_without_model_field_is_model_required(gw: Gateway) -> None:
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF....", filename="model.wav", content_type="audio/wav")
    resp = await gw.client.post("/v1/audio/transcriptions", data=form)
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "model_required"


@pytest.mark.parametrize("prompt", ["die after 2", "slow 10 die after 2"],
                         ids=["at-once", "paced"])   # paced: the events after the first pushed
async def test_engine_dies_mid_stream_ends_with_an_error_event(gw: Gateway,
                                                               prompt: str) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat(
        "a", stream=True, prompt=prompt, max_tokens=6))
    assert resp.status == 200               # sent before the engine died: it stays 200
    got = events(await resp.read())
    assert got[-1]["error"]["code"] == "engine_failed"
    assert sum(1 for e in got if "choices" in e) >= 2
    (row,) = await gw.records(1)
    assert row["outcome"] == "engine_failed" and row["status"] == 200
    assert row["completion_tokens"] == 3    # role event + 2 tokens: an estimate


@pytest.mark.parametrize("prompt", ["linger 400", "slow 5 linger 400"],
                         ids=["at-once", "paced"])
async def test_a_client_that_closes_at_the_final_event_got_its_answer(
        gw: Gateway, prompt: str) -> None:
    """The OpenAI SDK closes its connection at [DONE], without waiting for the chunked
    body's end: the answer was delivered (outcome ok), even when the engine's own end of
    the stream comes later."""
    resp = await gw.client.post("/v1/chat/completions", json=chat(
        "a", stream=True, prompt=prompt, max_tokens=6))
    seen = b""
    while b"data: [DONE]" not in seen:
        seen += await resp.content.readuntil(b"\n\n")
    resp.close()                             # before the stream's end, which lingers
    (row,) = await gw.records(1, timeout=10)
    assert row["outcome"] == "ok" and row["disconnected"] == 0 and row["status"] == 200
    assert row["completion_tokens"] == 6


async def test_client_disconnect_mid_stream_is_recorded(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat(
        "a", stream=True, prompt="slow 50", max_tokens=40))
    await resp.content.readuntil(b"\n\n")
    await resp.content.readuntil(b"\n\n")
    resp.close()                             # the client goes away
    (row,) = await gw.records(1, timeout=10)
    assert row["disconnected"] == 1 and row["outcome"] == "disconnected"
    assert row["completion_tokens"] is not None and row["completion_tokens"] < 40
    engine = gw.fakes["a"]                   # the engine saw its reader go, and stopped
    for _ in range(100):
        if engine.disconnects:
            break
        await asyncio.sleep(0.02)
    assert engine.disconnects == 1 and engine.events_sent < 20
    assert (await gw.client.post("/v1/chat/completions", json=chat("a"))).status == 200


async def test_a_client_that_stops_reading_holds_the_engine_and_gets_everything(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """Events are pushed to the client from the engine connection's callback; a client
    that does not read makes the gateway stop reading from the engine (the engine is
    held, the gateway buffers ~64 KiB, not the whole answer), and when it reads again
    it gets every event, in order, and the end."""
    holding: set[EngineResponse] = set()   # the Python relay's holds, not resumed
    hold, resume = EngineResponse.hold, EngineResponse.resume

    def held(self: EngineResponse) -> None:
        holding.add(self)
        hold(self)

    def resumed(self: EngineResponse) -> None:
        holding.discard(self)
        resume(self)
    monkeypatch.setattr(EngineResponse, "hold", held)
    monkeypatch.setattr(EngineResponse, "resume", resumed)
    n, pad = 6000, 4000    # 24 MB: more than the socket buffers on the way hold (~10 MB)
    resp = await gw.client.post("/v1/chat/completions", json=chat(
        "a", stream=True, prompt=f"pad {pad}", max_tokens=n))
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")    # then a slow reader: nothing for a while
    engine = gw.fakes["a"]
    assert engine.runner is not None and engine.runner.server is not None
    server = engine.runner.server
    # until the engine waits to write (its socket is full) while the gateway does not read
    # it (the relay's hold): from then on it stays so until the client reads, however slow
    # the machine
    deadline = time.monotonic() + 10
    while not (holding and any(h.writing_paused for h in server.connections)):
        assert engine.events_sent < n, "the gateway read the whole answer: nothing held it"
        assert time.monotonic() < deadline, engine.events_sent
        await asyncio.sleep(0.005)
    assert engine.events_sent < n * 0.75, engine.events_sent   # held, not read to the end
    got = events(await resp.read())
    tokens = [e["choices"][0]["delta"].get("content") for e in got[:-1]
              if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(tokens) == n and tokens[-1].startswith(f" w{n - 1}x")
    assert got[-1] == "[DONE]"
    (row,) = await gw.records(1)
    assert row["outcome"] == "ok" and row["completion_tokens"] == n


async def test_a_client_that_reads_nothing_for_read_timeout_s_is_dropped_and_lets_go(
        tmp_path: Path) -> None:
    """A stream's client that takes no bytes for read_timeout_s while the gateway has some
    for it (a stuck or hostile reader) is cut off: the engine it held is let go (its
    connection closed, the turn free), and the record says client_stalled."""
    async for gw in _gateway(tmp_path, ("a",), read_timeout_s=1.0):
        body = json.dumps(chat("a", stream=True, prompt="pad 4000", max_tokens=6000)).encode()
        reader, writer = await asyncio.open_connection(gw.client.host, gw.client.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await reader.readuntil(b"\r\n\r\n")       # the head: then read nothing more
        transport = cast(asyncio.Transport, writer.transport)   # (uvloop's: no subclass)
        transport.pause_reading()                  # (the kernel buffers fill, then stay full)
        client = gw.client.app[openai_api.FRONT].engine_client
        engine_socket = gw.units.layout("a").socket
        t0 = time.monotonic()
        (row,) = await gw.records(1, timeout=10)    # written once the gateway gave up on it
        assert time.monotonic() - t0 >= 0.9
        assert row["outcome"] == "disconnected" and row["error_code"] == "client_stalled"
        assert 0 < row["completion_tokens"] < 6000       # held part-way, then let go
        assert client.in_use(engine_socket) == 0          # its engine connection closed
        resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
        assert resp.status == 200                         # the engine serves the next
        writer.close()


async def test_a_client_that_leaves_while_its_stream_is_held_is_recorded_as_gone(
        tmp_path: Path) -> None:
    """A stream's client that stops reading (the engine held for it) and then resets its
    connection left: the record says disconnected with no error of the engine's (aiohttp
    cancels the handler waiting for the client's buffer to drain; a reset raised by that
    wait would read as the engine breaking off), the engine connection is let go and the
    engine serves the next request."""
    async for gw in _gateway(tmp_path, ("a",)):
        body = json.dumps(chat("a", stream=True, prompt="pad 4000", max_tokens=6000)).encode()
        reader, writer = await asyncio.open_connection(gw.client.host, gw.client.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await reader.readuntil(b"\r\n\r\n")
        transport = cast(asyncio.Transport, writer.transport)   # (uvloop's: no subclass)
        transport.pause_reading()                  # the kernel buffers fill, the engine held
        engine = gw.fakes["a"]
        assert engine.runner is not None and engine.runner.server is not None
        deadline = time.monotonic() + 10
        while not any(h.writing_paused for h in engine.runner.server.connections):
            assert time.monotonic() < deadline, "the engine was never held"
            await asyncio.sleep(0.005)
        transport.abort()                          # then the client goes
        (row,) = await gw.records(1, timeout=10)
        assert row["outcome"] == "disconnected" and row["error_code"] is None, row
        client = gw.client.app[openai_api.FRONT].engine_client
        assert client.in_use(gw.units.layout("a").socket) == 0
        resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
        assert resp.status == 200


async def test_an_http_1_0_client_gets_its_stream_unframed_until_the_close(
        gw: Gateway) -> None:
    """No chunked transfer coding for HTTP/1.0: the pushed events go out as they are and
    the connection's close ends the answer."""
    body = json.dumps(chat("a", stream=True, max_tokens=5, prompt="slow 10")).encode()
    reader, writer = await asyncio.open_connection(gw.client.host, gw.client.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    answer = await asyncio.wait_for(reader.read(), 10)   # to the close
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0]
    assert b"chunked" not in head.lower()
    got = events(payload)
    assert got[-1] == "[DONE]" and sum(1 for e in got[:-1] if e["choices"]) == 7  # role, 5, end


async def test_engine_errors_pass_through(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",), models_config={"a": {"kind": ModelKind.EMBEDDING}}):
        resp = await gw.client.post("/v1/embeddings", json={"model": "a", "input": "hi"})
        assert resp.status == 501                        # (the fake answers as if misstarted)
        assert "--embeddings" in (await resp.json())["error"]["message"]
        (row,) = await gw.records(1)
        assert row["outcome"] == "error" and row["error_code"] == "501"


async def test_each_kind_gets_only_its_own_requests(tmp_path: Path) -> None:
    """kind = "embedding" makes a model's engine an embeddings engine, kind = "rerank" a
    reranker: /v1/embeddings and /v1/rerank go there (and nowhere else), generation never
    does; a mismatch is a 400 that says what is needed; /v1/models says which is which."""
    async for gw in _gateway(tmp_path, ("a", "b", "c"), models_config={
            "b": {"kind": ModelKind.EMBEDDING}, "c": {"kind": ModelKind.RERANK}}):
        resp = await gw.client.post("/v1/embeddings", json={"model": "a", "input": "hi"})
        error = (await resp.json())["error"]
        assert resp.status == 400 and 'kind = "embedding"' in error["message"]
        assert error["code"] == "invalid_request" and error["param"] == "model"
        resp = await gw.client.post("/v1/chat/completions", json=chat("b"))
        assert "'b' is an embedding model" in (await resp.json())["error"]["message"]
        for path in ("/v1/rerank", "/v1/reranking", "/rerank"):
            resp = await gw.client.post(path, json={"model": "b", "query": "q",
                                                    "documents": ["d"]})
            assert resp.status == 400
            assert 'kind = "rerank"' in (await resp.json())["error"]["message"]
        resp = await gw.client.post("/v1/rerank", json={"model": "c", "query": "q",
                                                        "documents": ["d"]})
        assert resp.headers["X-Request-Id"] == "c"                     # relayed there
        resp = await gw.client.post("/v1/embeddings", json={"input": "hi"})   # the one
        assert resp.status == 501 and resp.headers["X-Request-Id"] == "b"
        models = {m["id"]: m for m in (await (await gw.client.get("/v1/models")).json())[
            "data"]}
        assert [(models[m]["kind"], models[m]["capabilities"]) for m in "abc"] == [
            ("chat", ["completion"]), ("embedding", ["embeddings"]), ("rerank", ["rerank"])]
        assert not any(r.path == "/v1/embeddings" for r in gw.fakes["a"].requests)


async def test_v1_models_lists_loaded_engines_first(gw: Gateway) -> None:
    data = (await (await gw.client.get("/v1/models")).json())["data"]
    assert [m["id"] for m in data][:2] == ["a", "b"] and data[2]["id"] == "c"
    assert data[0]["loaded"] and data[0]["state"] == "ready"
    assert data[0]["engine"] == "llm-engine-a.service"
    assert not data[2]["loaded"] and data[2]["state"] == "stopped"
    assert data[0]["vram_estimate_mib"] == 3 + 100 and data[0]["object"] == "model"


async def test_whisper_load_is_never_forwarded(gw: Gateway) -> None:
    resp = await gw.client.post("/load", data={"model": "/etc/passwd"})
    assert resp.status == 404
    assert all(r.path != "/load" for f in gw.fakes.values() for r in f.requests)


async def test_health_and_admin_records(gw: Gateway) -> None:
    assert (await (await gw.client.get("/health")).json()) == {"status": "ok",
                                                                "engines_ready": 2}
    await gw.client.post("/v1/chat/completions", json=chat("a"))
    await gw.client.post("/v1/chat/completions", json=chat("nope"))
    await gw.records(2)
    rows = (await (await gw.client.get("/admin/records", params={"status": "404"})).json())
    assert [r["model"] for r in rows["records"]] == [None]
    rows = (await (await gw.client.get("/admin/records", params={"model": "a"})).json())
    assert len(rows["records"]) == 1 and rows["records"][0]["status"] == 200
    await gw.client.post("/v1/completions", json={"model": "a", "prompt": "x"})
    await gw.records(3)
    rows = (await (await gw.client.get("/admin/records", params={
        "endpoint": "/v1/completions"})).json())
    assert [(r["endpoint"], r["model"]) for r in rows["records"]] == [("/v1/completions", "a")]
    resp = await gw.client.get("/admin/does-not-exist")
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    status = await (await gw.client.get("/admin/status")).json()
    assert status["records_dropped"] == 0


async def test_a_stopped_model_is_started_once_for_many_requests(gw: Gateway) -> None:
    answers = await asyncio.gather(*(gw.client.post("/v1/chat/completions", json=chat("c"))
                                     for _ in range(20)))
    assert [r.status for r in answers] == [200] * 20
    assert gw.units.log.count("start c") == 1      # one loader, twenty waiters


async def test_signals_that_come_late_fail_no_request(tmp_path: Path) -> None:
    """systemd's signals arriving after the jobs that sent them (a bus connection that lost
    its order): an engine stopped and started again hears its previous instance's stop
    after its own start. Every request is answered all the same, and the gateway ends up
    with the engine systemd runs."""
    async for gw in _gateway(tmp_path, ("a",)):
        gw.units.late_s = 0.02
        for _ in range(3):
            await gw.engines.lifecycle.stop("a")
            late = asyncio.ensure_future(gw.units.delivered())
            while not late.done():   # asking all the while the old and new signals come
                answers = await asyncio.gather(*(gw.client.post(
                    "/v1/chat/completions", json=chat("a")) for _ in range(3)))
                assert [r.status for r in answers] == [200] * 3
        unit = gw.units.units[gw.units.layout("a").unit]
        deadline = time.monotonic() + 5   # (a stale "inactive" is confirmed with systemd)
        while not ((e := gw.engines.registry.get("a")) and e.state is EngineState.READY
                   and e.main_pid == unit.main_pid and not e.exit_unconfirmed):
            assert time.monotonic() < deadline, (gw.engines.registry.get("a"), unit)
            await asyncio.sleep(0.005)
        assert gw.units.log.count("start a") == 4 and gw.units.refused == []


async def test_autoload_false_answers_model_not_loaded(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions?autoload=false", json=chat("c"))
    assert resp.status == 503
    error = (await resp.json())["error"]
    assert error["code"] == "model_not_loaded" and error["state"] == "stopped"
    assert "start c" not in gw.units.log


async def test_events_follow_autoload_queue_and_eviction(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2):
        resp = await gw.client.get("/admin/events")
        assert resp.headers["Content-Type"] == "text/event-stream"
        seen: list[dict[str, Any]] = []

        follower = asyncio.ensure_future(_follow_until(resp, seen, "c"))
        gw.health.all_ready = False    # c loads until all three requests wait for it
        asks = [asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat("c")))
                for _ in range(3)]
        deadline = time.monotonic() + 5
        while not any(e.get("model") == "c" and e.get("depth") == 3 for e in seen):
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.01)
        gw.health.all_ready = True
        answers = await asyncio.gather(*asks)
        assert all(r.status == 200 for r in answers)
        await asyncio.wait_for(follower, 5)
        resp.close()
        assert seen[0]["type"] == "snapshot"
        assert {e["model"] for e in seen[0]["engines"]} == {"a", "b"}
        depths = [e["depth"] for e in seen if e["type"] == "queue"]
        assert max(depths) == 3 and depths[-1] == 0, depths  # three waited, then none
        states = [(e["model"], e["state"], e.get("reason"), e.get("evicted_for"))
                  for e in seen if e["type"] == "engine"]
        why = "evicted for 'c' (max_engines reached; 'a' least recently used)"
        assert ("a", "stopping", why, "c") in states and ("a", "stopped", why, "c") in states
        assert [s for m, s, _, _ in states if m == "c"] == ["starting", "loading", "ready"]


async def _follow_until(resp: aiohttp.ClientResponse, seen: list[dict[str, Any]],
                        model: str) -> None:
    """Collect events until model's queue is empty again (the last event of an autoload)."""
    async for line in resp.content:
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            seen.append(event)
            if event.get("model") == model and event.get("depth") == 0:
                return


async def test_a_get_never_autoloads(gw: Gateway) -> None:
    resp = await gw.client.get("/props", params={"model": "c"})
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "model_not_loaded"
    assert "start c" not in gw.units.log


async def test_connections_to_an_engine_are_limited_to_its_parallel_slots_the_rest_queue_here(
        gw: Gateway) -> None:
    """Once ready, an engine's /props total_slots (+ 1) bounds the gateway's connections to
    it: llama-server would queue the rest itself, its HTTP threads held by idle keep-alive
    connections (p99 of seconds at c=64); here they wait in order, and all are answered."""
    client = gw.client.app[openai_api.FRONT].engine_client
    socket = gw.units.layout("c").socket
    gw.fakes["c"].slots = 2
    assert (await gw.client.post("/v1/chat/completions", json=chat("c"))).status == 200
    deadline = time.monotonic() + 5
    while client.limit(socket) != 3:   # parallel slots + 1, learned once it is ready
        assert time.monotonic() < deadline, "the engine's parallel slots were never learned"
        await asyncio.sleep(0.01)
    gw.fakes["c"].peak_in_flight = 0
    answers = await asyncio.gather(*(gw.client.post(
        "/v1/chat/completions", json=chat("c", prompt="slow 20", stream=True))
        for _ in range(8)))
    assert [r.status for r in answers] == [200] * 8
    bodies = [await r.read() for r in answers]
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    assert gw.fakes["c"].peak_in_flight == 3
    # an operator's look at the engine does not queue behind inference
    assert (await gw.client.get("/admin/metrics", params={"engines": "1"})).status == 200


async def test_an_engines_parallel_slots_are_known_before_it_is_ready(gw: Gateway) -> None:
    """The limit is learned before the engine is ready (not after, beside the first
    request): a burst that waited for the engine to start meets it at once."""
    client = gw.client.app[openai_api.FRONT].engine_client
    socket = gw.units.layout("c").socket
    gw.fakes["c"].slots = 2
    at_ready: list[int | None] = []
    gw.engines.registry.subscribe(lambda old, new: at_ready.append(client.limit(socket))
                         if new.model_id == "c" and new.state is EngineState.READY
                         and old.state is not EngineState.READY else None)
    burst = await asyncio.gather(*(gw.client.post(
        "/v1/chat/completions", json=chat("c", prompt="slow 5", stream=True))
        for _ in range(6)))
    assert [r.status for r in burst] == [200] * 6
    bodies = [await r.read() for r in burst]
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    assert at_ready == [3]
    assert gw.fakes["c"].peak_in_flight <= 3


async def test_a_request_that_waits_too_long_for_a_busy_engine_is_told_to_retry(
        tmp_path: Path) -> None:
    """With all of an engine's connections in use for read_timeout_s, a waiting request gets
    a 503 engine_busy with Retry-After (not an endless wait); the busy ones finish, and the
    engine takes the next."""
    async for gw in _gateway(tmp_path, (), read_timeout_s=0.6):
        client = gw.client.app[openai_api.FRONT].engine_client
        socket = gw.units.layout("c").socket
        gw.fakes["c"].slots = 1
        assert (await gw.client.post("/v1/chat/completions", json=chat("c"))).status == 200
        deadline = time.monotonic() + 5
        while client.limit(socket) != 2:
            assert time.monotonic() < deadline, "the engine's parallel slots were never learned"
            await asyncio.sleep(0.01)
        streams = [asyncio.ensure_future(gw.client.post(   # ~2 s each, a token per 0.1 s
            "/v1/chat/completions", json=chat("c", prompt="slow 100", stream=True,
                                             max_tokens=20))) for _ in range(2)]
        while client.in_use(socket) != 2:
            assert time.monotonic() < deadline, "the streams never took both connections"
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat("c")))
        while client.waiting(socket) != 1:
            assert time.monotonic() < deadline, "the request never waited for a turn"
            await asyncio.sleep(0.01)
        m = _samples(await (await gw.client.get("/admin/metrics")).text())
        assert _value(m, "llm_gateway_engine_waiting", model="c") == 1
        resp = await waiter
        assert resp.status == 503, await resp.text()
        error = (await resp.json())["error"]
        assert error["code"] == "engine_busy" and error["type"] == "server_error"
        assert "busy" in error["message"] and resp.headers["Retry-After"] == "5"
        assert time.monotonic() - t0 >= 0.6
        assert client.in_use(socket) == 2               # the streams were still going
        for answer in await asyncio.gather(*streams):
            assert answer.status == 200
            assert (await answer.read()).endswith(b"data: [DONE]\n\n")
        assert (await gw.client.post("/v1/chat/completions", json=chat("c"))).status == 200
        assert client.in_use(socket) == 0 and client.waiting(socket) == 0
        await gw.records(5)   # (the metrics count a call as its record is written)
        m = _samples(await (await gw.client.get("/admin/metrics")).text())
        assert _value(m, "llm_gateway_rejected_total", model="c", reason="engine_busy") == 1


async def test_a_stopped_engine_leaves_no_pooled_connections(gw: Gateway) -> None:
    assert (await gw.client.post("/v1/chat/completions", json=chat("a"))).status == 200
    client = gw.client.app[openai_api.FRONT].engine_client
    socket = gw.units.layout("a").socket
    assert client.pooled(socket)
    await gw.engines.lifecycle.stop("a")
    assert not client.pooled(socket)


# -- the client's mistakes: a clear 4xx with the envelope, never a 500 -------------------


@pytest.mark.parametrize(("content_type", "body"), [
    ("application/json", b"[" * 100_000 + b"]" * 100_000),                 # nested too deep
    ("application/json", b'{"model": "a", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    ("multipart/form-data", b"--x\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nb"),
    ("multipart/form-data; boundary=x",                                     # cut short
     b"--x\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF"),
    ("multipart/form-data; boundary=x", b"--x\r\nno headers end here"),
    ("multipart/form-data; boundary=x", b"\xff\xfe" * 100),
    ("multipart/form-data; boundary=\u20ac", b"--\xe2\x82\xac--\r\n"),   # no RFC 2046 boundary
    ("application/json", b"\xff\xfe{}"),
    ("application/json", b'"just a string"'),
])
async def test_a_malformed_body_is_a_400_with_the_envelope(gw: Gateway, content_type: str,
                                                           body: bytes) -> None:
    path = "/v1/chat/completions" if content_type == "application/json" \
        else "/v1/audio/transcriptions"
    resp = await gw.client.post(path, data=body, headers={"Content-Type": content_type})
    error = (await resp.json())["error"]
    assert resp.status == 400, error
    assert error["type"] == "invalid_request_error" and error["message"] and error["code"]
    resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
    assert resp.status == 200                                   # and the gateway serves on


async def test_busy_and_full_answers_carry_retry_after(tmp_path: Path) -> None:
    """429 (max_concurrency) and 503 (queue full) tell the client when to come back."""
    async for gw in _gateway(tmp_path, ("a",), models_config={
            "a": {"max_concurrency": 1}, "c": {"queue_limit": 0}}):
        held = await gw.client.post("/v1/chat/completions",
                                    json=chat("a", prompt="slow 200", stream=True))
        assert held.status == 200
        resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "concurrency_limit"
        await held.read()                                        # the turn is free again
        assert (await gw.client.post("/v1/chat/completions", json=chat("a"))).status == 200
        resp = await gw.client.post("/v1/chat/completions", json=chat("c"))
        assert resp.status == 503 and int(resp.headers["Retry-After"]) > 0
        assert (await resp.json())["error"]["code"] == "queue_full"


async def test_a_model_is_retrieved_by_any_of_its_names(gw: Gateway) -> None:
    """GET /v1/models/{id} (the SDKs' models.retrieve) is the gateway's answer, never
    relayed to an engine; unknown: 404 model_not_found with the available models."""
    listed = {m["id"]: m for m in (await (await gw.client.get("/v1/models")).json())["data"]}
    resp = await gw.client.get("/v1/models/A")
    assert resp.status == 200 and await resp.json() == listed["a"]
    assert (await (await gw.client.get("/v1/models/c")).json())["state"] == "stopped"
    resp = await gw.client.get("/v1/models/nope")
    body = await resp.json()
    assert resp.status == 404 and body["error"]["code"] == "model_not_found"
    assert body["error"]["available_models"] == body["available_models"] == ["a", "b", "c"]
    assert all(not r.path.startswith("/v1/models") for f in gw.fakes.values()
               for r in f.requests)


def named_events(raw: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    out: list[tuple[str | None, dict[str, Any]]] = []
    for block in raw.decode().split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
        if data is not None:
            out.append((name, data))
    return out


@pytest.mark.parametrize(("path", "body", "counts"), [
    ("/v1/responses", {"input": "one two", "max_output_tokens": 3}, (12, 3)),
    ("/v1/messages", {"messages": [{"role": "user", "content": "one two"}], "max_tokens": 3},
     (12, 3)),
], ids=["responses", "anthropic"])
async def test_usage_of_every_stream_format_is_recorded(
        gw: Gateway, path: str, body: dict[str, Any], counts: tuple[int, int]) -> None:
    """The usage of a Responses stream (response.completed) and of an Anthropic stream
    (message_start + message_delta) reaches the record, and the plain answers' too."""
    resp = await gw.client.post(path, json={"model": "a", "stream": True, **body})
    got = named_events(await resp.read())
    assert resp.status == 200 and got[-1][0] in ("response.completed", "message_stop")
    resp = await gw.client.post(path, json={"model": "a", **body})
    assert resp.status == 200
    rows = await gw.records(2)
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [counts, counts]
    assert sorted(r["stream"] for r in rows) == [0, 1]
    assert all(r["outcome"] == "ok" for r in rows)


@pytest.mark.parametrize(("path", "body", "error_name"), [
    ("/v1/responses", {"input": "die after 3", "max_output_tokens": 6}, "error"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "die after 5"}],
                      "max_tokens": 6}, "error"),
], ids=["responses", "anthropic"])
async def test_a_broken_stream_ends_with_its_own_formats_error_event(
        gw: Gateway, path: str, body: dict[str, Any], error_name: str) -> None:
    resp = await gw.client.post(path, json={"model": "a", "stream": True, **body})
    assert resp.status == 200
    got = named_events(await resp.read())
    name, data = got[-1]
    assert name == error_name and data["type"] == "error"
    if path == "/v1/messages":   # Anthropic's shape, which its SDK raises on
        assert data["error"]["type"] == "api_error"
        assert data["error"]["code"] == "engine_failed"
    else:                        # the Responses API's error event (+ the envelope)
        assert data["code"] == "engine_failed" and data["error"]["code"] == "engine_failed"
    (row,) = await gw.records(1)
    assert row["outcome"] == "engine_failed" and row["status"] == 200


async def test_anthropic_paths_answer_errors_in_anthropics_shape(gw: Gateway) -> None:
    """/v1/messages* errors: {"type": "error", "error": {type, message}} with the same
    statuses, so the anthropic SDK raises NotFoundError, BadRequestError, ..."""
    msg = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = await gw.client.post("/v1/messages", json={"model": "nope", **msg})
    body = await resp.json()
    assert resp.status == 404 and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and "nope" in body["error"]["message"]
    assert body["available_models"] == ["a", "b", "c"]
    resp = await gw.client.post("/v1/messages", json=msg)            # two are ready
    body = await resp.json()
    assert resp.status == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["available_models"] == ["a", "b"]
    resp = await gw.client.post("/v1/messages", data=b"{not json",
                                headers={"Content-Type": "application/json"})
    assert resp.status == 400 and (await resp.json())["type"] == "error"
    # an engine's own error (this one has no count_tokens): retold in Anthropic's shape
    resp = await gw.client.post("/v1/messages/count_tokens", json={"model": "a", **msg})
    body = await resp.json()
    assert resp.status == 404 and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    assert resp.headers["X-Request-Id"] == "a"
    # elsewhere the OpenAI envelope, as before
    resp = await gw.client.post("/v1/chat/completions", json=chat("nope"))
    body = await resp.json()
    assert resp.status == 404 and body["error"]["type"] == "invalid_request_error"
    assert body["available_models"] == ["a", "b", "c"] and "type" not in body


async def test_a_translation_is_whispers_transcription_with_translate_set(
        gw_audio: Gateway) -> None:
    """whisper-server has one inference path: /v1/audio/translations reaches it as a
    transcription whose form says translate=true (first, so it cannot be overridden)."""
    form = aiohttp.FormData()
    form.add_field("model", "b")
    form.add_field("translate", "false")
    form.add_field("file", b"RIFF....", filename="a.wav", content_type="audio/wav")
    resp = await gw_audio.client.post("/v1/audio/translations?x=1", data=form)
    assert resp.status == 200 and (await resp.json())["text"] == "hello from b"
    (seen,) = gw_audio.fakes["b"].requests
    assert seen.path == "/v1/audio/transcriptions?x=1"
    fields = re.findall(rb'name="(\w+)"(?:; filename="[^"]*")?\r\n(?:[^\r\n]+\r\n)*\r\n'
                        rb'([^\r]*)\r\n', seen.body)
    assert fields[:2] == [(b"translate", b"true"), (b"model", b"b")]
    assert (b"file", b"RIFF....") in fields
    (row,) = await gw_audio.records(1)
    assert row["endpoint"] == "/v1/audio/translations" and row["model"] == "b"
    resp = await gw_audio.client.post("/v1/audio/translations", json={"model": "b"})
    assert resp.status == 415 and "multipart" in (await resp.json())["error"]["message"]
    resp = await gw_audio.client.post("/v1/audio/translations", data=_form("a"))
    assert resp.status == 400 and "chat model" in (await resp.json())["error"]["message"]


def _form(model: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("model", model)
    form.add_field("file", b"RIFF....", filename="a.wav", content_type="audio/wav")
    return form


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def test_metrics_after_known_traffic(tmp_path: Path) -> None:
    """/admin/metrics after known traffic: requests and tokens per model, a start (with its
    load time), an eviction, a 429, engine states and queues; ?engines=1 adds each
    engine's own metrics with a model label."""
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2,
                             models_config={"a": {"max_concurrency": 1}}):
        for _ in range(3):
            assert (await gw.client.post("/v1/chat/completions", json=chat("a"))).status == 200
        held = await gw.client.post("/v1/chat/completions",
                                    json=chat("a", prompt="slow 200", stream=True))
        assert (await gw.client.post("/v1/chat/completions", json=chat("a"))).status == 429
        await held.read()
        assert (await gw.client.post("/v1/chat/completions", json=chat("b"))).status == 200
        # c is stopped and both places are taken: starting it evicts the idle one (a)
        assert (await gw.client.post("/v1/completions", json={
            "model": "c", "prompt": "x", "max_tokens": 2})).status == 200
        assert (await gw.client.post("/v1/chat/completions", json=chat("nope"))).status == 404
        await gw.records(7)
        resp = await gw.client.get("/admin/metrics")
        assert resp.status == 200 and resp.content_type == "text/plain"
        m = _samples(await resp.text())
        req = "llm_gateway_requests_total"
        assert _value(m, req, model="a", endpoint="/v1/chat/completions", status="200") == 4
        assert _value(m, req, model="a", endpoint="/v1/chat/completions", status="429") == 1
        assert _value(m, req, model="c", endpoint="/v1/completions", status="200") == 1
        assert _value(m, req, model="", endpoint="/v1/chat/completions", status="404") == 1
        assert _value(m, "llm_gateway_rejected_total", model="a",
                      reason="concurrency_limit") == 1
        # the fake engine's usage: completion = max_tokens, prompt = words + 10
        assert _value(m, "llm_gateway_tokens_total", model="a", kind="completion") == 16
        assert _value(m, "llm_gateway_tokens_total", model="c", kind="completion") == 2
        assert _value(m, "llm_gateway_tokens_total", model="c", kind="prompt") == 11
        assert _value(m, "llm_gateway_engine_starts_total", model="c", result="ok") == 1
        assert _value(m, "llm_gateway_engine_load_seconds_count", model="c") == 1
        assert _value(m, "llm_gateway_evictions_total", reason="evicted") == 1
        assert _value(m, "llm_gateway_request_duration_seconds_count", model="a",
                      endpoint="/v1/chat/completions") == 5
        assert _value(m, "llm_gateway_time_to_first_token_seconds_count", model="a") == 1
        assert _value(m, "llm_gateway_engine_state", model="c", state="ready") == 1
        assert _value(m, "llm_gateway_engine_state", model="c", state="stopped") == 0
        assert _value(m, "llm_gateway_engine_state", model="b", state="ready") == 1
        assert _value(m, "llm_gateway_engine_state", model="a", state="ready") is None  # gone
        assert _value(m, "llm_gateway_queue_depth", model="b") == 0
        assert _value(m, "llm_gateway_records_dropped_total") == 0
        assert _value(m, "llm_gateway_max_engines") == 2
        resp = await gw.client.get("/admin/metrics", params={"engines": "1"})
        m = _samples(await resp.text())
        assert _value(m, "llamacpp_requests_processing", fake="b", model="b") == 0
        assert _value(m, "llamacpp_requests_processing", fake="c", model="c") == 0


async def test_metrics_endpoint_label_is_bounded(gw: Gateway) -> None:
    """Paths a client invents are refused by the route table before any handler: no
    series of theirs, so the series cannot grow without end."""
    for i in range(5):
        resp = await gw.client.post(f"/made-up-{i}?model=a", json={})
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    assert (await gw.client.post("/v1/chat/completions", json=chat("a"))).status == 200
    await gw.records(1)
    m = _samples(await (await gw.client.get("/admin/metrics")).text())
    endpoints = {dict(labels).get("endpoint") for name, labels in m
                 if name == "llm_gateway_requests_total"}
    assert endpoints == {"/v1/chat/completions"}
    assert gw.fakes["a"].requests[-1].path == "/v1/chat/completions"   # none of the others


async def test_the_collector_is_back_on_once_the_gateway_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`llm-gateway serve` starts with the garbage collector off (tests/unit/test_cli.py):
    once serving, it is on again, with the start's objects frozen out of its way."""
    import gc

    import gatewayd.app
    monkeypatch.setattr(gatewayd.app, "COLLECTOR_SETTLE_S", 0.05)
    gc.disable()
    try:
        async for gw in _gateway(tmp_path, ("a",)):
            deadline = time.monotonic() + 5
            while not gc.isenabled():
                assert time.monotonic() < deadline, "the collector stayed off"
                await asyncio.sleep(0.01)
            assert gc.get_freeze_count() > 0
            resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
            assert resp.status == 200
    finally:
        gc.unfreeze()
        gc.enable()


async def test_a_client_may_lower_its_priority_but_not_name_a_class_that_is_none(
        tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        ok = await gw.client.post("/v1/chat/completions", json=chat("a"),
                                  headers={"LLM-Gateway-Priority": "low"})
        assert ok.status == 200, await ok.text()
        bad = await gw.client.post("/v1/chat/completions", json=chat("a"),
                                   headers={"LLM-Gateway-Priority": "urgent"})
        assert bad.status == 400
        error = (await bad.json())["error"]
        assert error["param"] == "LLM-Gateway-Priority" and "low, normal, high" in \
            error["message"]
        assert gw.fakes["a"].requests[-1].headers.get("LLM-Gateway-Priority") is None
        status = await (await gw.client.get("/admin/status")).json()
        assert status["schedule"] == {"order": "grouped", "max_wait_s": 20.0,
                                      "priority_aging_s": 120.0, "line": []}
