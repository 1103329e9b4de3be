"""Turns and queues: who is being served by each model's engine, and who waits for it.

Per model: the requests in flight (up to max_concurrency, else 429), when it
was last used, the queue of requests waiting for its engine (FIFO, up to the
queue limit, else 503), and whether it is draining (picked to make room: it
finishes what it serves, new requests queue behind the model it makes room
for). Synchronous bookkeeping only; the loader (loader.py) decides and awaits.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gatewayd.core.errors import ConcurrencyLimit, QueueFull
from gatewayd.core.priority import NORMAL
from gatewayd.core.scheduler import IDLE_GRACE_S, sole_client
from gatewayd.core.waits import ROOM, WaitClock

QueueListener = Callable[[str, int], None]


@dataclass(eq=False)
class Waiter:
    """A request waiting for its model's engine: when it began to wait, its class, and
    its wait split by what it waits for (core/waits)."""
    future: asyncio.Future[None]
    since: float
    wait: WaitClock
    priority: int = NORMAL
    client: str | None = None   # who asked (http: the key, else the connection); None: not known


@dataclass
class Use:
    """An engine's use: calls in flight (by class), the last use, and the calls waiting
    for a turn."""
    in_flight: int = 0
    last_used: float = 0.0
    waiters: deque[Waiter] = field(default_factory=deque)
    draining_for: str | None = None    # the model this engine is making room for
    serving: Counter[int] = field(default_factory=Counter)   # in flight, by class
    # the one client served over its last moments: in flight, or within IDLE_GRACE_S of
    # the last use (None: several, or not known); core/scheduler's grace reads it
    sole_client: str | None = None
    released_at: float = float("-inf")   # when a request of its clients last ended

    @property
    def draining(self) -> bool:
        return self.draining_for is not None

    def top_class(self) -> int | None:
        """The highest class among the requests it serves and those waiting for it."""
        classes = [c for c, n in self.serving.items() if n > 0]
        classes += [w.priority for w in self.waiters]
        return max(classes, default=None)


class Turns:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._uses: dict[str, Use] = {}
        self._listeners: list[QueueListener] = []

    def get_or_add(self, model_id: str) -> Use:
        """model_id's use, made (empty) where it has none yet."""
        return self._uses.setdefault(model_id, Use())

    def peek(self, model_id: str) -> Use | None:
        """model_id's use; None where it never had one (nothing is made)."""
        return self._uses.get(model_id)

    def uses(self) -> dict[str, Use]:
        return self._uses

    def subscribe(self, listener: QueueListener) -> Callable[[], None]:
        """listener(model, depth) on every change of a model's queue depth."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    # -- serving ----------------------------------------------------------------------

    def take(self, model_id: str, *, limit: int | None, counts_as_use: bool,
             priority: int = NORMAL, client: str | None = None) -> None:
        use = self.get_or_add(model_id)
        if limit is not None and use.in_flight >= limit:
            raise ConcurrencyLimit(
                f"{model_id!r} is serving {use.in_flight} requests, its limit "
                f"(max_concurrency); try again shortly", retry_after=1,
                model=model_id, max_concurrency=limit)
        now = self._clock()
        use.in_flight += 1
        use.serving[priority] += 1
        if counts_as_use:
            recent = use.in_flight > 1 or now - use.released_at < IDLE_GRACE_S
            if use.in_flight > 1:
                # requests at once are not one client's back-to-back ones, whatever their
                # host and key say (keyless clients of one host, a team behind one proxy)
                use.sole_client = None
            else:
                use.sole_client = sole_client((use.sole_client, client)) if recent \
                    else client
            use.last_used = now

    def release(self, model_id: str, *, counts_as_use: bool, priority: int = NORMAL) -> bool:
        """True when the engine now serves nobody."""
        use = self.get_or_add(model_id)
        use.in_flight -= 1
        use.serving[priority] -= 1
        if counts_as_use:
            use.last_used = use.released_at = self._clock()
        return use.in_flight == 0

    # -- waiting ------------------------------------------------------------------------

    def enqueue(self, model_id: str, limit: int, priority: int = NORMAL,
                reason: str = ROOM, client: str | None = None) -> Waiter:
        """A new waiter, waiting for `reason` (core/waits) to begin with."""
        use = self.get_or_add(model_id)
        if len(use.waiters) >= limit:
            raise QueueFull(f"{len(use.waiters)} requests already wait for {model_id!r} "
                            f"(queue limit {limit})", retry_after=5, model=model_id)
        now = self._clock()
        waiter = Waiter(asyncio.get_running_loop().create_future(), now,
                        WaitClock(now, reason), priority, client)
        use.waiters.append(waiter)
        self._depth(model_id)
        return waiter

    def leave(self, model_id: str, waiter: Waiter) -> None:
        waiters = self.get_or_add(model_id).waiters
        if waiter in waiters:
            waiters.remove(waiter)
            self._depth(model_id)

    def waiting_for(self, model_id: str, reason: str) -> None:
        """model_id's waiters wait for `reason` from now on (its engine changed)."""
        use = self._uses.get(model_id)
        if use is not None and use.waiters:
            now = self._clock()
            for waiter in use.waiters:
                waiter.wait.switch(reason, now)

    def queued(self, model_id: str) -> int:
        use = self._uses.get(model_id)
        return len(use.waiters) if use else 0

    def wake(self, model_id: str, error: BaseException | None) -> None:
        """Every waiter, in arrival order: go and take a turn (or hear the error)."""
        for waiter in list(self.get_or_add(model_id).waiters):
            if not waiter.future.done():
                if error is None:
                    waiter.future.set_result(None)
                else:
                    waiter.future.set_exception(error)

    def _depth(self, model_id: str) -> None:
        depth = len(self.get_or_add(model_id).waiters)
        for listener in list(self._listeners):
            listener(model_id, depth)
