"""Images and speech over real HTTP, relayed to fake openai-backend engines: image
answers are JSON (read whole), speech is audio passed on byte for byte as it arrives,
and an engine that breaks off mid-answer ends the client's answer unfinished."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gatewayd.core.config import Backend, ModelKind
from gatewayd.http.drain import cancel_open_requests
from tests.fake_engine import TINY_PNG, speech_pieces
from tests.http.test_front_door import Gateway, _gateway

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    """a: an image server; b: one server of chat, speech and transcription (openai
    backend); c: a llama chat model."""
    server = {"backend": Backend.OPENAI, "command": ("/usr/bin/server", "{socket}")}
    async for g in _gateway(tmp_path, ("a", "b", "c"), models_config={
            "a": {**server, "kind": ModelKind.IMAGE},
            "b": {**server, "kind": ModelKind.CHAT,
                  "also": (ModelKind.SPEECH, ModelKind.AUDIO)}}):
        yield g


def sdk(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(gw.client.make_url("/v1")), api_key="unused",
                              max_retries=0)


async def test_an_image_is_generated_through_the_sdk_and_raw(gw: Gateway) -> None:
    async with sdk(gw) as client:
        made = await client.images.generate(model="a", prompt="a red dot", n=2)
    assert made.data is not None and len(made.data) == 2 and made.created > 0
    assert base64.b64decode(made.data[0].b64_json or "") == TINY_PNG
    assert made.data[0].revised_prompt == "a red dot"
    resp = await gw.client.post("/v1/images/generations", json={"prompt": "x"})   # the one
    raw = await resp.read()
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "a"
    assert resp.headers["Content-Type"].startswith("application/json")
    assert base64.b64decode(json.loads(raw)["data"][0]["b64_json"]) == TINY_PNG
    rows = await gw.records(2)
    assert [(r["endpoint"], r["model"], r["status"], r["outcome"]) for r in rows] == [
        ("/v1/images/generations", "a", 200, "ok")] * 2
    assert rows[0]["bytes_out"] == len(raw) and rows[0]["stream"] == 0
    assert all(r["latency_ms"] > 0 for r in rows)


async def test_an_image_edit_is_a_multipart_upload_routed_by_its_model_field(
        gw: Gateway) -> None:
    picture = TINY_PNG + bytes(range(256)) * 20
    async with sdk(gw) as client:
        edited = await client.images.edit(model="a", image=("dot.png", picture, "image/png"),
                                          prompt="a hat on it")
    assert edited.model_extra is not None
    assert edited.model_extra["got"] == {"image": len(picture), "prompt": "a hat on it",
                                         "model": "a"}
    (seen,) = gw.fakes["a"].requests
    assert seen.path == "/v1/images/edits" and picture in seen.body   # as sent
    form = aiohttp.FormData()
    form.add_field("image", picture, filename="model.png", content_type="image/png")
    form.add_field("model", "a")      # after the file: found by its name, wherever it is
    resp = await gw.client.post("/v1/images/variations", data=form)
    assert resp.status == 200
    assert (await resp.json())["got"] == {"image": len(picture), "model": "a"}
    rows = await gw.records(2)
    assert {r["endpoint"] for r in rows} == {"/v1/images/edits", "/v1/images/variations"}
    assert all(r["model"] == "a" and r["request_text"] is None for r in rows)   # an upload


async def test_speech_through_the_sdk_is_the_engines_bytes_unchanged(gw: Gateway) -> None:
    gw.fakes["b"].speech_delay_s = 0.05
    async with sdk(gw) as client:
        async with client.audio.speech.with_streaming_response.create(
                model="b", voice="alloy", input="hello there") as answer:
            assert answer.headers["content-type"] == "audio/mpeg"
            audio = await answer.read()
        async with client.audio.speech.with_streaming_response.create(
                model="b", voice="alloy", input="in wav", response_format="wav") as answer:
            assert answer.headers["content-type"] == "audio/wav"
            assert await answer.read() == b"".join(speech_pieces("in wav"))
    assert audio == b"".join(speech_pieces("hello there"))
    row = (await gw.records(2))[-1]   # oldest last
    assert (row["endpoint"], row["model"], row["status"], row["outcome"]) == (
        "/v1/audio/speech", "b", 200, "ok")
    assert row["bytes_out"] == len(audio) and row["stream"] == 0 and row["error_code"] is None
    assert row["latency_ms"] >= 140     # the whole answer's time: 3 pauses of 50 ms
    assert row["response_text"] is None   # audio is never recorded


async def test_speech_reaches_the_client_before_the_engine_has_finished(
        gw: Gateway) -> None:
    """The engine holds its last piece until the test has the others: a relay that
    waited for the whole answer would give the client nothing meanwhile."""
    gate = gw.fakes["b"].speech_gate = asyncio.Event()
    pieces = speech_pieces("say it")
    try:
        resp = await asyncio.wait_for(gw.client.post("/v1/audio/speech", json={
            "model": "b", "input": "say it", "voice": "alloy"}), 5)
        assert resp.status == 200 and resp.headers["Content-Type"] == "audio/mpeg"
        assert resp.headers["Transfer-Encoding"] == "chunked"
        first = await asyncio.wait_for(resp.content.readexactly(sum(map(len, pieces[:-1]))),
                                       5)
    finally:
        gate.set()   # (a failure's too: the engine's answer ends, the gateway lets go)
    assert first == b"".join(pieces[:-1])
    assert first + await resp.read() == b"".join(pieces)
    (row,) = await gw.records(1)
    assert row["bytes_out"] == sum(map(len, pieces)) and row["outcome"] == "ok"


async def test_an_http_1_0_client_gets_speech_unframed_until_the_close(gw: Gateway) -> None:
    """No chunks in HTTP/1.0: the body ends with the connection, which is closed at its end
    even where the client asked to keep it alive (no length says where the body ends)."""
    body = json.dumps({"model": "b", "input": "old client", "voice": "alloy"}).encode()
    reader, writer = await asyncio.open_connection(gw.client.host, gw.client.port)
    writer.write(b"POST /v1/audio/speech HTTP/1.0\r\nContent-Type: application/json\r\n"
                 b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    answer = await asyncio.wait_for(reader.read(), 10)   # to the close
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"audio/mpeg" in head
    assert b"chunked" not in head.lower() and b"keep-alive" not in head.lower()
    assert payload == b"".join(speech_pieces("old client"))


async def test_a_speech_the_engine_breaks_off_ends_the_clients_answer_unfinished(
        gw: Gateway) -> None:
    """The status is sent: the client's connection is closed before the body's end (no
    last chunk), which its HTTP library reports; the record says the engine failed."""
    pieces = speech_pieces("die after 2")
    resp = await gw.client.post("/v1/audio/speech", json={"model": "b",
                                                          "input": "die after 2"})
    assert resp.status == 200
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for piece in resp.content.iter_any():
            got += piece
    assert got == b"".join(pieces[:2])
    async with sdk(gw) as client:
        with pytest.raises(Exception, match="incomplete chunked read"):   # httpx's words
            async with client.audio.speech.with_streaming_response.create(
                    model="b", voice="alloy", input="die after 1") as answer:
                await answer.read()
    rows = await gw.records(2)
    for row, sent in zip(rows, (1, 2), strict=True):   # newest first
        assert (row["status"], row["outcome"], row["error_code"]) == (
            200, "engine_failed", "engine_failed")
        assert row["bytes_out"] == sum(map(len, pieces[:sent])) and row["stream"] == 0
    resp = await gw.client.post("/v1/audio/speech", json={"model": "b", "input": "again"})
    assert await resp.read() == b"".join(speech_pieces("again"))   # b serves on


async def test_a_model_of_another_kind_is_refused_saying_what_it_would_take(
        gw: Gateway) -> None:
    refusals: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/audio/speech", {"model": "a", "input": "x"},
         "'a' is an image model (openai) and cannot answer /v1/audio/speech: that needs a "
         'speech server (backend = "openai", kind = "speech")'),
        ("/v1/images/generations", {"model": "c", "prompt": "x"},
         "'c' is a chat model (llama) and cannot answer /v1/images/generations: that needs "
         'an image server (backend = "openai", kind = "image")'),
        ("/v1/images/generations", {"model": "b", "prompt": "x"},
         "'b' is a chat/speech/audio model (openai)"),
        ("/tokenize", {"model": "b", "content": "x"},
         "'b' is an openai model and cannot answer /tokenize: that is llama-server's own "
         "path"),
    ]
    for path, body, words in refusals:
        resp = await gw.client.post(path, json=body)
        error = (await resp.json())["error"]
        assert resp.status == 400 and words in error["message"], (path, error)
        assert error["code"] == "invalid_request" and error["param"] == "model"
    resp = await gw.client.get("/props", params={"model": "a"})
    assert resp.status == 400 and "an openai model" in (await resp.json())["error"]["message"]
    async with sdk(gw) as client:
        with pytest.raises(openai.BadRequestError, match="needs a speech server"):
            await client.audio.speech.create(model="c", voice="alloy", input="x")
    assert all(f.requests == [] for f in gw.fakes.values())   # none reached an engine


async def test_an_openai_audio_server_gets_translations_as_sent_and_its_text_as_is(
        gw: Gateway) -> None:
    """The rewrite to whisper-server's one inference path, and the trim of its padding,
    are whisper's: an openai server has /v1/audio/translations of its own."""
    form = aiohttp.FormData()
    form.add_field("model", "b")
    form.add_field("file", b"RIFF....", filename="a.wav", content_type="audio/wav")
    resp = await gw.client.post("/v1/audio/translations", data=form)
    assert resp.status == 200 and (await resp.json())["text"] == " hello from b\n"
    (seen,) = gw.fakes["b"].requests
    assert seen.path == "/v1/audio/translations" and b'name="translate"' not in seen.body


async def test_a_speech_open_at_the_drain_deadline_ends_unfinished_and_says_why(
        gw: Gateway) -> None:
    """The drain deadline cancels the handler with its client there: what was sent stays
    sent, then the connection closes before the body's end; the record says shutting_down."""
    gate = gw.fakes["b"].speech_gate = asyncio.Event()
    pieces = speech_pieces("long talk")
    body = json.dumps({"model": "b", "input": "long talk"}).encode()
    reader, writer = await asyncio.open_connection(gw.client.host, gw.client.port)
    try:
        writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        raw = b""
        while not all(p in raw for p in pieces[:-1]):   # all but the held piece
            raw += await asyncio.wait_for(reader.read(65536), 10)
        cancel_open_requests(gw.client.app)
        raw += await asyncio.wait_for(reader.read(), 10)   # to the close
    finally:
        gate.set()
        writer.close()
    assert not raw.endswith(b"0\r\n\r\n") and pieces[-1] not in raw
    (row,) = await gw.records(1)
    assert (row["outcome"], row["error_code"]) == ("error", "shutting_down")
    assert row["bytes_out"] == sum(map(len, pieces[:-1])) and row["status"] == 200


async def test_a_client_that_leaves_mid_speech_is_recorded_and_lets_the_engine_go(
        gw: Gateway) -> None:
    gate = gw.fakes["b"].speech_gate = asyncio.Event()
    resp = await gw.client.post("/v1/audio/speech", json={"model": "b", "input": "bye"})
    await resp.content.readexactly(len(speech_pieces("bye")[0]))
    resp.close()                             # the client goes away
    (row,) = await gw.records(1, timeout=10)
    assert row["disconnected"] == 1 and row["outcome"] == "disconnected"
    gate.set()
    engine = gw.fakes["b"]                   # its connection was dropped: the engine's
    for _ in range(100):                     # last write finds nobody
        if engine.disconnects:
            break
        await asyncio.sleep(0.02)
    assert engine.disconnects == 1
