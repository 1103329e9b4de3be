"""Liveness: a ready engine that stops answering /health is hung; kill it, systemd
restarts it.

A frozen engine (SIGSTOP, a deadlock, a wedged GPU driver call) keeps its unit
active and its socket open: systemd sees nothing wrong, and requests relayed to
it wait out read_timeout_s (10 minutes by default). So every ready engine is
asked GET /health (an openai server: its ready_path) every `health.interval_s`;
an answer of any status within `health.timeout_s` counts as alive (llama-server
answers /health from its HTTP threads even while every parallel slot generates).
After `health.misses` missing answers in a row from the same process, the engine
is marked failed with the reason and its unit is sent SIGKILL: systemd restarts it
(Restart=on-failure), its requests in flight end with an error, and requests that
wait are served by the restarted engine. Probes run concurrently; they cost one
small request per engine per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gatewayd.core.catalog import health_of
from gatewayd.core.engines import EngineState
from gatewayd.core.ports import HealthProbe
from gatewayd.service.engine_manager import EngineManager

log = logging.getLogger("gatewayd.liveness")


class Liveness:
    def __init__(self, engines: EngineManager, health: HealthProbe, *, interval_s: float,
                 timeout_s: float, misses: int) -> None:
        self._engines = engines
        self._health = health
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._limit = misses
        self._misses: dict[tuple[str, int], int] = {}   # (model, MainPID) -> misses in a row
        self._task: asyncio.Task[None] | None = None
        self._kills: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        if self._limit > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        for task in [*([self._task] if self._task else []), *self._kills]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def check(self) -> list[str]:
        """One round of probes; returns the models found hung (and being killed)."""
        ready = [e for e in self._engines.registry.engines() if e.state is EngineState.READY]
        catalog = self._engines.catalog
        answers = await asyncio.gather(*(
            self._health.status(e.socket, self._timeout_s, health_of(catalog, e.model_id)[0])
            for e in ready))
        alive = {(e.model_id, e.main_pid) for e in ready}
        for key in [k for k in self._misses if k not in alive]:
            del self._misses[key]   # restarted, stopped or gone meanwhile: start counting anew
        hung = []
        for engine, answer in zip(ready, answers, strict=True):
            key = (engine.model_id, engine.main_pid)
            if answer is not None:
                self._misses.pop(key, None)
                continue
            self._misses[key] = self._misses.get(key, 0) + 1
            log.warning("%s: no answer to %s within %gs (%d of %d)", engine.model_id,
                        health_of(catalog, engine.model_id)[0], self._timeout_s,
                        self._misses[key], self._limit)
            if self._misses[key] >= self._limit:
                del self._misses[key]
                hung.append(engine.model_id)
                silent_s = self._limit * self._interval_s
                task = asyncio.get_running_loop().create_task(
                    self._engines.lifecycle.kill_unresponsive(engine.model_id,
                                                              engine.main_pid, silent_s))
                self._kills.add(task)
                task.add_done_callback(self._kills.discard)
        return hung

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check()
            except Exception:
                log.exception("liveness check failed")
