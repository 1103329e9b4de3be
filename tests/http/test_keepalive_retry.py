"""An engine that closes a pooled keep-alive connection just as the next request is sent
on it (llama-server does, at its keep-alive limit): the gateway, and the benchmark's bare
proxy, send that request once more on a new connection instead of failing it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from bench.bare_proxy import build
from tests.http.test_front_door import _gateway, chat

ANSWER = (b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n'
          b'Connection: keep-alive\r\n\r\n{}')


class ClosingEngine:
    """Answers the first request on each connection, then closes the connection when the
    next request arrives on it, without answering."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(ANSWER)
            await writer.drain()
            self.answered += 1
            await reader.read(1)          # the next request has begun: close on it
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def closing_engine(socket: str) -> AsyncIterator[ClosingEngine]:
    engine = ClosingEngine()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket)
    server = await asyncio.start_unix_server(engine.handle, socket)
    try:
        yield engine
    finally:
        server.close()
        await server.wait_closed()


async def test_the_gateway_sends_again_on_a_fresh_connection(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        await gw.fakes["a"].stop()
        async with closing_engine(gw.engines.registry.get("a").socket) as engine:  # type: ignore[union-attr]
            for _ in range(3):
                resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
                assert resp.status == 200, await resp.text()
            assert engine.answered == 3 and engine.connections == 3


async def test_the_bare_proxy_sends_again_and_counts_it() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as run:
        socket = str(Path(run, "engine.sock"))
        async with closing_engine(socket) as engine, \
                TestClient(TestServer(build(socket))) as client:
            for _ in range(3):
                resp = await client.post("/v1/chat/completions", data=b"{}")
                assert resp.status == 200, await resp.text()
            assert engine.answered == 3
            # the second request meets the closed pooled connection and goes again on a
            # connection of its own (closed after it, not pooled: the third finds the pool
            # empty and opens a new one, which answers: three connections in all)
            assert (await (await client.get("/bare/retries")).json()) == {"retries": 1}
            assert engine.connections == 3
