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
        self._followers: set[asyncio.Queue[dict[str, Any]]] = set()

    def publish(self, event: dict[str, Any]) -> None:
        event.setdefault("ts", time.time())
        for queue in self._followers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(event)

    def follow(self) -> asyncio.Queue[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(FOLLOWER_QUEUE)
        self._followers.add(queue)
        return queue

    def unfollow(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self._followers.discard(queue)
