"""Stopped engines' units parked, so that a model's next start is a wake
(adapters/parked_units), once no start or stop is under way anywhere: creating a
unit is work for systemd that must not slow someone's start (docs/benchmarks.md,
"Figures behind choices in the code")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gatewayd.core.catalog import Catalog
from gatewayd.core.ports import UnitControl
from gatewayd.service.engine_registry import EngineRegistry

log = logging.getLogger("gatewayd.engines")
PARK_QUIET_POLL_S = 0.05   # how often a pending park looks whether starts are over


class ParkQueue:
    def __init__(self, units: UnitControl, catalog: Catalog, registry: EngineRegistry, *,
                 quiet: Callable[[], bool], lock: Callable[[str], asyncio.Lock]) -> None:
        self._units = units
        self._catalog = catalog
        self._registry = registry
        self._quiet = quiet     # no start or stop under way, no engine coming up
        self._lock = lock       # the model's lifecycle lock
        self._queue: dict[str, None] = {}      # models to park, in order
        self._parker: asyncio.Task[None] | None = None

    def later(self, model_id: str) -> None:
        """Park the stopped model's unit once all is quiet."""
        self._queue[model_id] = None
        if self._parker is None or self._parker.done():
            self._parker = asyncio.get_running_loop().create_task(self._park_pending())

    def close(self) -> None:
        if self._parker is not None:
            self._parker.cancel()

    async def _park_pending(self) -> None:
        while self._queue:
            while not self._quiet():
                await asyncio.sleep(PARK_QUIET_POLL_S)
            model_id = next(iter(self._queue))
            del self._queue[model_id]
            model = self._catalog.get(model_id)
            if model is None:
                continue   # removed from the catalog meanwhile
            # the model's lifecycle lock, so that a start waits for the park and then
            # wakes the unit; but not "busy": a loader that wants this model goes on
            # making room meanwhile instead of waiting for the park to end
            async with self._lock(model_id):
                if self._registry.get(model_id) is not None:
                    continue   # started again meanwhile
                try:
                    if await self._units.park(model):
                        log.info("%s: its unit is parked for the next start", model_id)
                except Exception as e:   # a start then creates the unit, as without parking
                    log.warning("%s: could not park its unit: %s", model_id, e)
