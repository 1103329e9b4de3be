"""Idle engines past their idle_ttl_s are stopped (never one serving or awaited)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from gatewayd.core import scheduler
from gatewayd.core.catalog import Catalog
from gatewayd.core.errors import GatewayError
from gatewayd.service.engine_parts import EngineStarts

log = logging.getLogger("gatewayd.dispatcher")
UNSET_TTL_S = 60.0   # models without a TTL count as this when choosing the period


class StoppedEngines(Protocol):
    """What the reaper asks of the engines (service/engine_manager has it)."""

    @property
    def lifecycle(self) -> EngineStarts: ...

class IdleReaper:
    """Checks at a quarter of the shortest TTL (at least every 0.2 s); only runs when
    some model has a TTL."""

    def __init__(self, engines: StoppedEngines, catalog: Catalog,
                 usages: Callable[[], list[scheduler.Usage]],
                 clock: Callable[[], float]) -> None:
        self._engines = engines
        self._catalog = catalog
        self._usages = usages
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if any(m.config.idle_ttl_s for m in self._catalog):
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        period = max(0.2, min(m.config.idle_ttl_s or UNSET_TTL_S for m in self._catalog) / 4)
        while True:
            await asyncio.sleep(period)
            await self.reap()

    async def reap(self) -> list[str]:
        expired = scheduler.idle_expired(self._usages(), self._clock())
        for model_id in expired:
            # decided again right before each stop (no await in between): a request
            # may have taken the engine while the previous one was being stopped
            if model_id not in scheduler.idle_expired(self._usages(), self._clock()):
                continue
            log.info("stopping %s: idle for its idle_ttl", model_id)
            with contextlib.suppress(GatewayError):
                await self._engines.lifecycle.stop(model_id, reason="idle_ttl")
        return expired
