"""The gateway's graceful stop: stop accepting, let the requests being handled finish,
end those the drain time leaves open with an answer of their own.

Which requests are being handled, and which connections have carried one, are recorded
here (a middleware) rather than read from aiohttp's private attributes, where a rename
would let the drain silently stop draining; the connections come from our own
Listener (adapters/listener.py). tests/http/test_drain.py holds the steps to their word.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from aiohttp import web

from gatewayd.adapters.listener import Listener
from gatewayd.http.middleware import SHUTDOWN, Handler

log = logging.getLogger("gatewayd")

# how long a stop waits for the first request of connections accepted just before it
FRESH_CONNECTION_GRACE_S = 1.0
FRESH_POLL_S = 0.01
# after the drain: how long the answers still open get to write their shutting_down error
ABANDON_GRACE_S = 2.0


class OpenRequests:
    """The requests being handled, and the connections that have carried a request."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        # weak: a closed connection leaves by itself
        self._spoken: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()

    def begin(self, request: web.BaseRequest) -> None:
        # aiohttp runs each request in a task of its own that ends once the answer is
        # written (a plain answer is written after the handler returns): its end is the
        # request's, where a `finally` in the middleware would come before the writing
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if request.transport is not None:
            self._spoken.add(request.transport)

    def __len__(self) -> int:
        return len(self._tasks)

    def silent(self, connections: Sequence[asyncio.BaseTransport]
               ) -> list[asyncio.BaseTransport]:
        """Those of connections that have not carried a request yet."""
        return [c for c in connections if c not in self._spoken]

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def ended(self, timeout_s: float) -> int:
        """Wait up to timeout_s until no request is being handled (one that a kept-alive
        connection sends meanwhile counts too); the number still open then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)
        return len(self._tasks)


OPEN_REQUESTS = web.AppKey("open_requests", OpenRequests)


class Middleware(Protocol):
    def __call__(self, request: web.Request, handler: Handler
                 ) -> Awaitable[web.StreamResponse]: ...


def track_requests(requests: OpenRequests) -> Middleware:
    """The outermost middleware: records each request in `requests`."""
    @web.middleware
    async def track(request: web.Request, handler: Handler) -> web.StreamResponse:
        requests.begin(request)
        return await handler(request)
    return track


async def drain_notice(app: web.Application, seconds: float) -> None:
    """The stop's first step: /ready answers 503 (a balancer's health checks take the
    gateway out), and for `seconds` everything is still served before the drain begins."""
    app[SHUTDOWN].draining = True
    if seconds > 0:
        log.info("stopping: /ready says draining; serving %gs more (drain_notice_s)",
                 seconds)
        await asyncio.sleep(seconds)


def cancel_open_requests(app: web.Application) -> None:
    """Cancel each open request's handler ourselves, with the connection still open, so
    that it can answer shutting_down (a stream: an error event) before the connection
    closes; aiohttp's own shutdown cancels only after closing the transport."""
    app[SHUTDOWN].expired = True
    app[OPEN_REQUESTS].cancel()


async def drain(app: web.Application, listener: Listener, timeout_s: float, *,
                also_watched: Sequence[Listener] = ()) -> None:
    """The stop's steps, in order. Stop taking connections from `listener` (every one
    taken is kept). Connections accepted just before, whose request has not arrived yet
    (aiohttp's shutdown would close them unanswered), get FRESH_CONNECTION_GRACE_S to
    send it; also_watched's connections too (the admin socket, still accepting meanwhile).
    Requests being handled get up to timeout_s to finish; those still open then are
    cancelled here, their connections open, and get ABANDON_GRACE_S to say so. What is
    left (idle connections, aiohttp's own last wait) is runner.cleanup()'s."""
    requests = app[OPEN_REQUESTS]
    await listener.stop()
    watched = (listener, *also_watched)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FRESH_CONNECTION_GRACE_S
    while loop.time() < deadline and any(requests.silent(w.connections()) for w in watched):
        await asyncio.sleep(FRESH_POLL_S)
    if left := await requests.ended(timeout_s):
        log.warning("shutdown_timeout_s (%gs) ran out: ending %d open request(s) with a "
                    "shutting_down error", timeout_s, left)
        cancel_open_requests(app)
        await requests.ended(ABANDON_GRACE_S)
