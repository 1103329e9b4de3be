"""HTTP/1.1 to the local engines over their unix sockets, spoken by hand.

The hot path's client. aiohttp's ClientSession costs ~30 µs of CPU per request
(a ClientRequest with its auto headers, trace hooks, a timer per read, a
StreamReader) and ~10 µs per streamed event; an engine is a known peer on a
private socket (llama-server, whisper-server behind the launcher), so this
speaks just what they answer (bench/hotpath.py measures both):

- requests with a body of known length (the gateway has read the client's body);
- answers framed by Content-Length, by chunked transfer coding, or by the close of
  the connection; 1xx answers are skipped; a HEAD, 204 or 304 has no body;
- keep-alive: per socket a LIFO pool of idle connections, each reused within
  `keepalive_s` (llama-server closes them after 5 s) and never after the engine
  said `Connection: close`; a request that finds its reused connection closed by
  the engine before any byte of the answer is sent once more on a new connection;
- at most `limit` connections per socket at once (llama-server's HTTP threads are
  held by idle keep-alive connections: past them it stalls), the rest wait their
  turn here, first come first served;
- timeouts: connecting (a dead socket fails at once anyway), and reading: no byte
  for `read_timeout_s` fails the wait (aiohttp's sock_read), with one timer per
  connection re-armed lazily instead of one per read;
- flow control: reading from the engine pauses while more than HIGH_WATER bytes
  wait for a slow client.
Remote upstreams (TLS, redirects, any server) keep aiohttp's client.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Callable, Iterable
from typing import cast

from multidict import CIMultiDict

from gatewayd.adapters.engine_http import chunk_size
from gatewayd.core.config import GatewayConfig

MAX_HEAD = 64 * 1024          # an answer's status line and headers (and, apart, its trailers)
MAX_CHUNK_LINE = 4096         # a chunk-size line (with extensions)
HIGH_WATER = 256 * 1024       # unread answer bytes before reading pauses
NO_BODY_STATUSES = frozenset({204, 304})


class EngineConnectionError(Exception):
    """The engine could not be reached, or the connection broke or spoke nonsense.

    fresh: nothing of an answer arrived (the request may be sent again when the
    connection was a reused one); connect: the connection itself could not be made, and
    the request was sent on no other (it reached no engine process: safe to send again
    to the engine that replaces this one)."""

    def __init__(self, message: str, *, fresh: bool = False, connect: bool = False) -> None:
        super().__init__(message)
        self.fresh = fresh
        self.connect = connect


class BadFraming(EngineConnectionError):
    """The engine's answer broke HTTP/1.1's framing or went past a bound (a head or a chunk
    line too long, a chunk size that is not plain hex): refused, never waited out."""


class AnswerTooLarge(EngineConnectionError):
    """A body read whole (EngineResponse.read) went past the limit it was read with."""


class ConnectionsBusy(Exception):
    """None of an engine's connections came free in time: all it serves at once are in
    use, and the request waited for one for the client's queue time (read_timeout_s)."""


class ConnectionsQueueFull(ConnectionsBusy):
    """As many requests as the queue limit already wait for the engine's connections: the
    next is refused at once rather than held (with its body) for up to read_timeout_s."""


class EngineResponse:
    """An engine's answer: status and headers at once, the body as it arrives."""

    def __init__(self, conn: _Connection, pool: _Pool, status: int, reason: str,
                 headers: CIMultiDict[str]) -> None:
        self._conn = conn
        self._pool: _Pool | None = pool    # holds one of its connection slots until done
        self.status = status
        self.reason = reason
        self.headers = headers

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; AnswerTooLarge (the connection closed) past limit bytes."""
        parts = []
        size = 0
        while data := await self._conn.read_some():
            size += len(data)
            if limit is not None and size > limit:
                self.close()
                raise AnswerTooLarge(f"the engine's answer is over {limit} bytes")
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read_some(self) -> bytes:
        """The next piece of the body: whatever has arrived since the last (one streamed
        event per piece while the engine writes them one at a time); b"" at its end."""
        return await self._conn.read_some()

    def relay_to(self, sink: Callable[[bytes], None],
                 chunk_sink: Callable[[bytes, int], bool] | None = None) -> None:
        """From now on each piece of the body goes to sink the moment it arrives, from the
        connection's data_received: no task wakes up per piece (a streamed event costs
        the relay ~a third less CPU). What was buffered goes to it first. sink must not
        raise; it calls hold() to stop the flow while its own output drains.

        chunk_sink, if given, is offered each read that is exactly one whole chunk of a
        chunked body, framing and all, with its data's size (a stream's usual read: one
        event, one chunk). It returns True if it took the chunk, False to have its data go
        to sink as any other piece. A relay whose output is framed the same way sends it
        on as it came, instead of taking the framing off here and putting it back on."""
        self._conn.set_sink(sink, chunk_sink)

    def hold(self) -> None:
        """Stop reading from the engine, and wake wait_end (sink's output is full)."""
        self._conn.hold()

    async def wait_end(self) -> bool:
        """With a sink: True once the body is complete, False when woken by hold() (drain
        the output, then resume()). Raises what ended the body otherwise."""
        return await self._conn.wait_end()

    def resume(self) -> None:
        self._conn.resume()

    @property
    def read_timeout_s(self) -> float:
        return self._conn._read_timeout

    def detach(self) -> int | None:
        """For http/native_relay: a duplicate of the connection's socket, to be read
        elsewhere until reattach(), its reading here paused and its read timer off; None
        if the body is not chunked or not between two chunks, or something of it is
        buffered here (the relay then stays in Python)."""
        return self._conn.detach()

    def reattach(self, unread: bytes, idle_s: float) -> None:
        """Reading back here, with the bytes read elsewhere and not used (parsed as if
        they had just arrived); idle_s: since the engine's last byte."""
        self._conn.reattach(unread, idle_s)

    def release(self) -> None:
        """Done with it: a complete answer on a reusable connection goes back to the pool,
        anything else is closed. Idempotent."""
        self._conn.finish()
        self._give_back_slot()

    def close(self) -> None:
        """Drop the connection now (the client left: the engine stops generating)."""
        self._conn.abort()
        self._give_back_slot()

    def _give_back_slot(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.release_slot()


class EngineClient:
    """Connections to engine sockets, created on first use."""

    def __init__(self, read_timeout_s: float, *, connect_timeout_s: float = 10.0,
                 keepalive_s: float = 4.0, queue_timeout_s: float | None = None,
                 queue_limit: int = GatewayConfig.queue_limit) -> None:
        self.read_timeout_s = read_timeout_s
        # requests waiting for a socket's connections, unless set_queue_limit said otherwise
        self.queue_limit = queue_limit
        # answers refused by a bound, by which (the metrics' llm_gateway_bounded)
        self.refused: collections.Counter[str] = collections.Counter()
        # the longest wait for one of an engine's connections (the limit's queue); the
        # client has heard nothing meanwhile, as in a silence of the engine's
        self.queue_timeout_s = read_timeout_s if queue_timeout_s is None else queue_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._pools: dict[str, _Pool] = {}

    def set_limit(self, socket: str, limit: int | None) -> None:
        """At most limit connections to socket at once (None: no limit); requests beyond
        it wait here, first come first served."""
        pool = self._pool(socket)
        pool.limit = None if limit is None else max(1, limit)
        pool.admit()

    def set_queue_limit(self, socket: str, queue_limit: int | None) -> None:
        """At most queue_limit requests waiting for socket's connections (None: the
        client's queue_limit); one more is refused at once (ConnectionsQueueFull)."""
        self._pool(socket).queue_limit = queue_limit

    def limit(self, socket: str) -> int | None:
        pool = self._pools.get(socket)
        return pool.limit if pool else None

    def in_use(self, socket: str) -> int:
        pool = self._pools.get(socket)
        return pool.busy if pool else 0

    def waiting(self, socket: str) -> int:
        pool = self._pools.get(socket)
        return len(pool.waiters) if pool else 0

    def pooled(self, socket: str) -> bool:
        """Whether idle keep-alive connections to socket are kept."""
        pool = self._pools.get(socket)
        return pool is not None and any(conn.open for conn in pool.idle)

    async def request(self, socket: str, method: str, target: str,
                      headers: Iterable[tuple[str, str]], body: bytes, *,
                      reuse: bool = True, queue: bool = True) -> EngineResponse:
        """Send one request and wait for the answer's head. reuse=False: a connection of
        its own, closed at the end (llama-server closes after every stream anyway).
        queue=False: not counted against the limit (an operator's look at the engine, such
        as its /metrics, must not wait behind inference; the engine keeps spare HTTP
        threads for those). Raises ConnectionsBusy when no connection came free for
        queue_timeout_s, EngineConnectionError, or TimeoutError when no byte
        came in time."""
        pool = self._pool(socket)
        head = _request_head(method, target, headers, len(body),
                             body_expected=bool(body) or method in ("POST", "PUT", "PATCH"))
        if not queue:
            pool = _Pool(self.keepalive_s, None, self.refused)   # its own: no slot, no reuse
            reuse = False
        queue_limit = self.queue_limit if pool.queue_limit is None else pool.queue_limit
        await pool.acquire(self.queue_timeout_s, queue_limit)
        try:
            for attempt in (1, 2):
                conn = pool.idle_connection() if reuse and attempt == 1 else None
                reused = conn is not None
                if conn is None:
                    try:
                        conn = await self._connect(socket, pool)
                    except EngineConnectionError as e:
                        e.connect = attempt == 1   # else: sent once, on the reused one
                        raise
                conn.reusable = reuse
                try:
                    conn.send(head, body, method)
                    status, reason, answer_headers = await conn.head()
                except EngineConnectionError as e:
                    conn.abort()
                    if reused and e.fresh:
                        continue   # the engine had closed it: once more, on a new one
                    raise
                except BaseException:
                    conn.abort()
                    raise
                return EngineResponse(conn, pool, status, reason, answer_headers)
            raise AssertionError("unreachable")
        except BaseException:
            pool.release_slot()
            raise

    async def _connect(self, socket: str, pool: _Pool) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_unix_connection(
                    lambda: _Connection(pool, self.read_timeout_s), socket)
        except TimeoutError:
            raise EngineConnectionError(f"connecting to {socket} timed out", fresh=True,
                                        connect=True) from None
        except OSError as e:
            raise EngineConnectionError(f"cannot connect to {socket}: {e.strerror or e}",
                                        fresh=True, connect=True) from e
        return conn

    def _pool(self, socket: str) -> _Pool:
        pool = self._pools.get(socket)
        if pool is None:
            pool = self._pools[socket] = _Pool(self.keepalive_s, None, self.refused)
        return pool

    def forget(self, socket: str) -> None:
        """The engine behind socket is gone: close its idle connections now (they would
        hold descriptors until the engine's side times out)."""
        pool = self._pools.pop(socket, None)
        if pool is not None:
            pool.close_idle()

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close_idle()
        self._pools.clear()


class _Pool:
    """One socket's idle connections (newest last) and its connection slots."""

    def __init__(self, keepalive_s: float, limit: int | None,
                 refused: collections.Counter[str]) -> None:
        self.keepalive_s = keepalive_s
        self.limit = limit
        self.queue_limit: int | None = None   # None: the client's
        self.refused = refused
        self.idle: list[_Connection] = []
        self.busy = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self, timeout: float | None, queue_limit: int) -> None:
        if not self.waiters and (self.limit is None or self.busy < self.limit):
            self.busy += 1
            return
        if len(self.waiters) >= queue_limit:
            raise ConnectionsQueueFull(f"{len(self.waiters)} requests already wait for the "
                                       f"engine's connections (queue_limit {queue_limit})")
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter       # _admit counted the slot as ours before waking us
        except BaseException as e:
            handed = waiter.done() and not waiter.cancelled()
            if isinstance(e, TimeoutError):
                if handed:
                    return         # handed a slot as the time ran out: it is ours
                self.waiters.remove(waiter)
                raise ConnectionsBusy(f"all {self.limit} of the engine's connections stayed "
                                      f"busy for {timeout:g} s") from None
            if handed:
                self.release_slot()   # handed a slot just as we were cancelled: pass it on
            else:
                self.waiters.remove(waiter)
            raise

    def release_slot(self) -> None:
        self.busy -= 1
        self.admit()

    def admit(self) -> None:
        """Hand free slots to the first waiters (after a release, or a higher limit)."""
        while self.waiters and (self.limit is None or self.busy < self.limit):
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.busy += 1
                waiter.set_result(None)

    def idle_connection(self) -> _Connection | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if conn.open and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    def put_back(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def close_idle(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.abort()


_HEAD, _BODY, _DONE = range(3)
_LENGTH, _CHUNKED, _UNTIL_CLOSE = range(3)


class _Connection(asyncio.Protocol):
    """One connection: sends a request, parses the answer as it arrives."""

    def __init__(self, pool: _Pool, read_timeout_s: float) -> None:
        self._pool = pool
        self._read_timeout = read_timeout_s
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.reusable = True
        self.idle_since = 0.0
        self._in_use = False          # between send() and finish()/abort()
        self._state = _DONE
        self._method = "GET"
        self._buffer = b""            # bytes of a head or chunk framing not yet parsed
        self._got_bytes = False       # any byte of the current answer arrived
        self._head: tuple[int, str, CIMultiDict[str]] | None = None
        self._framing = _LENGTH
        self._left = 0                # body bytes (LENGTH) or chunk bytes (CHUNKED) to come
        self._need_crlf = False       # after a chunk's data
        self._trailers = False        # after the last chunk
        self._trailer_bytes = 0
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._error: BaseException | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._chunk_sink: Callable[[bytes, int], bool] | None = None
        self._held = False            # the sink asked for a pause (its output is full)
        self._waiter: asyncio.Future[None] | None = None
        self._last_io = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)   # (uvloop's: no subclass)
        self.open = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._cancel_timer()
        if self._state == _BODY and self._framing == _UNTIL_CLOSE:
            self._state = _DONE
        elif self._state != _DONE:
            why = f": {exc}" if exc else ""
            if self._got_bytes:
                self._fail(EngineConnectionError(
                    f"the engine closed the connection in the middle of its answer{why}"))
            else:
                self._fail(EngineConnectionError(
                    f"the engine closed the connection before answering{why}", fresh=True))
        self._wake()

    def data_received(self, data: bytes) -> None:
        self._last_io = self._loop.time()
        self._got_bytes = True
        if self._chunk_sink is not None and self._state == _BODY and self._at_chunk_start():
            # a read that is one whole chunk: offered as it is (relay_to), if its size is
            # written plainly (lowercase hex, as llama-server's), since it goes on as written
            eol = data.find(b"\r\n", 0, MAX_CHUNK_LINE)
            if eol > 0:
                line = data[:eol]
                try:
                    size = int(line, 16)
                except ValueError:   # an extension, or bad: the parser below says which
                    size = 0
                if size > 0 and len(data) == eol + size + 4 and data.endswith(b"\r\n") \
                        and b"%x" % size == line:
                    try:
                        if self._chunk_sink(data, size):
                            return
                    except Exception as e:   # never out of data_received (as in _push)
                        self._chunk_sink = self._sink = None
                        self._fail(EngineConnectionError(f"relaying the answer failed: {e!r}"))
                        self.abort()
                        self._wake()
                        return
        try:
            if self._state == _HEAD:
                data = self._parse_head(data)
            if self._state == _BODY and data:
                if self._framing == _CHUNKED:
                    self._parse_chunks(data)
                elif self._framing == _LENGTH:
                    self._take_length(data)
                else:
                    self._push(data)
            elif self._state == _DONE and data:
                raise EngineConnectionError("the engine sent bytes after its answer")
        except EngineConnectionError as e:
            if isinstance(e, BadFraming):
                self._pool.refused["framing"] += 1
            self._fail(e)
            self.abort()
        if self._sink is None or self._state == _DONE or self._error is not None:
            self._wake()   # (a sink takes the pieces itself: nobody to wake per piece)

    # -- the request -----------------------------------------------------------------

    def send(self, head: bytes, body: bytes, method: str) -> None:
        if not self.open or self.transport is None or self.transport.is_closing():
            raise EngineConnectionError("the connection was closed", fresh=True)
        self._in_use = True
        self._state = _HEAD
        self._method = method
        self._buffer = b""
        self._got_bytes = False
        self._head = None
        self._body.clear()
        self._buffered = 0
        self._error = None
        self._sink = self._chunk_sink = None
        self._held = False
        self._need_crlf = self._trailers = False
        self._last_io = self._loop.time()
        if body and len(body) > 16384:
            self.transport.writelines((head, body))   # no copy of a large upload
        else:
            self.transport.write(head + body)

    async def head(self) -> tuple[int, str, CIMultiDict[str]]:
        while self._head is None:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self._head

    async def read_some(self) -> bytes:
        """What has arrived of the body, waiting for something; b"" at its end."""
        body = self._body
        while not body:
            if self._error is not None:
                raise self._error
            if self._state == _DONE:
                return b""
            await self._wait()
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        self._resume_reading()
        return data

    def set_sink(self, sink: Callable[[bytes], None],
                 chunk_sink: Callable[[bytes, int], bool] | None = None) -> None:
        body = self._body
        self._buffered = 0
        self._resume_reading()
        self._sink = sink
        self._chunk_sink = chunk_sink
        pending = list(body)
        body.clear()
        try:
            for piece in pending:
                self._push(piece)
        except EngineConnectionError as e:
            self._fail(e)
            self.abort()
            self._wake()

    def hold(self) -> None:
        self._held = True
        self._pause_reading()
        self._wake()

    def resume(self) -> None:
        self._held = False
        self._resume_reading()

    def detach(self) -> int | None:
        transport = self.transport
        if transport is None or not self.open or transport.is_closing() or self._paused \
                or self._state != _BODY or not self._at_chunk_start() or self._body \
                or self._error is not None or self._sink is not None:
            return None
        sock = transport.get_extra_info("socket")
        if sock is None:
            return None
        fd = os.dup(sock.fileno())
        self._pause_reading()
        self._cancel_timer()
        return fd

    def reattach(self, unread: bytes, idle_s: float) -> None:
        self._last_io = self._loop.time() - idle_s
        self._resume_reading()
        if unread:
            self.data_received(unread)
            self._last_io = self._loop.time() - idle_s
        if idle_s >= self._read_timeout and self._state != _DONE:
            self._time_out()

    def _pause_reading(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    async def wait_end(self) -> bool:
        while True:
            if self._error is not None:
                raise self._error
            if self._state == _DONE:
                return True
            if self._held:
                return False
            await self._wait()

    def finish(self) -> None:
        """The caller is done: back to the pool if the answer was whole and the connection
        may be reused, else closed."""
        if not self._in_use:
            return
        self._in_use = False
        self._cancel_timer()
        if self._state == _DONE and self.reusable and self.open and not self._body \
                and self._error is None:
            self._pool.put_back(self)
        else:
            self._close_transport()

    def abort(self) -> None:
        """Close now, answer or not (idempotent)."""
        self.reusable = False
        self._in_use = False
        self._cancel_timer()
        self._close_transport()

    def _close_transport(self) -> None:
        self.open = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # -- parsing ---------------------------------------------------------------------

    def _parse_head(self, data: bytes) -> bytes:
        """Consume the head (skipping 1xx answers); returns the bytes after it."""
        data = self._buffer + data if self._buffer else data
        while True:
            end = data.find(b"\r\n\r\n")
            if end == -1:
                if len(data) > MAX_HEAD:
                    raise BadFraming(f"the engine's answer head is over {MAX_HEAD} bytes")
                self._buffer = data
                return b""
            head, data = data[:end], data[end + 4:]
            status, reason, headers, keep_alive = _parse_head(head)
            if 100 <= status < 200:
                continue        # 100 Continue and friends: the real answer follows
            self._buffer = b""
            if not keep_alive:
                self.reusable = False
            self._head = (status, reason, headers)
            self._state = _BODY
            if self._method == "HEAD" or status in NO_BODY_STATUSES:
                self._state = _DONE
            elif "chunked" in headers.get("Transfer-Encoding", "").lower():
                self._framing = _CHUNKED
                self._left = 0
                self._trailer_bytes = 0
            elif (length := headers.get("Content-Length")) is not None:
                if not length.isascii() or not length.strip().isdigit():
                    raise BadFraming(f"bad Content-Length {length[:40]!r}")
                self._framing = _LENGTH
                self._left = int(length)
                if self._left == 0:
                    self._state = _DONE
            else:
                self._framing = _UNTIL_CLOSE
                self.reusable = False
            return data

    def _take_length(self, data: bytes) -> None:
        if len(data) > self._left:
            raise EngineConnectionError("the engine sent more than its Content-Length")
        self._left -= len(data)
        self._push(data)
        if self._left == 0:
            self._state = _DONE

    def _at_chunk_start(self) -> bool:
        """The chunked body's parser is between chunks, with nothing held back."""
        return (self._framing == _CHUNKED and not self._left and not self._buffer
                and not self._need_crlf and not self._trailers)

    def _parse_chunks(self, data: bytes) -> None:
        if self._buffer:
            data = self._buffer + data
            self._buffer = b""
        pos, end = 0, len(data)
        while pos < end:
            if self._left:
                take = min(self._left, end - pos)
                self._push(data if take == end else data[pos:pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    self._need_crlf = True
                continue
            if self._need_crlf:
                if end - pos < 2:
                    self._buffer = data[pos:]
                    return
                if data[pos:pos + 2] != b"\r\n":
                    raise EngineConnectionError("bad chunked encoding from the engine")
                pos += 2
                self._need_crlf = False
                continue
            eol = data.find(b"\r\n", pos)
            if eol == -1:
                if end - pos > MAX_CHUNK_LINE:
                    raise BadFraming("bad chunked encoding from the engine: a chunk line "
                                     f"over {MAX_CHUNK_LINE} bytes")
                self._buffer = data[pos:]
                return
            line, pos = data[pos:eol], eol + 2
            if self._trailers:
                if not line:            # the blank line after the last chunk (and trailers)
                    self._state = _DONE
                    if pos < end:
                        raise EngineConnectionError("the engine sent bytes after its answer")
                    return
                # dropped, but not without end: an engine writing trailers for ever
                self._trailer_bytes += len(line) + 2
                if self._trailer_bytes > MAX_HEAD:
                    raise BadFraming(f"the engine's trailers are over {MAX_HEAD} bytes")
                continue
            size = chunk_size(line)
            if size is None:
                raise BadFraming("bad chunked encoding from the engine: chunk size "
                                 f"{line[:40]!r} is not up to 15 hex digits")
            if size == 0:
                self._trailers = True
            else:
                self._left = size

    def _push(self, data: bytes) -> None:
        if self._sink is not None:
            try:
                self._sink(data)
            except Exception as e:   # never out of data_received: the answer ends, clearly
                self._sink = self._chunk_sink = None
                raise EngineConnectionError(f"relaying the answer failed: {e!r}") from e
            return
        self._body.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._pause_reading()

    # -- waiting ---------------------------------------------------------------------

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        if self._timer is None:
            self._timer = self._loop.call_at(self._last_io + self._read_timeout, self._check)
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _check(self) -> None:
        """The read timer: fails the wait when nothing came for read_timeout_s."""
        self._timer = None
        if self._state == _DONE or not self._in_use:
            return
        due = self._last_io + self._read_timeout
        if self._paused:    # our client is slow, not the engine
            due = self._loop.time() + self._read_timeout
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self._time_out()

    def _time_out(self) -> None:
        self._fail(TimeoutError(f"no answer from the engine for {self._read_timeout:g} s"))
        self._wake()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.reusable = False


def _request_head(method: str, target: str, headers: Iterable[tuple[str, str]],
                  length: int, *, body_expected: bool) -> bytes:
    """The request line and headers. The headers come from the client's request, already
    parsed by aiohttp's server (which refuses CR and LF in them) less the hop-by-hop ones."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: engine\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers
                 if "\n" not in value and "\r" not in value)   # (never one, but never twice)
    if body_expected:
        lines.append(f"Content-Length: {length}\r\n")
    lines.append("\r\n")
    # aiohttp decoded the client's bytes as UTF-8 with surrogateescape: the same bytes go on
    return "".join(lines).encode("utf-8", "surrogateescape")


def _parse_head(head: bytes) -> tuple[int, str, CIMultiDict[str], bool]:
    """(status, reason, headers, keep-alive) of an answer's head."""
    text = head.decode("latin-1")
    status_line, _, rest = text.partition("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or len(parts[1]) != 3 \
            or not parts[1].isascii() or not parts[1].isdigit():   # (isdigit: also "²")
        raise BadFraming(f"not an HTTP answer from the engine: {status_line[:80]!r}")
    headers: CIMultiDict[str] = CIMultiDict()
    if rest:
        for line in rest.split("\r\n"):
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise BadFraming(f"bad header line from the engine: {line[:80]!r}")
            headers.add(name, value.strip())
    connection = headers.get("Connection", "").lower()
    keep_alive = "close" not in connection if parts[0] == "HTTP/1.1" else \
        "keep-alive" in connection
    return int(parts[1]), parts[2] if len(parts) > 2 else "", headers, keep_alive
