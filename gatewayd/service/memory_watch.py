"""An engine's memory after its start: where it is read, what a ready engine teaches,
and what an OOM kill does.

- where: the unit's cgroup (systemd's ControlGroup), looked up off the start's path;
- ready: its RAM peak learned (engine_capacity.learn_ram), and with auto_memory_high
  its unit's MemoryHigh= set from that;
- an OOM kill (engine_capacity.out_of_memory tells one from another death): systemd's
  restart would run into the same wall, so the unit is stopped (which cancels the
  restart), a higher need is learned, and the engine is failed with out_of_memory: its
  waiters get 503 engine_out_of_memory. Under the model's lifecycle lock, like any stop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager

from gatewayd.core.catalog import Catalog
from gatewayd.core.engines import Engine, EngineState, OutOfMemory
from gatewayd.core.errors import GatewayError
from gatewayd.core.ports import EngineUnitInfo, UnitControl
from gatewayd.service.engine_capacity import MIB, EngineCapacity
from gatewayd.service.engine_registry import EngineRegistry

log = logging.getLogger("gatewayd.engines")


class MemoryWatch:
    def __init__(self, *, catalog: Catalog, units: UnitControl, registry: EngineRegistry,
                 capacity: EngineCapacity, clock: Callable[[], float],
                 info: Callable[[str], Awaitable[EngineUnitInfo | None]],
                 lifecycle: Callable[[str], AbstractAsyncContextManager[None]]) -> None:
        self._catalog = catalog
        self._units = units
        self._registry = registry
        self._capacity = capacity
        self._clock = clock
        self._info = info              # what systemd says of a unit now (None: no answer)
        self._lifecycle = lifecycle    # the model's lifecycle lock

    async def track(self, model_id: str, unit: str) -> None:
        """Where the new unit's memory is read (its cgroup)."""
        if (info := await self._info(unit)) is not None:
            self._capacity.track(model_id, info.control_group)

    async def ready(self, engine: Engine) -> None:
        """Ready: what it holds at its peak is learned; auto_memory_high limits it."""
        if not self._capacity.tracked(engine.model_id):
            await self.track(engine.model_id, engine.unit)   # (its start's look not back yet)
        self._capacity.learn_ram()
        model = self._catalog.get(engine.model_id)
        if model is None or (high := self._capacity.memory_high(model)) is None:
            return
        try:
            await self._units.limit_memory(engine.unit, high)
        except GatewayError as e:   # a limit is protection, not a condition of serving
            log.warning("%s: cannot set MemoryHigh=%d on %s: %s", engine.model_id, high,
                        engine.unit, e.message)

    def killed_for_memory(self, engine: Engine) -> bool:
        """The engine went restarting: was its process killed for want of memory?"""
        failure = engine.failure
        return failure is not None and self._capacity.out_of_memory(
            engine.model_id, failure.oom_kill_said, failure.signal)

    async def out_of_memory(self, model_id: str) -> None:
        """Stopped, not restarted; a higher need learned; failed with out_of_memory."""
        async with self._lifecycle(model_id):
            engine = self._registry.get(model_id)
            model = self._catalog.get(model_id)
            if engine is None or model is None or engine.state not in (
                    EngineState.RESTARTING, EngineState.LOADING):
                return
            ledger = self._capacity.ram(model)
            before = self._capacity.need(model).ram_mib
            grown = self._capacity.learn_oom(model)
            free = ledger.plan_free_mib if ledger else None
            limit = model.config.memory_max
            where = (f"its unit's MemoryMax= ({limit // MIB} MiB, memory_max)" if limit
                     else "the kernel's OOM killer")
            reason = (f"killed for want of memory by {where}; it was thought to need "
                      f"{before} MiB of RAM, now {grown} MiB"
                      + (f", and {free} MiB are free for it" if free is not None else "")
                      + ("; raise memory_max" if limit and grown > limit // MIB else
                         "; it is not restarted until asked for again"))
            log.warning("%s: %s", model_id, reason)
            try:
                await self._units.stop_engine(engine.unit)   # no restart into the same wall
            except Exception as e:
                log.warning("%s: stopping it after its OOM kill failed: %s", model_id, e)
            self._registry.event(model_id, OutOfMemory(self._clock(), reason, memory=(
                ("required_mib", grown), ("free_mib", free),
                ("memory_max_mib", limit // MIB if limit else None))))
