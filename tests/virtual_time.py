"""An asyncio event loop whose clock is virtual: when nothing is ready to run, time jumps
to the next timer instead of sleeping. Code under test that waits for seconds (timeouts,
backoff, polling) runs in microseconds, deterministically.

Only for code that does no real I/O (fakes everywhere): a wait with no timer and nothing
ready would block forever in real time, so it raises instead.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        events: list[Any] = super().select(0)
        if events:
            return events
        if timeout is None:
            raise RuntimeError("virtual time: nothing is scheduled and nothing can run "
                               "(the code under test waits for something that never comes)")
        self.now += max(0.0, timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now
