"""A wake-up signal for whoever waits for "something changed" (an engine's state, a place
freed, a request given back): the loaders and the eviction of a surplus."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

CHANGE_POLL_S = 1.0   # a wait for a change also re-checks this often (nothing is missed)


class WakeUp:
    """Wakes every waiter at once on notify(); a wait ends by its deadline, and looks
    again at least every CHANGE_POLL_S."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._future: asyncio.Future[None] | None = None

    def notify(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)
        self._future = None

    async def wait(self, deadline: float) -> None:
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._future),
                                   max(0.01, min(CHANGE_POLL_S, deadline - self._clock())))
