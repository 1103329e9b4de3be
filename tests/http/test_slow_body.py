"""A body that stops coming is refused (408, the gateway's JSON, the connection closed)
after BODY_IDLE_S without a byte, whichever way the route reads it; a slow body that keeps
coming is read whole; everyone else is served meanwhile."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict

from gatewayd.core.errors import ERROR_SOURCE_HEADER
from gatewayd.http import middleware
from tests.http.test_front_door import Gateway, _gateway, chat

IDLE_S = 0.4


@pytest.fixture
async def gw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    monkeypatch.setattr(middleware, "BODY_IDLE_S", IDLE_S)
    async for g in _gateway(tmp_path, ("a",)):
        yield g


async def answer(reader: asyncio.StreamReader) -> tuple[int, CIMultiDict[str], dict[str, Any]]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode().split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict(
        (name, value) for name, _, value in (line.partition(": ") for line in lines if line))
    body = json.loads(await reader.readexactly(int(headers["Content-Length"])))
    return int(status_line.split()[1]), headers, body


async def send(gw: Gateway, path: str, body: bytes, length: int, *,
               content_type: str = "application/json", pause_s: float = 0.0,
               pieces: int = 1) -> tuple[int, CIMultiDict[str], dict[str, Any]]:
    """A POST whose Content-Length says length, of which body is sent in pieces, pause_s
    apart; its answer."""
    server = gw.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}"
                 f"\r\nContent-Length: {length}\r\n\r\n".encode())
    step = -(-len(body) // pieces)
    for i in range(0, len(body), step):
        writer.write(body[i:i + step])
        await writer.drain()
        await asyncio.sleep(pause_s)
    try:
        return await answer(reader)
    finally:
        writer.close()


@pytest.mark.parametrize("path, content_type", [
    ("/v1/chat/completions", "application/json"),           # openai_api.read_body
    ("/admin/engines/start", "application/json"),           # request.json()
    ("/v1/files", "multipart/form-data; boundary=xyz"),      # request.multipart()
])
async def test_a_body_that_stops_coming_is_the_gateways_408(
        gw: Gateway, path: str, content_type: str) -> None:
    body = (b'{"model": "a", "messages": [' if "json" in content_type else
            b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n')
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    meanwhile = asyncio.ensure_future(gw.client.post("/v1/chat/completions",
                                                     json=chat("a")))
    status, headers, error = await send(gw, path, body, len(body) + 1000,
                                        content_type=content_type)
    assert status == 408, error
    assert error["error"]["code"] == "request_timeout" and error["error"]["source"] == \
        "gateway", error
    assert headers[ERROR_SOURCE_HEADER] == "gateway" and headers["Connection"] == "close"
    assert IDLE_S <= loop.time() - t0 < IDLE_S * 4 + 2
    assert (await meanwhile).status == 200   # everyone else served meanwhile


async def test_a_slow_body_that_keeps_coming_is_read_whole(gw: Gateway) -> None:
    body = json.dumps(chat("a")).encode()
    # ~1.3 s in all, never IDLE_S without a byte
    status, _, answered = await send(gw, "/v1/chat/completions", body, len(body),
                                     pause_s=IDLE_S / 3, pieces=10)
    assert status == 200 and answered["choices"], answered
