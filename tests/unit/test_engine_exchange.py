"""The gateway's own short exchanges with an engine (adapters/engine_wire/exchange.py) and what
rides on them on the cold start's path: the KV cache restore (straight into the saved
parallel slots, no GET /slots first) and the parallel slot count of an engine setup seen
before (no GET /props). Scripted engines on real unix sockets, on both event loops the
gateway runs on."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gatewayd.adapters.engine_wire.client import EngineClient, learn_parallel_slots
from gatewayd.adapters.engine_wire.errors import EngineConnectionError
from gatewayd.adapters.engine_wire.exchange import exchange
from gatewayd.adapters.engine_wire.framing import AnswerParser
from gatewayd.adapters.health import UnixHealthProbe
from gatewayd.adapters.kv_cache import KvCache

pytestmark = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])

Answer = Callable[[bytes], list[bytes]]   # request head -> the pieces written back


class Scripted:
    """A unix socket server: every request is recorded (its first line) and answered."""

    def __init__(self, path: str, answer: Answer) -> None:
        self.path = path
        self.answer = answer
        self.seen: list[str] = []
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_unix_server(self._serve, path=self.path)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length)
        self.seen.append(head.split(b"\r\n", 1)[0].decode() + (f" {body.decode()}" if body else ""))
        for piece in self.answer(head):
            writer.write(piece)
            await writer.drain()
        writer.close()


def dechunk(body: bytes) -> bytes:
    """A chunked body's content, read by the one parser as exchange() reads an answer."""
    parts: list[bytes] = []
    parser = AnswerParser(parts.append)
    parser.begin("GET")
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    if not parser.closed():
        raise EngineConnectionError("a chunked answer ends in the middle")
    return b"".join(parts)


def json_answer(status: int, body: object) -> list[bytes]:
    data = json.dumps(body).encode()
    return [f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data]


@pytest.fixture
async def where() -> AsyncIterator[Path]:
    with tempfile.TemporaryDirectory(prefix="eh", dir="/tmp") as d:   # sun_path: 108 bytes
        yield Path(d)


async def test_an_answer_in_any_framing_and_pieces_reads_the_same(where: Path) -> None:
    chunked = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\nhel",
               b"lo\r\n6;x=1\r\n world\r\n0\r\n\r\n"]
    byte_by_byte = [bytes([b]) for b in json_answer(200, {"ok": 1})[0]]
    for pieces, expect in ((chunked, b"hello world"), (byte_by_byte, b'{"ok": 1}')):
        def answer(head: bytes, pieces: list[bytes] = pieces) -> list[bytes]:
            return pieces
        async with Scripted(str(where / "e.sock"), answer) as engine:
            status, body = await exchange(engine.path, "POST", "/x", b'{"a":1}', timeout=2)
        assert (status, body) == (200, expect)
        assert engine.seen == ['POST /x HTTP/1.1 {"a":1}']


async def test_no_engine_garbage_and_silence_are_errors_in_bounded_time(where: Path) -> None:
    with pytest.raises(OSError):
        await exchange(str(where / "none.sock"), "GET", "/health", timeout=2)
    async with Scripted(str(where / "g.sock"), lambda head: [b"SSH-2.0-OpenSSH\r\n"]) as g:
        with pytest.raises(EngineConnectionError):
            await exchange(g.path, "GET", "/health", timeout=2)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)
    server = await asyncio.start_unix_server(silent, path=str(where / "s.sock"))
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await exchange(str(where / "s.sock"), "GET", "/health", timeout=0.2)
        assert loop.time() - started < 2
    finally:
        server.close()
    with pytest.raises(EngineConnectionError):
        dechunk(b"5\r\nhel")


async def test_a_restore_goes_straight_to_the_saved_parallel_slots(where: Path) -> None:
    """No GET /slots first (a round trip on the cold start's path); a parallel slot the engine
    says it does not have (400) drops its file, the others are restored and counted."""
    cache = KvCache(where / "kv", max_bytes=1 << 20)
    directory = cache.prepare("m", "stamp")
    for slot_id in (0, 7):
        (directory / f"slot-{slot_id}.bin").write_bytes(b"kv")

    def answer(head: bytes) -> list[bytes]:
        if head.startswith(b"POST /slots/7"):
            return json_answer(400, {"error": {"message": "Invalid slot ID"}})
        return json_answer(200, {"id_slot": 0, "n_restored": 20})

    async with Scripted(str(where / "e.sock"), answer) as engine:
        assert await cache.restore("m", engine.path, "m") == 20
    assert engine.seen == [
        'POST /slots/0?action=restore HTTP/1.1 {"filename": "slot-0.bin"}',
        'POST /slots/7?action=restore HTTP/1.1 {"filename": "slot-7.bin"}']
    assert (directory / "slot-0.bin").exists() and not (directory / "slot-7.bin").exists()
    assert cache.counts == {("restore", "ok"): 1}

    async with Scripted(str(where / "e.sock"),
                        lambda head: json_answer(500, {"error": {"message": "x"}})) as engine:
        assert await cache.restore("m", engine.path, "m") == 0   # failed: counted, not raised
    assert (directory / "slot-0.bin").exists() and cache.counts[("restore", "failed")] == 1


async def test_an_engine_setup_seen_before_is_not_asked_its_parallel_slots_again(
        where: Path) -> None:
    client = EngineClient(5.0)
    known: dict[str, int] = {}

    async def engine_with(slots: int, path: str) -> Scripted:
        return Scripted(path, lambda head: json_answer(200, {"total_slots": slots}))

    async with await engine_with(2, str(where / "a.sock")) as first:
        assert await learn_parallel_slots(client, first.path, known=known, setup="s1") == 2
    assert first.seen == ["GET /props HTTP/1.1"] and known == {"s1": 2}
    assert client.limit(first.path) == 3
    async with await engine_with(6, str(where / "b.sock")) as again:
        assert await learn_parallel_slots(client, again.path, known=known, setup="s1") == 2
        assert again.seen == [] and client.limit(again.path) == 3   # not asked
        assert await learn_parallel_slots(client, again.path, known=known, setup="s2") == 6
        assert again.seen == ["GET /props HTTP/1.1"]                 # another setup: asked
    await client.close()


@pytest.mark.parametrize("size", [b"-6", b"-5", b"-0", b"+5", b"0x5", b"5_0", b" 5", b"", b"g",
                                  b"1" * 16, b"5\x00"])
async def test_a_chunk_size_that_is_not_plain_hex_is_refused(where: Path, size: bytes) -> None:
    """int(x, 16) also takes a sign, 0x, underscores and spaces: "-5" walked dechunk back
    over the same bytes for ever (a hostile engine froze the event loop)."""
    with pytest.raises(EngineConnectionError, match="hex digits"):   # (in a thread: a loop for
        await asyncio.wait_for(asyncio.to_thread(                # ever fails, not hangs)
            dechunk, size + b"\r\nhello\r\n0\r\n\r\n"), 5)
    answer = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size
              + b"\r\nhello\r\n0\r\n\r\n"]
    async with Scripted(str(where / "e.sock"), lambda head: answer) as engine:
        with pytest.raises(EngineConnectionError):
            await asyncio.wait_for(exchange(engine.path, "GET", "/slots", timeout=2), 5)
        # the probes that ran dechunk on the event loop: an engine not ready, not a freeze
        assert await UnixHealthProbe().status(engine.path) is None
    assert dechunk(b"5;ext=1 \r\nhello\r\nA\r\n0123456789\r\n0\r\n\r\n") == b"hello0123456789"


async def test_an_answer_past_its_bound_is_refused_not_cut(where: Path) -> None:
    body = b"x" * 3000
    answer = [b"HTTP/1.1 200 OK\r\nContent-Length: 3000\r\n\r\n" + body]
    async with Scripted(str(where / "e.sock"), lambda head: answer) as engine:
        with pytest.raises(EngineConnectionError, match="over 1000 bytes"):
            await exchange(engine.path, "GET", "/slots", timeout=2, max_answer=1000)
        assert await exchange(engine.path, "GET", "/slots", timeout=2) == (200, body)
