"""Remote upstreams over real HTTP: fake engines for the local models, fake upstreams on
TCP (and TLS) for the remote ones. Routing, spill-over, discovery, the upstream's key,
and every way an upstream fails: down, slow, 500, 429, a stream broken off or stalled,
full, a host that never takes the connection; and events framed with CRLF."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.core.auth import digest, parse_keys
from gatewayd.core.upstreams import UpstreamConfig
from gatewayd.http import openai_api
from tests.fake_engine import speech_pieces
from tests.fake_upstream import Blackhole, FakeUpstream
from tests.http.test_front_door import Gateway, _gateway, chat, events

KEY = "upstream-secret"


def upstream(fake: FakeUpstream, **kw: Any) -> UpstreamConfig:
    kw.setdefault("health_interval_s", 0.2)
    kw.setdefault("connect_timeout_s", 2.0)
    return UpstreamConfig(name=fake.name, url=fake.url, **kw)


async def until(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := await check()):
        assert time.monotonic() < deadline, "condition never met"
        await asyncio.sleep(0.02)
    return result


@pytest.fixture
async def box() -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream("box", models=["big", "shared"], key=KEY)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def gw(tmp_path: Path, box: FakeUpstream) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("a",), upstreams=(
            upstream(box, models=("big", "Shared-Name"), api_key=KEY),)):
        yield g


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, start: tuple[str, ...], **config: Any
                  ) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, start, **config):
        yield g


async def model_rows(gw: Gateway) -> dict[str, dict[str, Any]]:
    body = await (await gw.client.get("/v1/models")).json()
    return {m["id"]: m for m in body["data"]}


async def test_a_remote_model_is_listed_routed_with_its_key_and_recorded(
        gw: Gateway, box: FakeUpstream) -> None:
    rows = await model_rows(gw)
    assert rows["big"]["state"] == "remote" and rows["big"]["upstream"] == "box"
    assert rows["a"]["state"] == "ready"
    resp = await gw.client.post("/v1/chat/completions", json=chat("BIG"), headers={
        "Authorization": "Bearer client-own-key", "x-api-key": "client-own-key"})
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Request-Id"] == "box"
    (seen,) = box.requests
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["Authorization"] == f"Bearer {KEY}"     # ours, never the client's
    assert "X-Api-Key" not in seen.headers and "Accept-Encoding" not in seen.headers
    assert b'"model": "big"' in seen.body    # the name the upstream knows it by
    (row,) = await gw.records(1)
    assert (row["model"], row["upstream"], row["engine"]) == ("BIG", "box", None)
    assert row["status"] == 200 and row["completion_tokens"] == 4
    # streamed: events pass through; usage asked for the record and hidden again
    resp = await gw.client.post("/v1/chat/completions", json=chat("big", stream=True))
    got = events(await resp.read())
    assert got[-1] == "[DONE]" and all("usage" not in e or e["usage"] is None
                                       for e in got[:-1])
    rows_ = await gw.records(2)
    streamed = next(r for r in rows_ if r["stream"])
    assert streamed["upstream"] == "box" and streamed["completion_tokens"] == 4
    # a local model is still served by its engine
    resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
    assert resp.headers["X-Request-Id"] == "a"


async def test_remote_models_only_on_v1_paths_and_behind_api_keys(
        tmp_path: Path, box: FakeUpstream) -> None:
    ring = parse_keys({"keys": {"only-a": {"sha256": digest("k-a"), "models": ["a"]},
                                "all": {"sha256": digest("k-all")}}}, "test")
    async with gateway(tmp_path, ("a",), api_keys=ring, upstreams=(
            upstream(box, models=("big",), api_key=KEY),)) as gw:
        only_a = {"Authorization": "Bearer k-a"}
        resp = await gw.client.post("/v1/chat/completions", json=chat("big"), headers=only_a)
        assert resp.status == 403
        assert (await resp.json())["error"]["code"] == "model_not_allowed"
        listed = await (await gw.client.get("/v1/models", headers=only_a)).json()
        assert [m["id"] for m in listed["data"]] == ["a"]
        every = {"Authorization": "Bearer k-all"}
        resp = await gw.client.get("/v1/models/big", headers=every)
        assert (await resp.json())["upstream"] == "box"
        resp = await gw.client.get("/props?model=big", headers=every)
        assert resp.status == 400 and "only on the OpenAI paths" in (await resp.json())[
            "error"]["message"]
        resp = await gw.client.post("/v1/chat/completions", json=chat("nope"), headers=every)
        assert "big" in (await resp.json())["available_models"]
        assert box.requests == []


async def test_models_are_discovered_and_refreshed(tmp_path: Path) -> None:
    fake = FakeUpstream("found", models=["d1"])
    await fake.start()
    try:
        async with gateway(tmp_path, (), upstreams=(upstream(fake),)) as gw:
            await until(lambda: _listed(gw, "d1"))
            fake.models = ["d2", "d3"]
            await until(lambda: _listed(gw, "d3"))
            assert "d1" not in await model_rows(gw)
            resp = await gw.client.post("/v1/chat/completions", json=chat("d2"))
            assert resp.status == 200 and resp.headers["X-Request-Id"] == "found"
    finally:
        await fake.stop()


async def _listed(gw: Gateway, model: str) -> bool:
    return model in await model_rows(gw)


async def test_spill_over_only_when_the_local_model_cannot_take_it(
        tmp_path: Path, box: FakeUpstream) -> None:
    async with gateway(tmp_path, ("a",), models_config={
            "a": {"spill_over": True, "max_concurrency": 1},
            "b": {"spill_over": True}},
            upstreams=(upstream(box, models=("a", "b"), api_key=KEY),)) as gw:
        # the local engine, ready and free, is preferred
        resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
        assert resp.headers["X-Request-Id"] == "a"
        # its one turn taken by a slow stream: the next request goes to the upstream
        slow = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat(
            "a", prompt="slow 100", stream=True, max_tokens=10)))
        await until(lambda: _in_flight(gw))
        resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "box"
        assert (await (await slow).read()).endswith(b"[DONE]\n\n")
        # not loaded, and not to be loaded (autoload=false): the upstream answers
        resp = await gw.client.post("/v1/chat/completions?autoload=false", json=chat("b"))
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "box"
        rows = await gw.records(4)
        assert sorted((r["model"], r["upstream"] or r["engine"]) for r in rows) == [
            ("a", "box"), ("a", "llm-engine-a.service"), ("a", "llm-engine-a.service"),
            ("b", "box")]
        listed = await model_rows(gw)
        assert listed["a"]["spill_over"] == ["box"] and "upstream" not in listed["a"]
    # without spill_over a full model says so itself (tested in test_front_door)


async def _in_flight(gw: Gateway) -> bool:
    front = gw.client.app[openai_api.FRONT]
    return front.dispatcher.has_requests("a")


async def test_an_upstream_down_is_a_fast_clear_answer_and_comes_back(
        tmp_path: Path) -> None:
    fake = FakeUpstream("gone", models=["far"])
    await fake.start()
    # probed once at start, then not for 30 s: only requests can find it gone
    async with gateway(tmp_path, (), upstreams=(
            upstream(fake, models=("far",), health_interval_s=30),)) as gw:
        await until(lambda: _state_is(gw, "far", "remote"))
        await fake.stop()          # its port refuses connections
        t0 = time.monotonic()
        resp = await gw.client.post("/v1/chat/completions", json=chat("far"))
        body = await resp.json()
        assert time.monotonic() - t0 < 2.0
        assert resp.status == 502 and body["error"]["code"] == "upstream_unavailable", body
        assert "upstream 'gone' did not take the request" in body["error"]["message"]
        # now known down: refused at once, naming it, until a probe (in 1 s) finds it back
        resp = await gw.client.post("/v1/chat/completions", json=chat("far"))
        body = await resp.json()
        assert resp.status == 503 and body["error"]["code"] == "upstream_unreachable"
        assert f"127.0.0.1:{fake.port}" in body["error"]["message"]   # why, never the URL
        assert int(resp.headers["Retry-After"]) >= 1
        assert (await model_rows(gw))["far"]["state"] == "unreachable"
        status = await (await gw.client.get("/admin/status")).json()
        (state,) = status["upstreams"]
        assert state["state"] == "down" and state["failures"] == 1
        await fake.start()     # back on the same port: the probe finds it
        await until(lambda: _state_is(gw, "far", "remote"))
        resp = await gw.client.post("/v1/chat/completions", json=chat("far"))
        assert resp.status == 200
        rows = await gw.records(3)
        assert sorted(r["error_code"] or "" for r in rows) == [
            "", "upstream_unavailable", "upstream_unreachable"]
        assert all(r["upstream"] == "gone" for r in rows)
        figures = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(
                       await (await gw.client.get("/admin/metrics")).text())
                   for s in f.samples}
        assert figures[("llm_gateway_upstream_up", (("upstream", "gone"),))] == 1.0
        for status in ("200", "502", "503"):
            assert figures[("llm_gateway_upstream_requests_total",
                            (("status", status), ("upstream", "gone")))] == 1.0
    await fake.stop()


async def _state_is(gw: Gateway, model: str, state: str) -> bool:
    return bool((await model_rows(gw))[model]["state"] == state)


async def test_a_500_is_relayed_a_slow_one_times_out_a_broken_stream_ends_in_an_event(
        tmp_path: Path, box: FakeUpstream) -> None:
    async with gateway(tmp_path, (), upstreams=(
            upstream(box, models=("big",), api_key=KEY, read_timeout_s=0.5),)) as gw:
        box.status = 500
        resp = await gw.client.post("/v1/chat/completions", json=chat("big"))
        assert resp.status == 500 and (await resp.json())["error"]["code"] == "boom"
        box.status = None
        box.delay_s = 1.5
        resp = await gw.client.post("/v1/chat/completions", json=chat("big"))
        body = await resp.json()
        assert resp.status == 504 and body["error"]["code"] == "upstream_timeout", body
        assert "'box'" in body["error"]["message"]
        box.delay_s = 0
        resp = await gw.client.post("/v1/chat/completions", json=chat(
            "big", prompt="die after 2", stream=True))
        assert resp.status == 200
        got = events(await resp.read())
        assert got[-1]["error"]["code"] == "upstream_failed"
        assert "'box' stopped in the middle" in got[-1]["error"]["message"]
        rows = {r["error_code"]: r for r in await gw.records(3)}
        assert rows["boom"]["status"] == 500 and rows["boom"]["upstream"] == "box"
        assert rows["upstream_timeout"]["status"] == 504
        assert rows["upstream_failed"]["outcome"] == "upstream_failed"
        # none of this marked it down: it answered (the stream broke, not the link)
        assert (await model_rows(gw))["big"]["state"] == "remote"


async def test_max_concurrency_tries_the_next_upstream_then_says_429(
        tmp_path: Path, box: FakeUpstream) -> None:
    spare = FakeUpstream("spare", models=["big"])
    await spare.start()
    try:
        async with gateway(tmp_path, (), upstreams=(
                upstream(box, models=("big",), api_key=KEY, max_concurrency=1),
                upstream(spare, models=("big",), max_concurrency=1))) as gw:
            first = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat(
                "big", prompt="slow 100", stream=True, max_tokens=8)))
            await until(lambda: _remote_busy(gw, "box"))
            second = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat(
                "big", prompt="slow 100", stream=True, max_tokens=8)))
            await until(lambda: _remote_busy(gw, "spare"))
            resp = await gw.client.post("/v1/chat/completions", json=chat("big"))
            body = await resp.json()
            assert resp.status == 429 and body["error"]["code"] == "concurrency_limit"
            assert "'box' (1)" in body["error"]["message"]
            for task in (first, second):
                assert (await (await task).read()).endswith(b"[DONE]\n\n")
            assert [r.path for r in spare.requests] == ["/v1/chat/completions"]
    finally:
        await spare.stop()


async def _remote_busy(gw: Gateway, name: str) -> bool:
    status = await (await gw.client.get("/admin/status")).json()
    return any(u["name"] == name and u["in_flight"] == 1 for u in status["upstreams"])


async def test_tls_is_verified_unless_told_otherwise(tmp_path: Path) -> None:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    fake = FakeUpstream("secure", models=["tls-model"], tls=server)
    await fake.start()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    try:
        async with gateway(tmp_path, (), upstreams=(
                upstream(fake, models=("tls-model",)),)) as gw:
            resp = await gw.client.post("/v1/chat/completions", json=chat("tls-model"))
            body = await resp.json()
            assert resp.status in (502, 503) and "certificate" in body["error"]["message"]
            assert fake.requests == []
        for trusted in ({"ca_file": ca_file}, {"tls_verify": False}):
            async with gateway(tmp_path, (), upstreams=(
                    upstream(fake, models=("tls-model",), **trusted),)) as gw:
                resp = await gw.client.post("/v1/chat/completions", json=chat("tls-model"))
                assert resp.status == 200, (trusted, await resp.text())
    finally:
        await fake.stop()


async def test_a_wrong_upstream_key_shows_in_status(tmp_path: Path, box: FakeUpstream) -> None:
    async with gateway(tmp_path, (), upstreams=(
            upstream(box, models=("big",), api_key="wrong"),)) as gw:
        async def down() -> Any:
            status = await (await gw.client.get("/admin/status")).json()
            return status["upstreams"][0]["state"] == "down" and status["upstreams"][0]
        state = await until(down)
        assert "HTTP 401" in state["last_error"] and "API key" in state["last_error"]


async def test_a_reload_keeps_unchanged_upstreams_and_swaps_the_rest(
        tmp_path: Path, box: FakeUpstream) -> None:
    other = FakeUpstream("other", models=["o1"])
    await other.start()
    try:
        async with gateway(tmp_path, (), upstreams=(
                upstream(box, models=("big",), api_key=KEY),)) as gw:
            remotes = gw.client.app[openai_api.FRONT].remotes
            (kept,) = remotes.remotes()
            slow = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat(
                "big", prompt="slow 50", stream=True, max_tokens=6)))
            await until(lambda: _remote_busy(gw, "box"))
            await remotes.reconfigure((upstream(box, models=("big",), api_key=KEY),
                                       upstream(other, models=("o1",))))
            assert remotes.remotes()[0] is kept         # same settings: same session
            assert (await model_rows(gw))["o1"]["upstream"] == "other"
            await remotes.reconfigure((upstream(other, models=("o1",)),))
            assert kept.retired and kept.session is not None and not kept.session.closed
            assert (await (await slow).read()).endswith(b"[DONE]\n\n")  # not cut off
            await until(lambda: _closed(kept))
            resp = await gw.client.post("/v1/chat/completions", json=chat("big"))
            assert resp.status == 404
    finally:
        await other.stop()


async def _closed(remote: Any) -> bool:
    return bool(remote.session.closed)


async def test_a_host_that_never_takes_the_connection_is_a_504_in_connect_timeout_s(
        tmp_path: Path) -> None:
    """Up at first; then its port listens with a full backlog and never accepts (the
    kernel drops the SYNs): the request waits connect_timeout_s, not read_timeout_s or
    the kernel's two minutes of SYN retries, and the upstream is down from then on."""
    fake = FakeUpstream("jammed", models=["far"])
    await fake.start()
    async with gateway(tmp_path, (), upstreams=(upstream(
            fake, models=("far",), connect_timeout_s=0.5, read_timeout_s=30,
            health_interval_s=30),)) as gw:
        await until(lambda: _state_is(gw, "far", "remote"))
        await fake.stop()
        with Blackhole(fake.port, accept=False):
            t0 = time.monotonic()
            async with asyncio.timeout(10):   # a gateway that waits on fails here, in 10 s
                resp = await gw.client.post("/v1/chat/completions", json=chat("far"))
            took = time.monotonic() - t0
            body = await resp.json()
            assert resp.status == 504 and body["error"]["code"] == "upstream_timeout", body
            assert body["error"]["type"] == "server_error" and "'jammed'" in body[
                "error"]["message"]
            assert 0.4 < took < 2.0, took
            # a connect that timed out marks it down: the next one is refused at once
            t0 = time.monotonic()
            resp = await gw.client.post("/v1/chat/completions", json=chat("far"))
            assert resp.status == 503 and time.monotonic() - t0 < 0.3
            assert (await resp.json())["error"]["code"] == "upstream_unreachable"
            (row, _) = sorted(await gw.records(2), key=lambda r: r["status"], reverse=True)
            assert (row["status"], row["error_code"], row["upstream"]) == (
                504, "upstream_timeout", "jammed")


async def test_a_stream_that_stalls_ends_with_an_error_event_in_read_timeout_s(
        tmp_path: Path, box: FakeUpstream) -> None:
    async with gateway(tmp_path, (), upstreams=(
            upstream(box, models=("big",), api_key=KEY, read_timeout_s=0.5),)) as gw:
        box.stall_after = 2
        t0 = time.monotonic()
        async with asyncio.timeout(10):
            resp = await gw.client.post("/v1/chat/completions", json=chat(
                "big", stream=True, max_tokens=6))
            assert resp.status == 200
            got = events(await resp.read())
        took = time.monotonic() - t0
        assert box.stalled == 1 and 0.4 < took < 2.0, took
        assert [e["choices"][0]["delta"].get("content") for e in got[:-1]] == ["", " w0",
                                                                               " w1"]
        assert got[-1]["error"]["code"] == "upstream_failed", got[-1]
        assert "'box' stopped in the middle" in got[-1]["error"]["message"]
        (row,) = await gw.records(1)
        assert (row["status"], row["outcome"], row["error_code"], row["stream"]) == (
            200, "upstream_failed", "upstream_failed", 1)
        # a stall says nothing about the link: still up
        assert (await model_rows(gw))["big"]["state"] == "remote"


async def test_events_framed_with_crlf_pass_one_by_one_and_usage_is_still_hidden(
        tmp_path: Path, box: FakeUpstream) -> None:
    """SSE lets a line end in CRLF (vLLM's and many proxies' framing is LF, not all):
    each event reaches the client as it comes, the same events; the usage the gateway
    asked for is recorded and not shown; usage the client asked for is shown."""
    box.line_end, box.token_delay_s = b"\r\n", 0.3
    async with gateway(tmp_path, (), upstreams=(
            upstream(box, models=("big",), api_key=KEY),)) as gw:
        t0 = time.monotonic()
        resp = await gw.client.post("/v1/chat/completions", json=chat(
            "big", stream=True, max_tokens=4))
        arrivals: list[float] = []
        raw = b""
        async for piece in resp.content.iter_any():
            raw += piece
            arrivals.append(time.monotonic() - t0)
        assert resp.status == 200
        # four tokens 0.3 s apart: the first is out long before the last is made
        assert arrivals[-1] - arrivals[0] > 0.6, arrivals
        got = events(raw.replace(b"\r\n", b"\n"))
        assert [e["choices"][0]["delta"].get("content") for e in got[:-2]] == [
            "", " w0", " w1", " w2", " w3"]
        assert got[-2]["choices"][0]["finish_reason"] == "length" and got[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and e.get("usage") for e in got)
        (row,) = await gw.records(1)
        assert (row["prompt_tokens"], row["completion_tokens"]) == (11, 4), row
        assert row["outcome"] == "ok" and row["status"] == 200
        box.token_delay_s = 0
        resp = await gw.client.post("/v1/chat/completions", json=chat(
            "big", stream=True, stream_options={"include_usage": True}))
        got = events((await resp.read()).replace(b"\r\n", b"\n"))
        assert got[-2]["usage"]["completion_tokens"] == 4 and got[-1] == "[DONE]"


async def test_a_429_with_retry_after_reaches_the_caller_as_it_was_said(
        tmp_path: Path, box: FakeUpstream) -> None:
    async with gateway(tmp_path, (), upstreams=(
            upstream(box, models=("big",), api_key=KEY),)) as gw:
        box.status, box.retry_after = 429, "7"
        for stream in (False, True):
            resp = await gw.client.post("/v1/chat/completions", json=chat(
                "big", stream=stream))
            body = await resp.json()
            assert resp.status == 429 and resp.headers["Retry-After"] == "7", body
            assert body["error"] == {"message": "upstream says 429", "type": "server_error",
                                     "code": "boom"}
        # an answer says nothing about the link: still up, nothing marked down
        assert (await model_rows(gw))["big"]["state"] == "remote"
        rows = await gw.records(2)
        assert {(r["status"], r["error_code"], r["upstream"]) for r in rows} == {
            (429, "boom", "box")}


async def test_remote_speech_is_passed_on_as_it_comes_and_a_break_is_the_upstreams(
        gw: Gateway, box: FakeUpstream) -> None:
    """A remote upstream's audio is relayed as a local engine's (proxy._relay_media)."""
    resp = await gw.client.post("/v1/audio/speech", json={"model": "big", "input": "far"})
    assert resp.status == 200 and resp.headers["Content-Type"] == "audio/mpeg"
    assert await resp.read() == b"".join(speech_pieces("far"))
    resp = await gw.client.post("/v1/audio/speech", json={"model": "big",
                                                          "input": "die after 1"})
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    rows = await gw.records(2)    # newest first
    assert [(r["upstream"], r["outcome"], r["bytes_out"]) for r in rows] == [
        ("box", "upstream_failed", len(speech_pieces("die after 1")[0])),
        ("box", "ok", sum(map(len, speech_pieces("far"))))]
