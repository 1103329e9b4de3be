"""Readiness: an engine is ready when its /health answers 200 over its socket (an
openai server: its ready_path, ready_status).

llama-server binds its socket before loading and answers 503 until the model
is loaded; whisper (behind systemd-socket-proxyd) resets connections until it
listens. One poller per starting/loading engine, up to load_timeout_s.

When to look is learned: a model's engine loads in about the same time at each
start (for a tiny model, most of a cold start: docs/benchmarks.md, "Figures
behind choices in the code"), so a start of a model seen loading before is
looked at seldom until 60% of its shortest recent load E (every E/10, within
5-500 ms), then often until well past it (every E/50, within 1-50 ms: the look
that sees it ready is a small fraction of its load late, and few looks take CPU
from the loading engine on the same cores), then backing off to 500 ms. A model
never seen loading: every 1 ms for the first 100 ms, then backing off.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterator

from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.ports import HealthProbe

POLLED_STATES = (EngineState.STARTING, EngineState.LOADING)
LOADS_KEPT = 3          # the shortest of the last few loads: one slow start (a cold page
                        # cache) does not make the next look late
EARLY_S = 0.005         # the most often a look comes before the expected time
TIGHT_S = (0.001, 0.05)    # how often around it: E/50 within these bounds. Not under
                           # 1 ms: uvloop's timers count whole ms and round 0.5 ms to
                           # none, and the poller then looked back to back, taking the
                           # CPU the loading engine needed (its load measurably
                           # slower: docs/benchmarks.md, "Figures behind choices in
                           # the code")
BACKOFF = 1.3
CAP_S = 0.5


def poll_delays(expected_s: float | None = None) -> Iterator[float]:
    """The waits between looks at a loading engine (the first look is at once), summing
    to an hour at least. expected_s: its shortest recent load, if known."""
    total = 0.0
    if expected_s is None:
        tight, until = 0.001, 0.1
    else:
        early = min(max(EARLY_S, expected_s / 10), CAP_S)
        while total + early <= 0.6 * expected_s:
            total += early
            yield early
        tight = min(max(expected_s / 50, TIGHT_S[0]), TIGHT_S[1])
        until = 1.5 * expected_s + 0.02
    while total < until:
        total += tight
        yield tight
    delay = tight
    while total < 3600:
        delay = min(delay * BACKOFF, CAP_S)
        total += delay
        yield delay

class Readiness:
    def __init__(self, health: HealthProbe, *, load_timeout_s: float,
                 clock: Callable[[], float], engine: Callable[[str], Engine | None],
                 on_ready: Callable[[str], Awaitable[None]],
                 on_timeout: Callable[[str], Awaitable[None]],
                 ready_when: Callable[[str], tuple[str, int]] = lambda _: ("/health", 200)
                 ) -> None:
        self._health = health
        self._ready_when = ready_when   # model id -> (path, status): catalog.health_of
        self._load_timeout_s = load_timeout_s
        self._clock = clock
        self._engine = engine
        self._on_ready = on_ready
        self._on_timeout = on_timeout
        self._polls: dict[str, asyncio.Task[None]] = {}
        self._deadlines: dict[str, float] = {}
        self._started: dict[str, float] = {}   # the new starts being watched
        self._loads: dict[str, deque[float]] = {}

    def reconfigure(self, load_timeout_s: float) -> None:
        """For the loads that begin from now on."""
        self._load_timeout_s = load_timeout_s

    def watch(self, model_id: str, *, new_start: bool = False) -> None:
        """Poll model_id's engine until it is ready, not starting/loading, or timed out
        (load_timeout_s from the start, or from now for an engine found loading)."""
        if new_start or model_id not in self._deadlines:
            self._deadlines[model_id] = self._clock() + self._load_timeout_s
        if new_start:
            self._started[model_id] = self._clock()
        task = self._polls.get(model_id)
        if task is None or task.done():
            self._polls[model_id] = asyncio.get_running_loop().create_task(
                self._poll(model_id))

    def close(self) -> None:
        for task in self._polls.values():
            task.cancel()

    def expected_load_s(self, model_id: str) -> float | None:
        """The shortest of the model's recent loads (a new start to ready), if any."""
        loads = self._loads.get(model_id)
        return min(loads) if loads else None

    async def _poll(self, model_id: str) -> None:
        started = self._started.get(model_id)
        delays = poll_delays(self.expected_load_s(model_id) if started is not None else None)
        if started is not None and model_id in self._loads:
            await asyncio.sleep(next(delays))   # a start just made cannot be ready yet
        for delay in delays:
            engine = self._engine(model_id)
            if engine is None or engine.state not in POLLED_STATES:
                self._end(model_id)
                return
            path, ready = self._ready_when(model_id)
            if await self._health.status(engine.socket, path=path) == ready:
                if (began := self._started.get(model_id)) is not None:
                    self._loads.setdefault(model_id, deque(maxlen=LOADS_KEPT)).append(
                        self._clock() - began)
                self._end(model_id)
                await self._on_ready(model_id)
                return
            if self._clock() > self._deadlines.get(model_id, 0.0):
                self._end(model_id)
                await self._on_timeout(model_id)
                return
            await asyncio.sleep(delay)

    def _end(self, model_id: str) -> None:
        self._deadlines.pop(model_id, None)
        self._started.pop(model_id, None)
