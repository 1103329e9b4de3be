"""The readiness probe (adapters/health.py) over real unix sockets: an engine's answer,
a loading one (503), garbage, silence and no socket at all; and the poll schedule."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from gatewayd.adapters.health import UnixHealthProbe, parse_status
from gatewayd.service.readiness import poll_delays
from tests.fake_engine import FakeEngine

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def sock_dir() -> AsyncIterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hp", dir="/tmp") as d:   # sun_path: 108 bytes
        yield Path(d)


async def serve(path: Path, handler: Handler) -> asyncio.AbstractServer:
    return await asyncio.start_unix_server(handler, path=str(path))


async def test_a_ready_engine_answers_200(sock_dir: Path) -> None:
    engine = FakeEngine("a")
    await engine.start(str(sock_dir / "engine.sock"))
    try:
        assert await UnixHealthProbe().status(str(sock_dir / "engine.sock")) == 200
    finally:
        await engine.stop()


async def test_loading_garbage_silence_and_no_socket(sock_dir: Path) -> None:
    probe = UnixHealthProbe()
    assert await probe.status(str(sock_dir / "missing.sock")) is None

    async def loading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"error":{"code":503,"message":"Loading model"}}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        writer.close()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH\r\n")
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    servers = [await serve(sock_dir / f"{h.__name__}.sock", h)
               for h in (loading, garbage, silent)]
    try:
        assert await probe.status(str(sock_dir / "loading.sock")) == 503
        assert await probe.status(str(sock_dir / "garbage.sock")) is None
        started = asyncio.get_running_loop().time()
        assert await probe.status(str(sock_dir / "silent.sock"), timeout=0.2) is None
        assert asyncio.get_running_loop().time() - started < 2
    finally:
        for server in servers:
            server.close()


def test_status_line_parsing() -> None:
    assert parse_status(b"HTTP/1.1 200 OK\r\n\r\n") == 200
    assert parse_status(b"HTTP/1.0 503\r\n") == 503
    assert parse_status(b"") is None
    assert parse_status(b"HTTP/1.1 2000 OK\r\n") is None
    assert parse_status(b"HTTP/2 200\r\n") is None


def test_polls_are_tight_while_a_small_model_loads_then_back_off() -> None:
    delays = poll_delays()
    assert delays[:50] == [0.002] * 50          # every 2 ms for the first 100 ms
    assert delays[50] > delays[49] and max(delays) == 0.5
    assert sum(delays) >= 3600
