"""Readiness: an engine is ready when its /health answers 200 over its socket.

llama-server binds its socket before loading and answers 503 until the model
is loaded; whisper (behind systemd-socket-proxyd) resets connections until it
listens. One poller per starting/loading engine, every 2 ms for the first 100 ms
(a tiny model loads in ~15-40 ms: a poll that backs off from the start would see
it ready up to a third of its load time late), then backing off to 500 ms, up to
load_timeout_s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.ports import HealthProbe

POLLED_STATES = (EngineState.STARTING, EngineState.LOADING)


def poll_delays(first: float = 0.002, tight_for: float = 0.1, factor: float = 1.3,
                cap: float = 0.5) -> list[float]:
    """Every `first` seconds for `tight_for` seconds (small models load in
    milliseconds), then backing off by `factor` up to `cap`."""
    delays, delay, total = [], first, 0.0
    while total < 3600:
        delays.append(delay)
        total += delay
        if total >= tight_for:
            delay = min(delay * factor, cap)
    return delays


class Readiness:
    def __init__(self, health: HealthProbe, *, load_timeout_s: float,
                 clock: Callable[[], float], engine: Callable[[str], Engine | None],
                 on_ready: Callable[[str], Awaitable[None]],
                 on_timeout: Callable[[str], Awaitable[None]]) -> None:
        self._health = health
        self._load_timeout_s = load_timeout_s
        self._clock = clock
        self._engine = engine
        self._on_ready = on_ready
        self._on_timeout = on_timeout
        self._polls: dict[str, asyncio.Task[None]] = {}
        self._deadlines: dict[str, float] = {}

    def reconfigure(self, load_timeout_s: float) -> None:
        """For the loads that begin from now on."""
        self._load_timeout_s = load_timeout_s

    def watch(self, model_id: str, *, new_start: bool = False) -> None:
        """Poll model_id's engine until it is ready, not starting/loading, or timed out
        (load_timeout_s from the start, or from now for an engine found loading)."""
        if new_start or model_id not in self._deadlines:
            self._deadlines[model_id] = self._clock() + self._load_timeout_s
        task = self._polls.get(model_id)
        if task is None or task.done():
            self._polls[model_id] = asyncio.get_running_loop().create_task(
                self._poll(model_id))

    def close(self) -> None:
        for task in self._polls.values():
            task.cancel()

    async def _poll(self, model_id: str) -> None:
        for delay in poll_delays():
            engine = self._engine(model_id)
            if engine is None or engine.state not in POLLED_STATES:
                self._deadlines.pop(model_id, None)
                return
            if await self._health.status(engine.socket) == 200:
                self._deadlines.pop(model_id, None)
                await self._on_ready(model_id)
                return
            if self._clock() > self._deadlines.get(model_id, 0.0):
                self._deadlines.pop(model_id, None)
                await self._on_timeout(model_id)
                return
            await asyncio.sleep(delay)
