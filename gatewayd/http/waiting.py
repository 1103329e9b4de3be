"""A waiting stream hears why: SSE comment lines to a streamed request's client while the
gateway waits on its behalf (a download, its model's turn, room, the load), and the
stream's end when what it waited for fails after the first line.

What to say is core/progress's (pure); this module asks the dispatcher, the engine
manager and the puller what they know, and writes. The first line sends the stream's 200
and its SSE head (`Progress.response`): from then on the relay writes the answer into
that response (`proxy.Outgoing.response`), and an error, which can no longer have a
status of its own, ends the stream as its format's error event (`Progress.end`, the same
event an engine breaking off gets).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
from aiohttp import web

from gatewayd.adapters.records import CallRecord
from gatewayd.core import progress
from gatewayd.core.errors import ErrorSource, GatewayError
from gatewayd.http.middleware import withhold_engine_logs
from gatewayd.http.sse import SSE_HEADERS, error_event, stream_format
from gatewayd.service.dispatcher import Dispatcher
from gatewayd.service.engine_manager import EngineManager
from gatewayd.service.pulls import Puller

T = TypeVar("T")


class ClientLeft(Exception):
    """The client went while its stream was told of the wait (a line could not be sent):
    nothing is left to say; the handler returns the response (the record says so)."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("the client left while waiting")
        self.response = response


class Progress:
    """One streamed request's waits, told to its client (core/progress)."""

    def __init__(self, request: web.Request, record: CallRecord, t0: float, model_id: str, *,
                 dispatcher: Dispatcher, engines: EngineManager, puller: Puller | None,
                 stall_timeout_s: float) -> None:
        self._request = request
        self._record = record
        self._t0 = t0
        self._model_id = model_id
        self._dispatcher = dispatcher
        self._engines = engines
        self._puller = puller
        self._stall_timeout_s = stall_timeout_s
        self._next: float | None = None   # when the next line is due (monotonic)
        self.response: web.StreamResponse | None = None   # once a line sent the 200

    async def wait(self, waiting: Awaitable[T],
                   undo: Callable[[T], object] | None = None) -> T:
        """waiting's result, a line sent to the client every few seconds meanwhile (the
        first progress.FIRST_S after the first wait began). Given up (the client went,
        or cancelled), the wait is cancelled; one that was over by then is undone (undo:
        a turn taken is given back)."""
        task = asyncio.ensure_future(waiting)
        if self._next is None:
            self._next = time.monotonic() + progress.FIRST_S
        try:
            while True:
                await asyncio.wait({task}, timeout=max(0.0, self._next - time.monotonic()))
                if task.done():
                    return task.result()
                await self._say()
                self._next = time.monotonic() + progress.EVERY_S
        except BaseException:
            if not task.done():
                task.cancel()     # its place in the queue is left
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            elif not task.cancelled() and task.exception() is None and undo is not None:
                undo(task.result())
            raise

    async def end(self, error: GatewayError) -> web.StreamResponse:
        """A failure after the 200: the stream ends with the error event of its format (the
        engine's log lines withheld, as from any answer to an inference caller)."""
        assert self.response is not None
        withhold_engine_logs(error)
        record = self._record
        record.stream, record.status = True, self.response.status
        record.outcome, record.error_code = "error", error.code
        record.error_source = ErrorSource.GATEWAY.value   # the event is ours
        with contextlib.suppress(ClientLeft):
            await self._send(error_event(stream_format(self._request.path), error))
            await self._bounded(self.response.write_eof())
        return self.response

    def left(self) -> None:
        """The client went after the 200 and before the answer began: the record says so."""
        record = self._record
        record.stream, record.status = True, self.response.status if self.response else 0
        record.disconnected, record.outcome = True, "disconnected"

    def snapshot(self) -> progress.Waiting:
        """What is known now of the model this request waits for."""
        model = self._model_id
        engine = self._engines.registry.get(model)
        pull = self._puller.active(model) if self._puller is not None else None
        wants = self._dispatcher.schedule()["line"]
        line = [w["model"] for w in wants]
        place = line.index(model) if model in line else None
        overdue = place is not None and bool(wants[place]["overdue"])
        return progress.Waiting(
            model=model, waited_s=time.monotonic() - self._t0,
            state=engine.state.value if engine is not None else None,
            downloading=(pull.done_bytes, pull.total_bytes)
            if pull is not None and pull.state == "downloading" else None,
            in_line=place is not None, ahead=tuple(line[:place]) if place else (),
            overdue=overdue)

    async def _say(self) -> None:
        if self.response is None:
            self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)
            if self._request.version >= aiohttp.HttpVersion11:
                self.response.enable_chunked_encoding()   # as the stream relay's own
            self._record.status = 200
            try:
                await self._bounded(self.response.prepare(self._request))
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                self.left()
                raise ClientLeft(self.response) from None
        await self._send(progress.comment(self.snapshot()))

    async def _send(self, data: bytes) -> None:
        assert self.response is not None
        try:
            await self._bounded(self.response.write(data))
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.left()
            raise ClientLeft(self.response) from None
        self._record.bytes_out += len(data)

    async def _bounded(self, sending: Awaitable[object]) -> None:
        """A client that takes nothing for stall_timeout_s is cut off (as the relay's)."""
        try:
            async with asyncio.timeout(self._stall_timeout_s):
                await sending
        except TimeoutError:
            if self._request.transport is not None:
                self._request.transport.abort()
            assert self.response is not None
            self._record.error_code = "client_stalled"
            self.left()
            raise ClientLeft(self.response) from None
