"""At the drain deadline the gateway cancels the requests still open itself, with their
connections still open: the error middleware then answers shutting_down (503, in the
caller's dialect) instead of the connection vanishing. Without the deadline flag a
cancellation means the client left, and nothing is answered."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gatewayd.http.middleware import SHUTDOWN, Shutdown, error_middleware


async def _client_with_a_hanging_handler(
) -> tuple[TestClient[web.Request, web.Application], list[asyncio.Task[object]]]:
    tasks: list[asyncio.Task[object]] = []

    async def hang(request: web.Request) -> web.Response:
        task = asyncio.current_task()
        assert task is not None
        tasks.append(task)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app = web.Application(middlewares=[error_middleware])
    app[SHUTDOWN] = Shutdown()
    app.router.add_post("/v1/chat/completions", hang)
    app.router.add_post("/v1/messages", hang)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client, tasks


async def _cancel_when_handled(tasks: list[asyncio.Task[object]]) -> None:
    async with asyncio.timeout(5):
        while not tasks:
            await asyncio.sleep(0.01)
    tasks.pop().cancel()


@pytest.mark.parametrize(("path", "error_type"), [
    ("/v1/chat/completions", "server_error"),   # OpenAI's envelope
    ("/v1/messages", "overloaded_error"),       # Anthropic's, on its paths
])
async def test_a_request_cancelled_at_the_deadline_answers_shutting_down(
        path: str, error_type: str) -> None:
    client, tasks = await _client_with_a_hanging_handler()
    try:
        client.app[SHUTDOWN].expired = True
        answer = asyncio.ensure_future(client.post(path, json={"model": "m"}))
        await _cancel_when_handled(tasks)
        resp = await answer
        body = await resp.json()
        assert resp.status == 503
        assert body["error"]["code"] == "shutting_down"
        assert body["error"]["type"] == error_type
        assert "shutting down" in body["error"]["message"]
    finally:
        await client.close()


async def test_a_request_cancelled_otherwise_is_not_answered() -> None:
    client, tasks = await _client_with_a_hanging_handler()
    try:
        answer = asyncio.ensure_future(client.post("/v1/chat/completions", json={}))
        await _cancel_when_handled(tasks)
        with pytest.raises(aiohttp.ClientError):
            await answer
    finally:
        await client.close()
