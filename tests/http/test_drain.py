"""The gateway's stop, as `serve` stops (app.stop_serving), on a real listening socket
that outlives it the way systemd's does: a request in flight at the stop is answered in
full, a connection accepted just before it has its request served, a request still
running when the drain time ends answers shutting_down on its open connection, no
connection taken is reset, and what was not taken waits for the next process.

The drain is built on aiohttp's public API only (http/drain.py, adapters/listener.py);
these tests are what says it still drains (tests/mutants.py breaks it to check them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gatewayd.adapters.listener import Listener
from gatewayd.app import build_app, gateway_runner, stop_serving
from gatewayd.http.drain import ABANDON_GRACE_S, FRESH_CONNECTION_GRACE_S
from tests.fake_engine import FakeEngine
from tests.fakes import engine_layer_on, engine_manager_on_fakes

# the gateway runs on uvloop where installed, on asyncio's loop if told: the accepting is
# each loop's own (connect_accepted_socket)
pytestmark = pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])

DRAIN_S = 1.0   # shutdown_timeout_s in these tests


@dataclass
class Served:
    app: web.Application
    runner: web.AppRunner
    listener: Listener
    held: socket.socket    # the listening socket as systemd holds it: it outlives the gateway
    stopped: bool = False

    @property
    def port(self) -> int:
        return int(self.held.getsockname()[1])

    async def stop_in(self, delay_s: float) -> float:
        await asyncio.sleep(delay_s)
        return await self.stop()

    async def stop(self) -> float:
        """The stop `serve` makes on SIGTERM; how long it took."""
        started = time.monotonic()
        self.stopped = True
        await stop_serving(self.app, self.runner, self.listener, None, DRAIN_S)
        return time.monotonic() - started


@contextlib.asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[Served]:
    run_root = tempfile.mkdtemp(prefix="dr", dir="/tmp")   # short: sun_path is 108 bytes
    mgr, units, _ = engine_manager_on_fakes(tmp_path, run_root=run_root)
    engine = FakeEngine("a")
    await engine.start(units.layout("a").socket)
    app = build_app(mgr.config, engines_ctx=engine_layer_on(mgr))
    runner = gateway_runner(app)
    await runner.setup()
    assert runner.server is not None
    held = socket.create_server(("127.0.0.1", 0))
    # the gateway gets its own descriptor of the socket, as from systemd
    listener = Listener([held.dup()], runner.server)
    listener.start()
    await mgr.lifecycle.start("a")
    served = Served(app, runner, listener, held)
    try:
        yield served
    finally:
        if not served.stopped:
            await listener.stop()
            await runner.cleanup()
        await engine.stop()
        held.close()
        shutil.rmtree(run_root, ignore_errors=True)


def post(path: str, payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload).encode()
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))


def chat(prompt: str, max_tokens: int, *, stream: bool = False) -> bytes:
    return post("/v1/chat/completions", {
        "model": "a", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "stream": stream})


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One whole answer (status, body). Where the connection ends before the answer does,
    IncompleteReadError."""
    status, headers = await head(reader)
    if "content-length" in headers:
        return status, await reader.readexactly(int(headers["content-length"]))
    return status, await rest(reader)


async def head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:] if line)}
    return int(lines[0].split()[1]), headers


async def chunk(reader: asyncio.StreamReader) -> bytes | None:
    """The next chunk of a chunked body; None at its end."""
    size = int((await reader.readuntil(b"\r\n")).strip(), 16)
    data = await reader.readexactly(size + 2)
    assert data.endswith(b"\r\n")
    return data[:-2] if size else None


async def rest(reader: asyncio.StreamReader) -> bytes:
    """The rest of a chunked body, to its proper end."""
    body = b""
    while (data := await chunk(reader)) is not None:
        body += data
    return body


def events(body: bytes) -> list[Any]:
    return ["[DONE]" if block == b"data: [DONE]" else json.loads(block[6:])
            for block in body.split(b"\n\n") if block.startswith(b"data: ")]


async def until(condition: Any, timeout: float = 5) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_connection_accepted_just_before_the_stop_has_its_request_served(
        tmp_path: Path) -> None:
    """It was taken but its request had not arrived (aiohttp's shutdown closes such a
    connection unanswered): the stop waits for the request and serves it."""
    async with serving(tmp_path) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        await until(gw.listener.connections)   # taken, silent
        stop = asyncio.create_task(gw.stop())
        await asyncio.sleep(FRESH_CONNECTION_GRACE_S / 4)
        assert not stop.done(), "the stop did not wait for the silent connection"
        writer.write(chat("hi", 3))
        status, body = await asyncio.wait_for(answer(reader), 5)
        assert status == 200
        assert json.loads(body)["choices"][0]["message"]["content"] == " w0 w1 w2"
        took = await asyncio.wait_for(stop, 10)
        assert took < FRESH_CONNECTION_GRACE_S + 1   # it did not wait out the whole grace
        writer.close()


async def test_requests_in_flight_finish_and_those_past_the_drain_time_say_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """At the stop: a stream that ends within the drain time (shutdown_timeout_s) ends
    whole; one that runs past it gets a shutting_down error event on its still open
    connection, and the body's proper end; a kept-alive connection with no request holds
    nothing up."""
    async with serving(tmp_path) as gw:
        idle_reader, idle = await asyncio.open_connection("127.0.0.1", gw.port)
        idle.write(chat("hi", 2))
        assert (await answer(idle_reader))[0] == 200   # then kept alive, idle
        streams = {}
        for name, prompt, tokens in (("short", "slow 40", 10), ("long", "slow 40", 500)):
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(chat(prompt, tokens, stream=True))
            assert (await head(reader))[0] == 200
            first = await chunk(reader)            # the stream has begun
            assert first is not None
            streams[name] = (reader, writer, first)
        with caplog.at_level(logging.WARNING, logger="gatewayd"):
            stop = asyncio.create_task(gw.stop())
            answers = await asyncio.wait_for(asyncio.gather(
                *(rest(reader) for reader, _, _ in streams.values())), 10)
            took = await asyncio.wait_for(stop, 10)
        short, long = (events(first + body) for (_, _, first), body
                       in zip(streams.values(), answers, strict=True))
        assert short[-1] == "[DONE]"                           # whole: every token
        assert [e["choices"][0]["delta"]["content"] for e in short[1:11]] == \
            [f" w{i}" for i in range(10)]
        assert long[-1]["error"]["code"] == "shutting_down"   # not a cut connection
        assert len(long) < 100
        assert DRAIN_S <= took < DRAIN_S + ABANDON_GRACE_S + 1
        assert "ending 1 open request(s)" in caplog.text      # not the idle connection
        for _, writer, _ in streams.values():
            writer.close()
        idle.close()


async def test_the_stop_resets_no_connection_and_leaves_the_rest_to_the_next_process(
        tmp_path: Path) -> None:
    """Connections arrive as the gateway stops: each is answered in full, by this gateway
    (taken before the stop) or by the next process on the same socket (not taken: it
    waited in the socket's backlog). None is reset or closed unanswered.

    The stop comes in the very loop turn that takes a batch of connections (a timer fires
    in the turn whose poll found them): asyncio's own server, closed there, reset the
    connections of that batch."""
    async with serving(tmp_path) as gw:
        loop = asyncio.get_running_loop()

        def arrive(count: int) -> list[socket.socket]:
            # connected and asked before the loop runs again (the kernel's handshake)
            out = []
            for _ in range(count):
                sock = socket.create_connection(("127.0.0.1", gw.port))
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Connection: close\r\n\r\n")
                out.append(sock)
            return out

        before = await asyncio.gather(*(answer_on(sock) for sock in arrive(4)))
        assert b"next" not in before
        stop = loop.create_task(gw.stop_in(0.0001))   # its timer is due in the next turn
        await asyncio.sleep(0)
        at_the_stop = arrive(16)
        await asyncio.wait_for(stop, 10)
        after = arrive(4)

        async def next_process(request: web.BaseRequest) -> web.Response:
            return web.Response(text="next")
        runner = web.ServerRunner(web.Server(next_process))
        await runner.setup()
        assert runner.server is not None
        following = Listener([gw.held.dup()], runner.server)
        following.start()
        try:
            bodies = await asyncio.wait_for(asyncio.gather(
                *(answer_on(sock) for sock in at_the_stop + after)), 20)
        finally:
            await following.stop()
            await runner.cleanup()
        by_next = [body == b"next" for body in bodies]
        assert all(by_next[-4:])   # the socket outlived the stop: the next process has it
        assert not all(by_next[:16]), "the stop took none of the batch it came with"


async def answer_on(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        status, body = await answer(reader)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise AssertionError(f"a connection was cut unanswered: {e!r}") from e
    finally:
        writer.close()
    assert status == 200, body
    return body
