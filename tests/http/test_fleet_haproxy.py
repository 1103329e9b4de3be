"""HAProxy in front of two gateways, with the configuration the project ships
(packaging/haproxy/haproxy.cfg, only its addresses changed): each model's requests go to one
gateway; a gateway that says it is draining (/ready: 503) leaves the ring; a refused
connection and a 503 are answered by the other gateway, so the client sees none.

HAProxy is Debian's (scripts/setup installs it), run by this test as its own process and
ended by its PID. The gateways are the real app over fake engines; the same run over real
engines in several systemd containers is not built yet (docs/fleet.md says so)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from gatewayd.core.errors import ERROR_SOURCE_HEADER
from gatewayd.http.drain import drain_notice
from gatewayd.http.middleware import SHUTDOWN
from tests.haproxy import SHIPPED, free_port, haproxy_binary, running_haproxy
from tests.http.test_front_door import Gateway, _gateway, chat

DEADLINE_S = 15.0


def test_the_shipped_configuration_is_valid() -> None:
    checked = subprocess.run([haproxy_binary(), "-c", "-f", str(SHIPPED)], capture_output=True,
                             text=True, timeout=30, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


class Fleet:
    def __init__(self, gateways: list[Gateway], url: str) -> None:
        self.gateways = gateways
        self.url = url

    def served(self, model: str) -> list[int]:
        """How many chat requests each gateway's engine for model has seen."""
        return [sum(1 for r in g.fakes[model].requests
                    if r.path.partition("?")[0] == "/v1/chat/completions")
                for g in self.gateways]

    async def ask(self, session: aiohttp.ClientSession, model: str, query: str = "") -> int:
        async with session.post(f"{self.url}/v1/chat/completions{query}",
                                json=chat(model)) as resp:
            await resp.read()
            return resp.status


@pytest.fixture
async def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """Two gateways behind HAProxy; a parameter: HAProxy's `timeout http-request`, s."""
    async with AsyncExitStack() as stack:
        gateways: list[Gateway] = []
        for name in ("g1", "g2"):
            (tmp_path / name).mkdir()
            gateways.append(await stack.enter_async_context(_asynccontext(
                _gateway(tmp_path / name, ("a", "b", "c"), max_body_bytes=1 << 20))))
        front = free_port()
        ports = [g.client.server.port for g in gateways]
        stack.enter_context(running_haproxy(
            tmp_path, front, [p for p in ports if p is not None],
            getattr(request, "param", None)))
        url = f"http://127.0.0.1:{front}"
        deadline = time.monotonic() + DEADLINE_S
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(f"{url}/ready") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "haproxy never answered"
                await asyncio.sleep(0.05)
        yield Fleet(gateways, url)


def _asynccontext(gen: AsyncIterator[Gateway]) -> AbstractAsyncContextManager[Gateway]:
    """An async generator of one Gateway (test_front_door's) as a context manager."""

    @contextlib.asynccontextmanager
    async def one() -> AsyncIterator[Gateway]:
        async for g in gen:
            yield g
    return one()


async def test_each_model_lives_on_one_gateway(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        for model in ("a", "b", "c", "A"):
            for _ in range(6):
                assert await fleet.ask(session, model) == 200
    for model, asked in (("a", 12), ("b", 6), ("c", 6)):   # "A" is a's name: one place
        assert sorted(fleet.served(model)) == [0, asked], (model, fleet.served(model))


async def in_flight_at_once(fleet: Fleet, model: str, count: int) -> list[int]:
    """count requests for model in flight together (each ~1.5 s); how many more each
    gateway's engine saw."""
    before = fleet.served(model)
    async with aiohttp.ClientSession() as session:
        async def slow() -> int:
            body = {**chat(model, prompt="slow 100"), "stream": True, "max_tokens": 15}
            async with session.post(f"{fleet.url}/v1/chat/completions", json=body) as resp:
                await resp.read()
                return resp.status
        assert await asyncio.gather(*(slow() for _ in range(count))) == [200] * count
    return [n - b for n, b in zip(fleet.served(model), before, strict=True)]


async def test_a_model_with_a_few_requests_at_once_stays_on_its_gateway(fleet: Fleet) -> None:
    """Light load on one model is no reason to load it elsewhere: 4 at once all go to its
    gateway. (With the factor at 150, the second request while one ran went to the other
    gateway: in the two-container test that loaded a model on both hosts.)"""
    async with aiohttp.ClientSession() as session:
        assert await fleet.ask(session, "a") == 200
    home = fleet.served("a").index(1)
    for _ in range(2):
        hot = await in_flight_at_once(fleet, "a", 4)
        assert hot[home] == 4 and hot[1 - home] == 0, hot


async def test_a_hot_model_overflows_to_a_second_gateway_and_comes_home_after(
        fleet: Fleet) -> None:
    """hash-balance-factor 180: with 12 requests in flight for one model and none for any
    other, its gateway takes 11 and the next gateway on the ring the 12th (HAProxy's
    bounded load, wherever the ring puts the model); once the load is gone, the model is
    answered at home only."""
    async with aiohttp.ClientSession() as session:
        assert await fleet.ask(session, "a") == 200
        home = fleet.served("a").index(1)
        hot = await in_flight_at_once(fleet, "a", 12)
        assert hot[home] == 11 and hot[1 - home] == 1, hot
        after = fleet.served("a")
        for _ in range(6):
            assert await fleet.ask(session, "a") == 200
        assert fleet.served("a") == [after[0] + 6 * (home == 0), after[1] + 6 * (home == 1)]


async def test_a_draining_gateway_leaves_the_ring_and_loses_nothing(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        assert await fleet.ask(session, "a") == 200
        home = fleet.served("a").index(1)
        other = 1 - home
        fleet.gateways[home].client.app[SHUTDOWN].draining = True
        deadline = time.monotonic() + DEADLINE_S
        while fleet.served("a")[other] == 0:   # answered meanwhile, by either
            assert await fleet.ask(session, "a") == 200
            assert time.monotonic() < deadline, "the draining gateway stayed in the ring"
            await asyncio.sleep(0.1)
        before = fleet.served("a")[home]
        for _ in range(5):
            assert await fleet.ask(session, "a") == 200
        assert fleet.served("a")[home] == before


async def test_a_503_and_a_refused_connection_are_answered_by_the_other_gateway(
        fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        assert await fleet.ask(session, "b") == 200
        home = fleet.served("b").index(1)
        other = 1 - home
        # b's engine stopped at its home, no autoload: that gateway answers 503
        await fleet.gateways[home].engines.lifecycle.stop("b")
        assert await fleet.ask(session, "b", "?autoload=false") == 200
        assert fleet.served("b") == [1, 1]
        direct = fleet.gateways[home].client   # what HAProxy met there: a 503 that says so
        resp = await direct.post("/v1/chat/completions?autoload=false", json=chat("b"))
        assert resp.status == 503 and resp.headers["LLM-Gateway-Retry"] == "safe"
        resp = await direct.post("/v1/chat/completions", json=chat("nope"))   # the client's
        assert resp.status == 404 and "LLM-Gateway-Retry" not in resp.headers
        # the home gateway gone: its port refuses, the other answers
        await fleet.gateways[home].client.server.close()
        statuses = [await fleet.ask(session, "b") for _ in range(5)]
        assert statuses == [200] * 5
        assert fleet.served("b")[other] == 6


async def test_the_drain_notice_says_draining_and_still_serves(fleet: Fleet) -> None:
    """The stop's first step (app._serve): /ready 503 for drain_notice_s, everything else
    answered meanwhile."""
    gw = fleet.gateways[0]
    notice = asyncio.create_task(drain_notice(gw.client.app, 1.0))
    await asyncio.sleep(0.1)
    ready = await gw.client.get("/ready")
    assert ready.status == 503 and (await ready.json())["status"] == "draining"
    assert ready.headers.get("LLM-Gateway-Retry") is None   # (a check, not a refused request)
    assert (await gw.client.post("/v1/chat/completions", json=chat("a"))).status == 200
    assert not notice.done()
    await asyncio.wait_for(notice, 5)


async def test_bad_input_through_the_balancer_gets_the_gateways_clear_answers(
        fleet: Fleet) -> None:
    """What a client gets through HAProxy is what it gets direct: the gateway's JSON error
    for a body past its limit and for a request without a model; a body whose `model` is
    past HAProxy's buffer is still answered (balanced round robin)."""
    async with aiohttp.ClientSession() as session:
        huge = b'{"model": "a", "pad": "' + b"x" * (2 << 20) + b'"}'   # past their 1 MiB
        limit = fleet.gateways[0].engines.config.max_body_bytes
        assert len(huge) > limit, "the test's body must be past the gateways' limit"
        async with session.post(f"{fleet.url}/v1/chat/completions", data=huge,
                                headers={"Content-Type": "application/json"}) as resp:
            body = await resp.json()
            assert resp.status == 413 and body["error"]["code"] == "request_too_large", body
        async with session.post(f"{fleet.url}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
            body = await resp.json()
            assert resp.status == 400 and body["error"]["code"] == "model_required", body
        late = {"messages": [{"role": "user", "content": "x" * (100 << 10)}],
                "max_tokens": 2, "model": "c"}   # `model` past HAProxy's 64 KiB
        async with session.post(f"{fleet.url}/v1/chat/completions", json=late) as resp:
            assert resp.status == 200, await resp.text()


def balancers(body: dict[str, Any], headers: Any) -> str:
    """The error code of an answer HAProxy made itself, in the gateway's shape."""
    assert headers["Content-Type"] == "application/json", headers
    assert headers[ERROR_SOURCE_HEADER] == "balancer", headers
    error = body["error"]
    assert error["source"] == "balancer" and error["message"] and error["type"], body
    return str(error["code"])


@pytest.mark.parametrize("fleet", [1], indirect=True)
async def test_a_slow_upload_gets_the_balancers_timeout_as_an_openai_error(
        fleet: Fleet) -> None:
    """A body not sent whole within HAProxy's `timeout http-request` (here 1 s, shipped
    30 s): HAProxy's 408, in the gateway's error shape, saying it is the balancer's; no
    gateway saw the request."""
    host, port = fleet.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                 b'{"model": "a", ')
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE_S)
    status_line, *lines = head.decode().split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict(
        (name, value) for name, _, value in (line.partition(": ") for line in lines if line))
    body = json.loads(await reader.readexactly(int(headers["content-length"])))
    writer.close()
    assert status_line.split()[1] == "408", head
    assert balancers(body, headers) == "request_timeout"
    assert fleet.served("a") == [0, 0]


async def test_no_gateway_up_is_the_balancers_503_as_an_openai_error(fleet: Fleet) -> None:
    """Every gateway gone: an SDK gets a 503 it can read (OpenAI's shape, Retry-After), and
    a header that says the balancer, not a gateway, answered."""
    for g in fleet.gateways:
        await g.client.server.close()
    async with aiohttp.ClientSession() as session, \
            session.post(f"{fleet.url}/v1/chat/completions", json=chat("a")) as resp:
        body = await resp.json()
        assert resp.status == 503, body
        assert balancers(body, resp.headers) == "no_gateway"
        assert int(resp.headers["Retry-After"]) > 0
