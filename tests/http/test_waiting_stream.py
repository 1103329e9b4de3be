"""A waiting stream hears why (http/waiting, core/progress): SSE comment lines while a
streamed request waits for its model's engine, only where the setting and the client say
so; the answer after them whole; a failure after them ended with its format's error event;
the official SDKs' stream readers skip the lines."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from gatewayd.core import progress
from gatewayd.core.engines import EngineState
from gatewayd.http.drain import cancel_open_requests
from gatewayd.http.openai_api import FRONT
from tests.http.test_front_door import Gateway, _gateway, chat, events, named_events

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])

TELL = {progress.HEADER: "1"}
LINE = re.compile(rb": waiting for 'c': [a-z0-9 ,'%()_:]+, \d+\.\d s")


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines every 0.1 s, the first after 0.05 s (seconds in the gateway itself)."""
    monkeypatch.setattr(progress, "FIRST_S", 0.05)
    monkeypatch.setattr(progress, "EVERY_S", 0.1)


async def loading(gw: Gateway, model: str = "c") -> None:
    """Until model's engine is loading (and held there: gw.health.all_ready is False)."""
    deadline = time.monotonic() + 5
    while not ((e := gw.engines.registry.get(model)) and e.state is EngineState.LOADING):
        assert time.monotonic() < deadline, e
        await asyncio.sleep(0.01)


def split(raw: bytes) -> tuple[list[bytes], bytes]:
    """(the comment blocks before the first event, the rest)."""
    blocks = raw.split(b"\n\n")
    lines = []
    while blocks and blocks[0].startswith(b":"):
        lines.append(blocks.pop(0))
    return lines, b"\n\n".join(blocks)


@pytest.mark.parametrize(("mode", "header", "told"), [
    ("opt-in", "1", True), ("opt-in", None, False), ("on", None, True), ("on", "0", False),
    ("off", "1", False)])
async def test_a_waiting_stream_is_told_why_where_asked_and_then_gets_its_answer_whole(
        tmp_path: Path, mode: str, header: str | None, told: bool) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2, stream_progress=mode):
        gw.health.all_ready = False      # c loads until the test lets it
        asked = asyncio.ensure_future(gw.client.post(
            "/v1/chat/completions", json=chat("c", stream=True),
            headers={} if header is None else {progress.HEADER: header}))
        await loading(gw)
        await asyncio.sleep(0.35)        # several lines' time
        assert asked.done() is told      # told: the first line sent the 200 and its head
        gw.health.all_ready = True
        resp = await asyncio.wait_for(asked, 5)
        raw = await resp.read()
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        lines, rest = split(raw)
        assert bool(lines) is told and b"\n:" not in rest, raw   # lines only before the answer
        assert all(LINE.fullmatch(line) for line in lines), lines
        if told:
            assert len(lines) >= 3 and any(b": loading, " in line for line in lines), lines
        got = events(rest)
        assert got[-1] == "[DONE]" and all("usage" not in e for e in got[:-1])
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in got[:-1]) \
            == " w0 w1 w2 w3"
        (row,) = await gw.records(1)
        assert (row["status"], row["outcome"], row["stream"], row["error_code"]) == (
            200, "ok", 1, None)
        assert row["bytes_out"] == len(raw) and row["completion_tokens"] == 4
        # the header is the gateway's own: never sent on to the engine
        assert progress.HEADER not in gw.fakes["c"].requests[-1].headers


async def test_the_lines_say_the_line_of_models_then_the_load(tmp_path: Path) -> None:
    """One place, a busy engine on it: the waiting model's lines say its turn (room), then
    the load once room is made."""
    async for gw in _gateway(tmp_path, ("a",), max_engines=1, max_wait_s=0.3):
        busy = asyncio.ensure_future(gw.client.post(
            "/v1/chat/completions", json=chat("a", prompt="slow 100", max_tokens=8,
                                              stream=True)))
        while not gw.fakes["a"].in_flight:
            await asyncio.sleep(0.01)
        resp = await gw.client.post("/v1/chat/completions", json=chat("b", stream=True),
                                    headers=TELL)
        raw = await asyncio.wait_for(resp.read(), 10)
        assert events(await (await busy).read())[-1] == "[DONE]"
        lines, rest = split(raw)
        said = [line.split(b": ")[2].rsplit(b",", 1)[0] for line in lines]
        assert said[0] == b"room" and events(rest)[-1] == "[DONE]", said


async def test_a_non_streamed_request_is_never_told(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2, stream_progress="on"):
        gw.health.all_ready = False
        asked = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat("c"),
                                                     headers=TELL))
        await loading(gw)
        await asyncio.sleep(0.3)
        assert not asked.done()
        gw.health.all_ready = True
        resp = await asyncio.wait_for(asked, 5)
        assert resp.status == 200 and resp.headers["Content-Type"].startswith(
            "application/json")
        assert (await resp.json())["choices"][0]["message"]["content"] == " w0 w1 w2 w3"
        # (its header is not even read: a value that would be refused on a stream)
        resp = await gw.client.post("/v1/chat/completions", json=chat("c"),
                                    headers={progress.HEADER: "maybe"})
        assert resp.status == 200


async def test_a_header_value_that_is_neither_yes_nor_no_is_a_400(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        resp = await gw.client.post("/v1/chat/completions", json=chat("a", stream=True),
                                    headers={progress.HEADER: "maybe"})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == progress.HEADER


@pytest.mark.parametrize(("path", "body", "name"), [
    ("/v1/chat/completions", chat(stream=True), None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True}, None),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": True}, "error"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                      "stream": True}, "error"),
], ids=["chat", "completions", "responses", "anthropic"])
async def test_a_load_that_fails_after_the_lines_ends_the_stream_with_its_error_event(
        tmp_path: Path, path: str, body: dict[str, Any], name: str | None) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2, load_timeout_s=0.5):
        gw.health.all_ready = False      # c never gets ready: its load times out
        resp = await gw.client.post(path, json={**body, "model": "c"}, headers=TELL)
        raw = await asyncio.wait_for(resp.read(), 10)
        assert resp.status == 200        # (the first line's)
        lines, rest = split(raw)
        assert lines and all(LINE.fullmatch(line) for line in lines), raw
        ((event, data),) = named_events(rest)
        assert event == name
        if path == "/v1/messages":       # Anthropic's error shape
            assert data["type"] == "error" and data["error"]["code"] == "engine_failed"
            assert data["error"]["type"] == "api_error"
        else:                            # OpenAI's envelope (the Responses API's event too)
            assert data["error"]["code"] == "engine_failed"
            assert "log_tail" not in str(data)   # the engine's log is the admin's
        (row,) = await gw.records(1)
        assert (row["status"], row["outcome"], row["error_code"], row["stream"]) == (
            200, "error", "engine_failed", 1)
        assert row["bytes_out"] == len(raw)


async def test_an_answer_that_is_no_stream_after_the_lines_is_told_as_the_error_event(
        tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2):
        gw.health.all_ready = False
        asked = asyncio.ensure_future(gw.client.post(
            "/v1/chat/completions", json=chat("c", prompt="huge 1", stream=True),
            headers=TELL))
        await loading(gw)
        await asyncio.sleep(0.2)
        gw.health.all_ready = True
        resp = await asyncio.wait_for(asked, 5)
        lines, rest = split(await resp.read())
        ((_, data),) = named_events(rest)
        assert lines and data["error"]["code"] == "engine_failed"
        assert "the engine answered 200 instead of a stream" in data["error"]["message"]


async def test_a_client_that_leaves_after_the_lines_leaves_the_queue(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2):
        gw.health.all_ready = False
        resp = await gw.client.post("/v1/chat/completions", json=chat("c", stream=True),
                                    headers=TELL)
        assert (await resp.content.readline()).startswith(b": waiting for 'c'")
        resp.close()
        (row,) = await gw.records(1)
        assert (row["status"], row["outcome"], row["disconnected"], row["stream"]) == (
            200, "disconnected", 1, 1)
        front = gw.client.app[FRONT]
        deadline = time.monotonic() + 5
        while front.dispatcher.has_requests("c"):   # no turn taken, nobody queued
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)


async def test_a_stream_told_of_its_wait_at_the_drain_deadline_ends_with_shutting_down(
        tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2):
        gw.health.all_ready = False
        resp = await gw.client.post("/v1/chat/completions", json=chat("c", stream=True),
                                    headers=TELL)
        assert (await resp.content.readline()).startswith(b": waiting for 'c'")
        cancel_open_requests(gw.client.app)
        rest = await asyncio.wait_for(resp.read(), 5)   # (the first line's end, the event)
        assert [e["error"]["code"] for e in events(rest.lstrip(b"\n"))] == ["shutting_down"]
        (row,) = await gw.records(1)
        assert (row["status"], row["outcome"], row["error_code"]) == (
            200, "error", "shutting_down")


def sdks(gw: Gateway) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    """The official clients, each sending the opt-in header with every request."""
    return (openai.AsyncOpenAI(base_url=str(gw.client.make_url("/v1")), api_key="unused",
                               max_retries=0, default_headers=TELL),
            anthropic.AsyncAnthropic(base_url=str(gw.client.make_url("/")), api_key="unused",
                                     max_retries=0, default_headers=TELL))


async def openai_chunks(gpt: openai.AsyncOpenAI) -> list[Any]:
    stream = await gpt.chat.completions.create(
        model="c", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
    return [chunk async for chunk in stream]


async def claude_text(claude: anthropic.AsyncAnthropic) -> tuple[str, Any]:
    async with claude.messages.stream(model="c", max_tokens=4,
                                      messages=[{"role": "user", "content": "hi"}]) as stream:
        return "".join([t async for t in stream.text_stream]), await stream.get_final_message()


async def _through_a_wait(gw: Gateway, asking: Awaitable[Any]) -> Any:
    """asking's result, c stopped first and its load held for several lines' time."""
    if gw.engines.registry.get("c") is not None:
        await gw.engines.lifecycle.stop("c")
    gw.health.all_ready = False
    task = asyncio.ensure_future(asking)
    await loading(gw)
    await asyncio.sleep(0.35)
    gw.health.all_ready = True
    return await asyncio.wait_for(task, 10)


async def test_the_official_sdks_stream_readers_skip_the_lines(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2):
        gpt, claude = sdks(gw)
        async with gpt, claude:
            chunks = await _through_a_wait(gw, openai_chunks(gpt))
            text, final = await _through_a_wait(gw, claude_text(claude))
            # the same, streamed at once (c ready): nothing to wait for, no lines
            at_once = await openai_chunks(gpt), await claude_text(claude)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == " w0 w1 w2 w3"
        assert [c.model_dump(exclude={"created"}) for c in chunks] == \
            [c.model_dump(exclude={"created"}) for c in at_once[0]]
        assert text == at_once[1][0] == " w0 w1 w2 w3"
        assert final.model_dump() == at_once[1][1].model_dump()
        rows = await gw.records(4)
        assert all((r["status"], r["outcome"]) == (200, "ok") for r in rows), rows
        # the lines did reach both readers: each waited answer is longer by at least three
        for path in ("/v1/chat/completions", "/v1/messages"):
            waited, quick = sorted((r for r in rows if r["endpoint"] == path),
                                   key=lambda r: -r["latency_ms"])
            assert waited["bytes_out"] - quick["bytes_out"] >= 3 * len(
                b": waiting for 'c': loading, 0.1 s\n\n") - 3, (waited, quick)


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_the_official_sdks_raise_on_a_failure_after_the_lines(tmp_path: Path,
                                                                   sdk: str) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2, load_timeout_s=0.5):
        gw.health.all_ready = False      # c's load times out, after several lines
        gpt, claude = sdks(gw)
        async with gpt, claude:
            if sdk == "openai":
                with pytest.raises(openai.APIError, match="'c'"):
                    await openai_chunks(gpt)
            else:
                with pytest.raises(anthropic.APIStatusError, match="'c'") as raised:
                    await claude_text(claude)
                assert raised.value.status_code == 200   # (said in the stream, not by a status)
        (row,) = await gw.records(1)
        assert (row["status"], row["outcome"], row["error_code"]) == (
            200, "error", "engine_failed")
        assert row["bytes_out"] > 100   # (the lines, then the event)
