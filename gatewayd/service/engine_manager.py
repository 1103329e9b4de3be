"""The engine layer, built from its parts, which its users ask by name:

- `registry` (engine_registry): the engines by model and unit, events → states,
  subscribers, waiters, versions, the retry backoff after failures;
- `lifecycle` (engine_lifecycle): start / stop / kill as one lifecycle per model, what
  systemd says when asked, and what follows a change;
- `capacity` (engine_capacity): learned GPU and RAM memory, placement, admission;
- `hooks` (engine_hooks): the KV cache and the hooks around readiness and stop;
- failure_logs: the journal's last lines on a failure (kept inside);
- park_queue (under the lifecycle): stopped units parked for a fast next start.

`engines.lifecycle.start(...)` goes straight to the part that starts; this class keeps
only what takes more than one part or the adapters behind them (a start's checks before
room is made, what is learned of memory, the admin's overview, the journal). Users type
it by a Protocol of their own whose members are service/engine_parts' views.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gatewayd.core import placement
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import GatewayConfig
from gatewayd.core.errors import GatewayError
from gatewayd.core.ports import (
    DesiredList,
    EngineUnitInfo,
    GpuProbe,
    HealthProbe,
    HostMemoryProbe,
    JournalReader,
    KvCacheStore,
    MemoryBook,
    MemoryMeter,
    UnitControl,
)
from gatewayd.service.engine_capacity import EngineCapacity, EstimateFor
from gatewayd.service.engine_hooks import EngineHooks
from gatewayd.service.engine_lifecycle import EngineLifecycle, configured
from gatewayd.service.engine_registry import EngineRegistry
from gatewayd.service.failure_logs import FailureLogs


class EngineManager:
    def __init__(self, *, catalog: Catalog, config: GatewayConfig, units: UnitControl,
                 health: HealthProbe, gpu: GpuProbe, journal: JournalReader,
                 desired: DesiredList, kv_cache: KvCacheStore | None = None,
                 learned: MemoryBook | None = None, host: HostMemoryProbe | None = None,
                 meter: MemoryMeter | None = None, learned_ram: MemoryBook | None = None,
                 estimate: EstimateFor | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog = catalog   # shared, replaced in place by a reload
        self.config = config     # the configuration in force
        self._units = units
        self._gpu = gpu
        self._desired = desired
        # the parts, asked by name (engines.lifecycle.start(...)): service/engine_parts
        # has the views their users type them by
        self.registry = EngineRegistry(clock)
        self.capacity = EngineCapacity(catalog=catalog, config=config, gpu=gpu,
                                       learned=learned, registry=self.registry, host=host,
                                       meter=meter, learned_ram=learned_ram,
                                       estimate=estimate)
        self.hooks = EngineHooks(catalog, units, kv_cache)
        self._logs = FailureLogs(journal, self.registry)
        self.lifecycle = EngineLifecycle(
            catalog=catalog, config=config, units=units, health=health, desired=desired,
            hooks=self.hooks, registry=self.registry, capacity=self.capacity,
            logs=self._logs, clock=clock)
        self._unwatch = units.watch(self.registry.unit_changed)

    def reconfigure(self, config: GatewayConfig) -> None:
        """A reloaded configuration: for the starts, admissions and loads from now on."""
        self.config = config
        self.capacity.reconfigure(config)
        self.lifecycle.reconfigure(config)

    async def close(self) -> None:
        self._unwatch()
        self.lifecycle.close()
        self._logs.close()
        self.registry.close()
        await self._desired.flush()   # the last start or stop is kept for the next boot

    async def list_units(self) -> list[EngineUnitInfo]:
        """The engine units systemd has now (running or not)."""
        return await self._units.list_engines()

    def desired(self) -> list[str]:
        """The models whose engines are wanted after a reboot, in start order."""
        return self._desired.ids

    # -- what takes more than one part ------------------------------------------------

    def check_startable(self, model: Model) -> None:
        """What its start would fail on before anything runs (the engine server missing,
        its files missing or unreadable): said before room is made for it, as the failed
        start it would have been (engine_failed, its backoff)."""
        try:
            self._units.check_startable(model)
        except GatewayError as e:
            raise self.lifecycle.refuse_start(model.id, e) from e

    def learn_memory(self) -> list[str]:
        """What ready engines hold now, GPU and RAM, for the next admission of their
        setup: the models whose figure changed."""
        return sorted({*self.capacity.learn_gpu_memory(), *self.capacity.learn_ram()})

    # -- for the admin ---------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The engine layer at a glance: how units are run, the GPU, the limit, engines
        by state, models, what is wanted after a reboot and what is parked."""
        engines = self.registry.engines()
        return {
            "unit_mode": self._units.mode,
            "systemd_manager": self._units.manager,
            "gpu": self._gpu.description,
            "max_engines": self.config.max_engines,
            "engines": {state: sum(1 for e in engines if e.state.value == state)
                        for state in sorted({e.state.value for e in engines})},
            "models": len(self.catalog),
            "desired": self._desired.ids,
            "parked": self._units.parked(),
        }

    def gpu_devices(self) -> list[placement.DeviceMemory] | None:
        """Every device's memory, read now (None: no GPU); raises GpuUnavailable."""
        return self._gpu.devices()

    def parked(self) -> list[str]:
        """The models whose stopped unit is parked for a fast next start."""
        return self._units.parked()

    async def logs(self, model_id: str, lines: int) -> list[str]:
        return await self._logs.tail(self.log_unit(model_id)[0], lines)

    def log_unit(self, model_id: str) -> tuple[str, str]:
        """The unit whose journal is the model's engine's (its engine's, else the one its
        next start makes), and the manager that runs it ("system" or "user")."""
        engine = self.registry.get(model_id)
        unit = engine.unit if engine else self._units.layout(
            configured(self.catalog, model_id).id).unit
        return unit, self._units.manager
