"""A fan-out of gateway events (engine state changes, queue depths) to SSE followers.

Publishing never blocks: each follower has a bounded queue, and a follower too
slow to keep up loses its oldest events rather than slowing the gateway.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

FOLLOWER_QUEUE = 1000


class EventHub:
    def __init__(self) -> None:
        self._followers: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self.closed = False

    def publish(self, event: dict[str, Any]) -> None:
        event.setdefault("ts", time.time())
        for queue in self._followers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(event)

    def follow(self) -> asyncio.Queue[dict[str, Any] | None]:
        """A queue of events; None, the last item, says the hub is closed."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(FOLLOWER_QUEUE)
        if self.closed:
            queue.put_nowait(None)
        else:
            self._followers.add(queue)
        return queue

    def close(self) -> None:
        """The gateway is stopping: followers are told to end (a status page left open
        must not hold the stop for the whole drain time)."""
        self.closed = True
        for queue in self._followers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(None)
        self._followers.clear()

    def unfollow(self, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._followers.discard(queue)
