"""A remote upstream failing in the ways a network fails, end to end: the real gateway (a
service of the container's systemd, its [upstreams] table read from its configuration)
in front of a peer this test runs (tests/fake_upstream.py, in a thread) or a port that
never answers. Each fault gets the one answer docs/design.md ("Remote upstreams")
promises, within the configured timeout, and is recorded.

(test_upstreams_e2e.py has a real second gateway as the peer, and a peer that is gone:
connection refused. tests/http/test_upstreams.py has the same faults in-process.)"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.fake_upstream import Blackhole, FakeUpstream, in_thread
from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import GatewayService, toml_str
from tests.integration.test_front_door_e2e import records

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

TIMEOUT_S = 1.0     # the upstream's connect_timeout_s and read_timeout_s
SLACK_S = 2.5       # what a loaded test box may add to a timeout


@pytest.fixture
def fake() -> Iterator[FakeUpstream]:
    fake = FakeUpstream("far")
    with in_thread(fake):
        yield fake


def gateway_to(gateway_factory: GatewayFactory, fake: FakeUpstream) -> GatewayService:
    """A gateway whose model far-model is served by fake (probed now, then not for a
    minute: only requests find it failing); up once its probe answered."""
    gw = gateway_factory(extra=f"""
[upstreams.far]
url = {toml_str(fake.url)}
models = ["far-model"]
connect_timeout_s = {TIMEOUT_S}
read_timeout_s = {TIMEOUT_S}
health_interval_s = 60
""")
    deadline = time.monotonic() + 20
    while state(gw) != "remote":
        assert time.monotonic() < deadline, f"far-model never up: {state(gw)}"
        time.sleep(0.05)
    return gw


def state(gw: GatewayService) -> str:
    rows = {m["id"]: m for m in gw.api("GET", "/v1/models")[1]["data"]}
    return str(rows["far-model"]["state"])


def chat(gw: GatewayService, **extra: Any) -> tuple[int, http.client.HTTPMessage, bytes, float]:
    """POST a chat for far-model: (status, headers, whole body, seconds it took)."""
    # (a gateway that waits forever fails here, in seconds, not at the test's timeout)
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=TIMEOUT_S + 15)
    body = {"model": "far-model", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}], **extra}
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, resp.headers, data, time.monotonic() - t0
    finally:
        conn.close()


def error_of(data: bytes) -> dict[str, Any]:
    """The OpenAI envelope's error member (and nothing that looks like a traceback)."""
    assert b"Traceback" not in data, data
    error = json.loads(data)["error"]
    assert {"message", "type", "code"} <= error.keys() and error["message"], error
    return dict(error)


def sse_events(data: bytes) -> list[Any]:
    blocks = [b for b in data.replace(b"\r\n", b"\n").split(b"\n\n") if b.strip()]
    return [b[6:].decode() if b == b"data: [DONE]" else json.loads(b[6:]) for b in blocks]


def test_a_host_that_never_takes_the_connection_is_a_504_in_connect_timeout_s(
        gateway_factory: GatewayFactory, fake: FakeUpstream) -> None:
    """Its port listens with a full backlog and never accepts (the kernel drops the
    SYNs): 504 upstream_timeout after connect_timeout_s, not the kernel's two minutes of
    SYN retries; the upstream is down from then on and refused at once."""
    gw = gateway_to(gateway_factory, fake)
    port = fake.port
    fake.call(fake.stop())      # its port free for the blackhole
    with Blackhole(port, accept=False):
        status, _, data, took = chat(gw)
        error = error_of(data)
        assert status == 504 and error["code"] == "upstream_timeout", (status, error)
        assert error["type"] == "server_error" and "'far'" in error["message"]
        assert TIMEOUT_S * 0.9 < took < TIMEOUT_S + SLACK_S, took
        status, headers, data, took = chat(gw)
        assert status == 503 and error_of(data)["code"] == "upstream_unreachable"
        assert took < 0.5 and int(headers["Retry-After"]) >= 1
        assert f"127.0.0.1:{port}" in error_of(data)["message"]
    rows = sorted(records(gw, 2), key=lambda r: -r["status"])
    assert [(r["status"], r["error_code"], r["upstream"]) for r in rows] == [
        (504, "upstream_timeout", "far"), (503, "upstream_unreachable", "far")]


def test_a_host_that_takes_the_connection_and_never_answers_is_a_504_in_read_timeout_s(
        gateway_factory: GatewayFactory, fake: FakeUpstream) -> None:
    gw = gateway_to(gateway_factory, fake)
    fake.call(fake.stop())
    with Blackhole(fake.port, accept=True):
        status, _, data, took = chat(gw)
        error = error_of(data)
        assert status == 504 and error["code"] == "upstream_timeout", (status, error)
        assert "'far'" in error["message"]
        assert TIMEOUT_S * 0.9 < took < TIMEOUT_S + SLACK_S, took
        # it took the connection: a slow answer says nothing about the link
        assert state(gw) == "remote"
    (row,) = records(gw, 1)
    assert (row["status"], row["error_code"], row["upstream"]) == (504, "upstream_timeout",
                                                                    "far")


def test_a_stream_that_stalls_ends_with_an_error_event_in_read_timeout_s(
        gateway_factory: GatewayFactory, fake: FakeUpstream) -> None:
    """Two tokens, then silence with the connection open: the stream (its 200 long sent)
    ends with an upstream_failed error event once read_timeout_s passes without a byte."""
    gw = gateway_to(gateway_factory, fake)
    fake.stall_after = 2
    status, headers, data, took = chat(gw, stream=True, max_tokens=6)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    got = sse_events(data)
    assert [e["choices"][0]["delta"]["content"] for e in got[:-1]] == ["", " w0", " w1"]
    assert got[-1]["error"]["code"] == "upstream_failed", got[-1]
    assert "'far' stopped in the middle" in got[-1]["error"]["message"]
    assert fake.stalled == 1 and TIMEOUT_S * 0.9 < took < TIMEOUT_S + SLACK_S, took
    (row,) = records(gw, 1)
    assert (row["status"], row["stream"], row["outcome"], row["upstream"]) == (
        200, 1, "upstream_failed", "far"), row
    assert state(gw) == "remote"


def test_events_framed_with_crlf_reach_the_sdk_one_by_one_and_usage_stays_hidden(
        gateway_factory: GatewayFactory, fake: FakeUpstream) -> None:
    """The peer ends every line with CRLF (events "\\r\\n\\r\\n"), a token each 0.3 s: the
    openai SDK gets each token as it is made, the same tokens, and no usage chunk it did
    not ask for; the record has the usage the gateway asked for on its behalf."""
    gw = gateway_to(gateway_factory, fake)
    fake.line_end, fake.token_delay_s = b"\r\n", 0.3
    sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    t0 = time.monotonic()
    seen: list[tuple[float, Any]] = [(time.monotonic() - t0, chunk) for chunk in
                                     sdk.chat.completions.create(
                                         model="far-model", max_tokens=4, stream=True,
                                         messages=[{"role": "user", "content": "hi"}])]
    contents = [c.choices[0].delta.content for _, c in seen if c.choices]
    assert contents == ["", " w0", " w1", " w2", " w3", None], contents
    assert all(c.usage is None for _, c in seen)
    first_token = next(t for t, c in seen if c.choices and c.choices[0].delta.content)
    assert seen[-1][0] - first_token > 0.6, [t for t, _ in seen]   # not held to the end
    (row,) = records(gw, 1)
    assert (row["outcome"], row["prompt_tokens"], row["completion_tokens"]) == ("ok", 11, 4)
    fake.token_delay_s = 0
    asked = list(sdk.chat.completions.create(
        model="far-model", max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}]))
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 4


def test_a_429_with_retry_after_reaches_the_caller_as_the_peer_said_it(
        gateway_factory: GatewayFactory, fake: FakeUpstream) -> None:
    """The design relays an upstream's answer of any status, its Retry-After among the
    headers that cross, and keeps the upstream up (it answered)."""
    gw = gateway_to(gateway_factory, fake)
    fake.status, fake.retry_after = 429, "7"
    status, headers, data, took = chat(gw)
    assert status == 429 and headers["Retry-After"] == "7", (status, dict(headers))
    assert error_of(data) == {"message": "upstream says 429", "type": "server_error",
                              "code": "boom"}
    assert took < SLACK_S
    with pytest.raises(openai.RateLimitError) as e:
        openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0).chat \
            .completions.create(model="far-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.response.headers["Retry-After"] == "7"
    assert state(gw) == "remote"
    rows = records(gw, 2)
    assert {(r["status"], r["error_code"], r["upstream"]) for r in rows} == {
        (429, "boom", "far")}

