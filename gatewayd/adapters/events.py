"""A fan-out of gateway events (engine state changes, queue depths) to SSE followers,
and the recent ones kept for a window (GET /admin/events/history: "why was my model
evicted an hour ago?").

Publishing never blocks: each follower has a bounded queue, and a follower too
slow to keep up loses its oldest events rather than slowing the gateway.

The window is bounded twice, by age (KEEP_S) and by count (KEEP_MAX, the oldest
dropped first), so it costs at most KEEP_MAX small dicts whatever the traffic. Queue
depths are left out of it (one per request that queues: they would push everything
else out), and so is a pull's progress (twice a second): only its end (done, failed,
cancelled) is kept.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

FOLLOWER_QUEUE = 1000
KEEP_S = 24 * 3600   # (an int: the API says 86400)
KEEP_MAX = 10_000
PULL_ENDS = frozenset({"done", "failed", "cancelled"})


def kept(event: dict[str, Any]) -> bool:
    """Whether an event goes into the window (every one goes to the followers)."""
    kind = event.get("type")
    if kind == "queue":
        return False
    if kind == "pull":
        return event.get("state") in PULL_ENDS
    return True


class EventHub:
    def __init__(self, *, clock: Callable[[], float] = time.time, keep_s: float = KEEP_S,
                 keep_max: int = KEEP_MAX) -> None:
        self._followers: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self.closed = False
        self._clock = clock   # wall-clock: events carry epoch seconds ("ts")
        self.keep_s = keep_s
        self.keep_max = keep_max
        self._kept: deque[dict[str, Any]] = deque(maxlen=keep_max)

    def publish(self, event: dict[str, Any]) -> None:
        event.setdefault("ts", self._clock())
        if kept(event):
            self._kept.append(event)   # (a full deque drops its oldest)
            self._prune()
        for queue in self._followers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(event)

    def history(self, since: float | None = None, limit: int | None = None
                ) -> list[dict[str, Any]]:
        """The kept events, oldest first: those at or after since (epoch seconds), the
        newest `limit` of them."""
        self._prune()
        events = list(self._kept) if since is None else [
            e for e in self._kept if e["ts"] >= since]
        if limit is not None:
            events = events[-limit:] if limit > 0 else []
        return events

    def _prune(self) -> None:
        oldest = self._clock() - self.keep_s
        while self._kept and self._kept[0]["ts"] < oldest:
            self._kept.popleft()

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
