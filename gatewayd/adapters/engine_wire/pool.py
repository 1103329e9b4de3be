"""One engine socket's connections: the idle keep-alive ones, and how many may be open.

At most `limit` connections per socket at once: llama-server's HTTP threads are held by
idle keep-alive connections, and past them it stalls; the requests beyond it wait their
turn here, first come first served, up to a queue limit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import TYPE_CHECKING

from gatewayd.adapters.engine_wire.errors import ConnectionsBusy, ConnectionsQueueFull

if TYPE_CHECKING:
    from gatewayd.adapters.engine_wire.connection import Connection


class Pool:
    """One socket's idle connections (newest last) and how many are in use."""

    def __init__(self, keepalive_s: float, limit: int | None,
                 refused: collections.Counter[str]) -> None:
        self.keepalive_s = keepalive_s
        self.limit = limit
        self.queue_limit: int | None = None   # None: the client's
        self.refused = refused
        self.idle: list[Connection] = []
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
                await waiter       # _admit counted the connection as ours before waking us
        except BaseException as e:
            handed = waiter.done() and not waiter.cancelled()
            if not handed:
                self._leave(waiter)
            if isinstance(e, TimeoutError):
                if handed:
                    return         # handed a connection as the time ran out: it is ours
                raise ConnectionsBusy(f"all {self.limit} of the engine's connections stayed "
                                      f"busy for {timeout:g} s") from None
            if handed:
                self.release()   # handed a connection just as we were cancelled: pass it on
            raise

    def _leave(self, waiter: asyncio.Future[None]) -> None:
        """A waiter gives up its place in the queue: a release may already have passed
        over it (cancelled before its task ran again) and taken it off."""
        with contextlib.suppress(ValueError):
            self.waiters.remove(waiter)

    def release(self) -> None:
        self.busy -= 1
        self.admit()

    def admit(self) -> None:
        """Hand free connections to the first waiters (after a release, or a higher limit)."""
        while self.waiters and (self.limit is None or self.busy < self.limit):
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.busy += 1
                waiter.set_result(None)

    def idle_connection(self) -> Connection | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if conn.open and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    def put_back(self, conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def close_idle(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.abort()
