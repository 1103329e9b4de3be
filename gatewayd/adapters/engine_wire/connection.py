"""One connection to an engine's socket: sends a request, takes its answer as it arrives.

The answer's bytes go through framing.AnswerParser; what this adds is the connection's
life around it:
- the body's pieces either wait here for a reader (read_some) or go straight to a sink
  from data_received (relay_to: no task wakes up per streamed event);
- flow control: reading from the engine pauses while more than HIGH_WATER bytes wait
  for a slow reader, or while the sink's own output drains (hold/resume);
- the read timer: no byte for read_timeout_s fails the wait (aiohttp's sock_read), with
  one timer per connection re-armed lazily instead of one per read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from multidict import CIMultiDict

from gatewayd.adapters.engine_wire.errors import BadFraming, EngineConnectionError
from gatewayd.adapters.engine_wire.framing import DONE, AnswerParser

if TYPE_CHECKING:
    from gatewayd.adapters.engine_wire.pool import Pool

HIGH_WATER = 256 * 1024       # unread answer bytes before reading pauses


class Connection(asyncio.Protocol):
    """One connection: sends a request, parses the answer as it arrives."""

    def __init__(self, pool: Pool, read_timeout_s: float) -> None:
        self._pool = pool
        self.read_timeout_s = read_timeout_s
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.reusable = True          # the caller's wish; the answer may still say close
        self.idle_since = 0.0
        self._in_use = False          # between send() and finish()/abort()
        self._parser = AnswerParser(self._push)
        self._got_bytes = False       # any byte of the current answer arrived
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
        if not self._parser.closed():
            why = f": {exc}" if exc else ""
            if isinstance(exc, BrokenPipeError | ConnectionResetError) \
                    and not self._got_bytes:
                # the request was not read whole by any process: EPIPE, the engine's end
                # was closed when it was written (a process that died a moment ago, its
                # end not seen closed yet); ECONNRESET, the end closed with bytes of ours
                # in it unread (Linux's unix sockets say so; one that read the request
                # and then died closes with nothing unread: an end of file)
                self._fail(EngineConnectionError(
                    f"the engine was gone before it read the request{why}", fresh=True,
                    connect=True))
            elif self._got_bytes:
                self._fail(EngineConnectionError(
                    f"the engine closed the connection in the middle of its answer{why}"))
            else:
                self._fail(EngineConnectionError(
                    f"the engine closed the connection before answering{why}", fresh=True))
        self._wake()

    def data_received(self, data: bytes) -> None:
        self._last_io = self._loop.time()
        self._got_bytes = True
        parser = self._parser
        if self._chunk_sink is not None and (size := parser.whole_chunk(data)):
            # a read that is one whole chunk: offered as it is (relay_to)
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
            parser.feed(data)
        except EngineConnectionError as e:
            if isinstance(e, BadFraming):
                self._pool.refused["framing"] += 1
            self._fail(e)
            self.abort()
        if self._sink is None or parser.state == DONE or self._error is not None:
            self._wake()   # (a sink takes the pieces itself: nobody to wake per piece)

    # -- the request -----------------------------------------------------------------

    def send(self, head: bytes, body: bytes, method: str) -> None:
        if not self.open or self.transport is None or self.transport.is_closing():
            raise EngineConnectionError("the connection was closed", fresh=True, connect=True)
        self._in_use = True
        self._parser.begin(method)
        self._got_bytes = False
        self._body.clear()
        self._buffered = 0
        self._error = None
        self._sink = self._chunk_sink = None
        self._held = False
        self._last_io = self._loop.time()
        if body and len(body) > 16384:
            self.transport.writelines((head, body))   # no copy of a large upload
        else:
            self.transport.write(head + body)

    async def head(self) -> tuple[int, str, CIMultiDict[str]]:
        while (head := self._parser.head) is None:
            if self._error is not None:
                raise self._error
            await self._wait()
        return head

    async def read_some(self) -> bytes:
        """What has arrived of the body, waiting for something; b"" at its end."""
        body = self._body
        while not body:
            if self._error is not None:
                raise self._error
            if self._parser.state == DONE:
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
            if self._parser.state == DONE:
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
        if self._parser.state == DONE and self._parser.keep_alive and self.reusable \
                and self.open and not self._body and self._error is None:
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
            self._timer = self._loop.call_at(self._last_io + self.read_timeout_s, self._check)
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
        if self._parser.state == DONE or not self._in_use:
            return
        due = self._last_io + self.read_timeout_s
        if self._paused:    # our client is slow, not the engine
            due = self._loop.time() + self.read_timeout_s
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self._time_out()

    def _time_out(self) -> None:
        self._fail(TimeoutError(f"no answer from the engine for {self.read_timeout_s:g} s"))
        self._wake()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.reusable = False

