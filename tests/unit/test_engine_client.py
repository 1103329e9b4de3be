"""The engine client against a scripted engine: every framing an engine may answer with,
split at any byte; keep-alive reuse and its limits; the retry of a reused connection the
engine closed; timeouts; flow control; the per-socket connection limit. On both event
loops the gateway can run on (asyncio, and uvloop, which it uses where installed)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import select
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from gatewayd.adapters.engine_wire.client import EngineClient
from gatewayd.adapters.engine_wire.connection import HIGH_WATER
from gatewayd.adapters.engine_wire.errors import (
    AnswerTooLarge,
    BadFraming,
    ConnectionsBusy,
    ConnectionsQueueFull,
    EngineConnectionError,
)
from gatewayd.adapters.engine_wire.framing import MAX_HEAD
from gatewayd.adapters.engine_wire.pool import Pool

pytestmark = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Engine:
    """A unix socket server; each connection is served by `handler` (replaceable)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.handler: Handler = answer_each(ok(b"hi"))
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            task = asyncio.current_task()
            assert task is not None
            self.tasks.add(task)
            try:
                await self.handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()
                self.tasks.discard(task)
        self.server = await asyncio.start_unix_server(serve, self.path)

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra +
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


def answer_each(answer: bytes) -> Handler:
    """Keep-alive: the same answer to every request on the connection."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await ENGINE.read_request(reader)
            writer.write(answer)
            await writer.drain()
    return handle


ENGINE: Engine   # the current test's (handlers reach it through this)


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    global ENGINE
    with tempfile.TemporaryDirectory(prefix="ec", dir="/tmp") as d:   # short: sun_path
        ENGINE = Engine(str(Path(d) / "engine.sock"))
        await ENGINE.start()
        yield ENGINE
        await ENGINE.stop()


async def get(client: EngineClient, engine: Engine, *, reuse: bool = True,
              body: bytes = b"{}") -> tuple[int, bytes]:
    resp = await client.request(engine.path, "POST", "/v1/chat/completions",
                                [("Content-Type", "application/json")], body, reuse=reuse)
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


async def test_keep_alive_reuses_one_connection_and_sends_what_it_was_given(
        engine: Engine) -> None:
    client = EngineClient(read_timeout_s=5)
    for _ in range(3):
        assert await get(client, engine, body=b'{"model": "x"}') == (200, b"hi")
    assert engine.connections == 1
    first = engine.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\n")
    assert b"Content-Type: application/json\r\n" in first
    assert first.endswith(b'Content-Length: 14\r\n\r\n{"model": "x"}')
    assert client.pooled(engine.path)
    await client.close()


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n"
           b"b\r\ndata: one\n\n\r\n" b"B;ext=1\r\ndata: two\n\n\r\n" b"0\r\nX-Trailer: t\r\n\r\n")


@pytest.mark.parametrize("answer", [ok(b"x" * 300), CHUNKED], ids=["length", "chunked"])
async def test_an_answer_split_at_every_byte_reads_the_same(engine: Engine,
                                                            answer: bytes) -> None:
    """However the engine's writes are cut, the body is the same, and the connection is
    reused after it."""
    whole = b"x" * 300 if answer is not CHUNKED else b"data: one\n\ndata: two\n\n"
    for cut in range(1, len(answer)):
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         cut: int = cut) -> None:
            while True:
                await engine.read_request(reader)
                writer.write(answer[:cut])
                await writer.drain()
                await asyncio.sleep(0)
                writer.write(answer[cut:])
                await writer.drain()
        engine.handler = handle
        client = EngineClient(read_timeout_s=5)
        assert await get(client, engine) == (200, whole), cut
        assert await get(client, engine) == (200, whole), cut   # the same connection
        await client.close()
    assert engine.connections == len(answer) - 1


async def test_a_stream_comes_in_pieces_as_the_engine_writes_them(engine: Engine) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            event = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    engine.handler = handle
    client = EngineClient(read_timeout_s=5)
    resp = await client.request(engine.path, "POST", "/v1/chat/completions", [], b"{}",
                                reuse=False)
    assert resp.headers["Content-Type"] == "text/event-stream"
    pieces = []
    while piece := await resp.read_some():
        pieces.append(piece)
    resp.release()
    assert pieces == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert not client.pooled(engine.path)     # a stream's connection is never reused
    await client.close()


async def test_an_answer_until_close_a_1xx_first_and_no_body_answers(engine: Engine) -> None:
    script = [b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"after continue"),
              b"HTTP/1.1 204 No Content\r\nX-A: b\r\n\r\n",
              b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil close"]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(script.pop(0))
        await writer.drain()   # then close (each answer on its own connection here)
    engine.handler = handle
    client = EngineClient(read_timeout_s=5)
    assert await get(client, engine) == (200, b"after continue")
    assert await get(client, engine) == (204, b"")
    assert await get(client, engine) == (200, b"until close")
    await client.close()


async def test_connection_close_and_a_stale_connection_are_not_reused(engine: Engine) -> None:
    engine.handler = answer_each(ok(b"bye", b"Connection: close\r\n"))
    client = EngineClient(read_timeout_s=5, keepalive_s=0.05)
    await get(client, engine)
    await get(client, engine)
    assert engine.connections == 2          # the engine said close
    engine.handler = answer_each(ok(b"hi"))
    await get(client, engine)
    await asyncio.sleep(0.1)                # past keepalive_s: not trusted any more
    await get(client, engine)
    assert engine.connections == 4
    await client.close()


async def test_a_reused_connection_closed_before_answering_is_retried_once(
        engine: Engine) -> None:
    """The engine closes an idle keep-alive connection just as the next request is sent
    on it (llama-server: its keep-alive timeout and request limit): sent once more, on a
    new connection; an answer cut short is not retried."""
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await engine.read_request(reader)
        served += 1
        writer.write(ok(b"hi"))
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")   # the next request: closed unanswered
    engine.handler = handle
    client = EngineClient(read_timeout_s=5)
    assert await get(client, engine) == (200, b"hi")
    assert await get(client, engine) == (200, b"hi")
    assert (served, engine.connections) == (2, 2)

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(ok(b"hello")[:-2])        # dies in the middle of the body
        await writer.drain()
    engine.handler = cut
    with pytest.raises(EngineConnectionError, match="in the middle") as err:
        await get(client, engine, reuse=False)
    assert not err.value.fresh
    await client.close()


async def test_a_request_sent_on_a_connection_the_dying_engine_reset_is_no_connect_error(
        engine: Engine) -> None:
    """The engine dies with the request read (or in its socket): the retry finds the
    socket gone. That request reached a process, so it must not count as never sent
    (`connect`), which would let the gateway send it to the restarted engine."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(ok(b"hi"))
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")   # the next request: then the engine dies
        await engine.stop()
        Path(engine.path).unlink()
    engine.handler = handle
    client = EngineClient(read_timeout_s=5)
    assert await get(client, engine) == (200, b"hi")
    with pytest.raises(EngineConnectionError) as err:
        await get(client, engine)
    assert err.value.fresh and not err.value.connect
    await client.close()


async def test_a_request_written_into_the_end_of_an_engine_that_just_died_reached_none(
        tmp_path: Path) -> None:
    """The engine's process died a moment ago: its end of an idle connection is closed,
    but the gateway has not read that yet and writes the request into it (EPIPE), then
    finds the socket gone. Nothing of the request was read by any process: it may go to
    the restarted engine (`connect`)."""
    path = str(tmp_path / "e.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    die = threading.Event()

    def serve() -> None:   # in a thread: its death is not an event of the client's loop
        conn, _ = listener.accept()
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"{}"):
            data += conn.recv(65536)
        conn.sendall(ok(b"hi"))
        die.wait(10)
        conn.close()
        listener.close()
        Path(path).unlink()
    thread = threading.Thread(target=serve)
    thread.start()
    client = EngineClient(read_timeout_s=5)
    resp = await client.request(path, "POST", "/x", [], b"{}")
    assert (resp.status, await resp.read()) == (200, b"hi")
    resp.release()
    die.set()
    thread.join(10)        # (no turn of the loop: the client has not seen the close)
    with pytest.raises(EngineConnectionError) as err:
        await client.request(path, "POST", "/x", [], b"{}")
    assert err.value.connect and err.value.fresh, err.value
    await client.close()


async def test_a_request_the_dying_engine_never_read_reached_none(tmp_path: Path) -> None:
    """The engine's process dies with the request in its socket, unread: Linux tells the
    writer ECONNRESET (one that read it and then died closes with an end of file: the
    test above). It reached no process, so it may go to the restarted engine."""
    path = str(tmp_path / "e.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()

    def serve() -> None:
        conn, _ = listener.accept()
        data = b""
        while not data.endswith(b"{}"):
            data += conn.recv(65536)
        conn.sendall(ok(b"hi"))
        select.select([conn], [], [], 10)    # the next request is there: die, unread
        conn.close()
        listener.close()
        Path(path).unlink()
    thread = threading.Thread(target=serve)
    thread.start()
    client = EngineClient(read_timeout_s=5)
    resp = await client.request(path, "POST", "/x", [], b"{}")
    assert (resp.status, await resp.read()) == (200, b"hi")
    resp.release()
    with pytest.raises(EngineConnectionError) as err:
        await client.request(path, "POST", "/x", [], b"{}")
    thread.join(10)
    assert err.value.connect and err.value.fresh, err.value
    await client.close()


async def test_nothing_there_fails_at_once_as_a_connect_error(tmp_path: Path) -> None:
    client = EngineClient(read_timeout_s=5)
    with pytest.raises(EngineConnectionError) as err:
        await client.request(str(tmp_path / "none.sock"), "GET", "/health", [], b"")
    assert err.value.connect and err.value.fresh
    assert client.in_use(str(tmp_path / "none.sock")) == 0    # its connection was given back
    await client.close()


async def test_a_silent_engine_times_out_before_the_head_and_in_the_body(
        engine: Engine) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        await asyncio.sleep(30)
    engine.handler = silent
    client = EngineClient(read_timeout_s=0.2)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        await get(client, engine)
    assert 0.15 < loop.time() - t0 < 2

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        for _ in range(4):                 # bytes keep coming for a while: no timeout
            await asyncio.sleep(0.1)
            writer.write(b"1\r\nd\r\n")
        await asyncio.sleep(30)
    engine.handler = stalls
    resp = await client.request(engine.path, "POST", "/", [], b"", reuse=False)
    got = b""
    with pytest.raises(TimeoutError):
        while piece := await resp.read_some():
            got += piece
    resp.close()
    assert got == b"abcdddd"
    assert client.in_use(engine.path) == 0
    await client.close()


async def test_reading_pauses_for_a_slow_reader_and_resumes(engine: Engine) -> None:
    size = HIGH_WATER * 8

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(ok(b"y" * size))
        await writer.drain()
    engine.handler = big
    client = EngineClient(read_timeout_s=0.3)
    resp = await client.request(engine.path, "POST", "/", [], b"")
    await asyncio.sleep(0.6)       # a slow client: longer than the read timeout
    conn = resp._conn
    assert conn._buffered <= HIGH_WATER * 2    # reading stopped near the high-water mark
    body = await resp.read()       # ... and this is no timeout: we were the slow ones
    resp.release()
    assert len(body) == size
    await client.close()


async def test_at_most_limit_connections_the_rest_wait_in_order(engine: Engine) -> None:
    release = asyncio.Event()
    order: list[int] = []

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await engine.read_request(reader)
            order.append(int(request.rsplit(b"\r\n\r\n", 1)[1]))
            await release.wait()
            writer.write(ok(b"done"))
            await writer.drain()
    engine.handler = slow
    client = EngineClient(read_timeout_s=5)
    client.set_limit(engine.path, 2)
    tasks = [asyncio.ensure_future(get(client, engine, body=b"%d" % i)) for i in range(6)]
    for _ in range(100):
        await asyncio.sleep(0.01)
        if client.waiting(engine.path) == 4:
            break
    assert (client.in_use(engine.path), client.waiting(engine.path)) == (2, 4)
    assert engine.connections == 2
    tasks[3].cancel()                     # a waiter whose client left just leaves
    release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[3], asyncio.CancelledError)
    assert all(r == (200, b"done") for i, r in enumerate(results) if i != 3)
    # first come, first served (the first two raced each other to the engine)
    assert sorted(order[:2]) == [0, 1] and order[2:] == [2, 4, 5]
    assert engine.connections == 2       # the two connections served everyone
    assert client.in_use(engine.path) == 0 and client.waiting(engine.path) == 0
    await client.close()


def answers_once_released(engine: Engine, release: asyncio.Event) -> Handler:
    """An engine handler that answers each request (b"done") only once release is set."""
    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await engine.read_request(reader)
            await release.wait()
            writer.write(ok(b"done"))
            await writer.drain()
    return held


async def test_a_wait_for_a_connection_ends_after_the_queue_time_and_leaves_no_trace(
        engine: Engine) -> None:
    """All connections busy for queue_timeout_s: ConnectionsBusy, the waiter gone from the
    queue, the connections as they were; the busy ones answer, and the next request gets one."""
    release = asyncio.Event()
    engine.handler = answers_once_released(engine, release)
    client = EngineClient(read_timeout_s=5, queue_timeout_s=0.2)
    client.set_limit(engine.path, 1)
    first = asyncio.ensure_future(get(client, engine))
    deadline = time.monotonic() + 5
    while client.in_use(engine.path) != 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    t0 = time.monotonic()
    with pytest.raises(ConnectionsBusy, match="all 1 of the engine's connections"):
        await get(client, engine)
    assert time.monotonic() - t0 >= 0.19   # (uvloop's timers count whole milliseconds)
    assert (client.in_use(engine.path), client.waiting(engine.path)) == (1, 0)
    release.set()
    assert await first == (200, b"done")
    assert await get(client, engine) == (200, b"done")
    assert client.in_use(engine.path) == 0
    await client.close()


async def test_nonsense_from_the_engine_is_an_error_not_a_hang(engine: Engine) -> None:
    client = EngineClient(read_timeout_s=5)
    for answer, match in ((b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP answer"),
                          (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "Content-Length"),
                          (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                           "chunked")):
        engine.handler = answer_each(answer)
        with pytest.raises(EngineConnectionError, match=match):
            await get(client, engine, reuse=False)
    assert client.in_use(engine.path) == 0
    await client.close()


async def test_a_sink_gets_each_piece_as_it_arrives_and_its_failure_ends_the_answer(
        engine: Engine) -> None:
    async def paced(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(4):
            writer.write(b"1\r\n%d\r\n" % i)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
    engine.handler = paced
    client = EngineClient(read_timeout_s=5)
    got: list[bytes] = []
    resp = await client.request(engine.path, "POST", "/", [], b"", reuse=False)
    resp.relay_to(got.append)
    assert await resp.wait_end() is True
    resp.release()
    assert got == [b"0", b"1", b"2", b"3"]          # one call per piece, in order

    def breaks(piece: bytes) -> None:
        if piece == b"2":
            raise ValueError("the client side broke")
    resp = await client.request(engine.path, "POST", "/", [], b"", reuse=False)
    resp.relay_to(breaks)
    with pytest.raises(EngineConnectionError, match="relaying the answer failed"):
        await resp.wait_end()
    resp.close()
    assert client.in_use(engine.path) == 0
    await client.close()


async def test_a_chunk_sink_gets_whole_chunks_as_they_came_the_rest_goes_to_the_sink(
        engine: Engine) -> None:
    """relay_to's chunk_sink: a read that is exactly one whole chunk is offered framing and
    all; a part of a chunk, two chunks in one read, a chunk with an extension, one the
    chunk sink refuses, sizes not written plainly (they would go on as written) and the last
    chunk go to the sink as pieces of the body."""
    took = asyncio.Event()   # the client side handled a read: the engine writes the next
    relaying = asyncio.Event()

    def chunk(data: bytes, ext: bytes = b"") -> bytes:
        return b"%x%s\r\n%s\r\n" % (len(data), ext, data)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await relaying.wait()
        split = chunk(b"data: 1\n\n")
        for write in (chunk(b"data: 0\n\n"), split[:6], split[6:],
                      chunk(b"data: 2\n\n") + chunk(b"data: 3\n\n"),
                      chunk(b"data: 4\n\n", b";x=y"), b"A\r\ndata: 66\n\n\r\n",
                      b"09\r\ndata: 7\n\n\r\n", chunk(b"data: refuse\n\n"),
                      chunk(b"data: 5\n\n"), b"0\r\n\r\n"):
            took.clear()
            writer.write(write)
            await writer.drain()
            await took.wait()
    engine.handler = handle
    client = EngineClient(read_timeout_s=5)
    whole: list[tuple[bytes, int]] = []
    pieces: list[bytes] = []

    def sink(piece: bytes) -> None:
        pieces.append(piece)
        took.set()

    def chunk_sink(framed: bytes, size: int) -> bool:
        took.set()
        if b"refuse" in framed:
            return False
        whole.append((framed, size))
        return True
    resp = await client.request(engine.path, "POST", "/", [], b"", reuse=False)
    resp.relay_to(sink, chunk_sink)
    relaying.set()
    assert await resp.wait_end() is True
    resp.release()
    assert whole == [(chunk(b"data: 0\n\n"), 9), (chunk(b"data: 5\n\n"), 9)]
    assert b"".join(pieces) == (b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n"
                                b"data: 66\n\ndata: 7\n\ndata: refuse\n\n")
    assert client.in_use(engine.path) == 0

    def breaks(framed: bytes, size: int) -> bool:
        took.set()
        raise ValueError("the client side broke")
    relaying.clear()
    resp = await client.request(engine.path, "POST", "/", [], b"", reuse=False)
    resp.relay_to(sink, breaks)
    relaying.set()
    with pytest.raises(EngineConnectionError, match="relaying the answer failed"):
        await resp.wait_end()
    resp.close()
    assert client.in_use(engine.path) == 0
    await client.close()


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("answer", [
    CHUNKED_HEAD + b"-5\r\nhello\r\n0\r\n\r\n", CHUNKED_HEAD + b"+5\r\nhello\r\n0\r\n\r\n",
    CHUNKED_HEAD + b"0x5\r\nhello\r\n0\r\n\r\n", CHUNKED_HEAD + b"5_0\r\n",
    CHUNKED_HEAD + b"1" * 16 + b"\r\n", CHUNKED_HEAD + b"5" * 5000,
    CHUNKED_HEAD + b"0\r\n" + b"X-Trailer: x\r\n" * (MAX_HEAD // 10),
    b"HTTP/1.1 200 OK\r\n" + b"X-Header: x\r\n" * (MAX_HEAD // 10),
    b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", b"HTTP/1.1 \xb2\xb2\xb2 OK\r\n\r\n"],
    ids=["negative", "plus", "0x", "underscore", "16-digits", "endless-size-line",
         "endless-trailers", "endless-head", "superscript-length", "superscript-status"])
async def test_framing_past_the_rules_or_bounds_is_refused_at_once(engine: Engine,
                                                                   answer: bytes) -> None:
    """A hostile engine's framing: refused as BadFraming (a 502 at the front door) and
    counted, neither waited out nor buffered without end; the next request is served."""
    async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(10)   # and then nothing: only a refusal ends the wait in time
    engine.handler = hostile
    client = EngineClient(read_timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(BadFraming):
        await get(client, engine, reuse=False)
    assert time.monotonic() - t0 < 2
    assert client.refused["framing"] == 1 and client.in_use(engine.path) == 0
    engine.handler = answer_each(ok(b"fine"))
    assert await get(client, engine) == (200, b"fine")
    await client.close()


async def test_a_body_read_whole_past_its_limit_is_refused(engine: Engine) -> None:
    engine.handler = answer_each(ok(b"x" * 5000))
    client = EngineClient(read_timeout_s=5)
    resp = await client.request(engine.path, "GET", "/", [], b"")
    with pytest.raises(AnswerTooLarge, match="over 4000 bytes"):
        await resp.read(4000)
    resp.release()
    assert client.in_use(engine.path) == 0 and not client.pooled(engine.path)
    assert await get(client, engine) == (200, b"x" * 5000)
    await client.close()


async def test_the_wait_for_connections_is_bounded_by_the_queue_limit(engine: Engine) -> None:
    """Past queue_limit waiting requests the next is refused at once (the front door's 503
    queue_full), not held with its body for up to read_timeout_s; a socket's own limit
    (set_queue_limit, the model's queue_limit) wins over the client's."""
    release = asyncio.Event()
    engine.handler = answers_once_released(engine, release)
    client = EngineClient(read_timeout_s=5, queue_limit=2)
    client.set_limit(engine.path, 1)
    tasks = [asyncio.ensure_future(get(client, engine)) for _ in range(3)]
    deadline = time.monotonic() + 5
    while client.waiting(engine.path) != 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    t0 = time.monotonic()
    with pytest.raises(ConnectionsQueueFull, match="queue_limit 2"):
        await get(client, engine)
    assert time.monotonic() - t0 < 1
    client.set_queue_limit(engine.path, 3)
    tasks.append(asyncio.ensure_future(get(client, engine)))
    while client.waiting(engine.path) != 3:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    release.set()
    assert await asyncio.gather(*tasks) == [(200, b"done")] * 4
    assert (client.in_use(engine.path), client.waiting(engine.path)) == (0, 0)
    await client.close()


async def test_a_no_content_answer_ends_at_its_head_on_a_kept_connection(
        engine: Engine) -> None:
    """A 204 has no body, whatever its headers say or leave out: read at once, not until
    the engine closes (it keeps the connection for the next request)."""
    engine.handler = answer_each(b"HTTP/1.1 204 No Content\r\nX-A: b\r\n\r\n")
    client = EngineClient(read_timeout_s=2)
    for _ in range(2):
        assert await asyncio.wait_for(get(client, engine), 1) == (204, b"")
    assert engine.connections == 1
    await client.close()


async def test_bytes_past_an_answers_end_break_its_connection(engine: Engine) -> None:
    """An engine that sends more than its Content-Length, or anything once its answer is
    whole, is out of step with its connection: what follows could be read as the next
    request's answer. The answer is refused, or the connection dropped from the pool."""
    engine.handler = answer_each(ok(b"ok") + b"EXTRA")
    client = EngineClient(read_timeout_s=1)
    with pytest.raises(EngineConnectionError, match="more than its Content-Length"):
        await asyncio.wait_for(get(client, engine), 3)

    async def late_extra(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(ok(b"hi"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(ok(b"evil"))   # an answer to a request not yet sent
        await writer.drain()
        await asyncio.sleep(10)
    engine.handler = late_extra
    assert await get(client, engine) == (200, b"hi")
    assert client.pooled(engine.path)
    await asyncio.sleep(0.2)
    assert not client.pooled(engine.path)
    engine.handler = answer_each(ok(b"good"))
    assert await get(client, engine) == (200, b"good")
    await client.close()


async def test_a_waiter_cancelled_just_before_a_release_leaves_without_an_error() -> None:
    """A client that leaves while it waits for a connection: its cancel lands, then a
    connection is released before its task runs again. The release passes over the
    cancelled waiter (taking it off the queue); the waiter leaving must not fail for it
    (it raised ValueError from deque.remove, found by the fast tier under uvloop)."""
    pool = Pool(keepalive_s=5.0, limit=1, refused=collections.Counter())
    await pool.acquire(None, queue_limit=8)            # the one connection, in use
    waiting = asyncio.ensure_future(pool.acquire(None, queue_limit=8))
    late = asyncio.ensure_future(pool.acquire(None, queue_limit=8))
    for _ in range(100):
        if len(pool.waiters) == 2:
            break
        await asyncio.sleep(0)
    waiting.cancel()
    pool.release()        # before `waiting` runs: the connection goes to `late`
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await late
    assert pool.busy == 1 and not pool.waiters
    late_timeout = asyncio.ensure_future(pool.acquire(0.01, queue_limit=8))
    with pytest.raises(ConnectionsBusy):
        await late_timeout
    assert not pool.waiters
