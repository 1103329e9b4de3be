"""The engine layer as the rest of the gateway sees it: one object, built from its parts.

- engine_registry: the engines by model and unit, events → states, subscribers,
  waiters, versions, the retry backoff after failures;
- engine_lifecycle: start / stop / kill as one lifecycle per model, what systemd says
  when asked, and what follows a change;
- engine_capacity: learned GPU memory, placement, admission;
- engine_hooks: the KV cache and the hooks around readiness and stop;
- failure_logs: the journal's last lines on a failure;
- park_queue (under the lifecycle): stopped units parked for a fast next start.

The dispatcher, the reconciler, the reloader and the admin API ask this object;
nobody reaches into its parts or the adapters behind them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from gatewayd.core import placement
from gatewayd.core.budget import Need
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engines import Engine
from gatewayd.core.errors import EngineFailed, GatewayError
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
    MemoryUse,
    UnitControl,
)
from gatewayd.core.ram_budget import RamLedger
from gatewayd.service.engine_capacity import EngineCapacity, EstimateFor
from gatewayd.service.engine_hooks import EngineHooks, ReadyHook
from gatewayd.service.engine_lifecycle import EngineLifecycle, configured
from gatewayd.service.engine_registry import EngineListener, EngineRegistry
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
        self._registry = EngineRegistry(clock)
        self._capacity = EngineCapacity(catalog=catalog, config=config, gpu=gpu,
                                        learned=learned, registry=self._registry, host=host,
                                        meter=meter, learned_ram=learned_ram,
                                        estimate=estimate)
        self._hooks = EngineHooks(catalog, units, kv_cache)
        self._logs = FailureLogs(journal, self._registry)
        self._lifecycle = EngineLifecycle(
            catalog=catalog, config=config, units=units, health=health, desired=desired,
            hooks=self._hooks, registry=self._registry, capacity=self._capacity,
            logs=self._logs, clock=clock)
        self._unwatch = units.watch(self._registry.unit_changed)

    def reconfigure(self, config: GatewayConfig) -> None:
        """A reloaded configuration: for the starts, admissions and loads from now on."""
        self.config = config
        self._capacity.reconfigure(config)
        self._lifecycle.reconfigure(config)

    async def close(self) -> None:
        self._unwatch()
        self._lifecycle.close()
        self._logs.close()
        self._registry.close()
        await self._desired.flush()   # the last start or stop is kept for the next boot

    # -- the engines -----------------------------------------------------------------

    def engines(self) -> list[Engine]:
        return self._registry.engines()

    def get(self, model_id: str) -> Engine | None:
        return self._registry.get(model_id)

    def subscribe(self, listener: EngineListener) -> Callable[[], None]:
        return self._registry.subscribe(listener)

    def versions(self) -> dict[str, int]:
        return self._registry.versions()

    def busy(self, model_id: str) -> bool:
        return self._lifecycle.busy(model_id)

    def backoff_left(self, model_id: str) -> float:
        return self._registry.backoff_left(model_id)

    def failed_error(self, model_id: str, *, retry_after: int | None = None) -> EngineFailed:
        return self._registry.failed_error(model_id, retry_after=retry_after)

    @property
    def last_release(self) -> float | None:
        """When an engine last gave up its place (its GPU memory shows as free later)."""
        return self._registry.last_release

    @property
    def stop_reasons(self) -> Mapping[str, str]:
        """Why each engine was last stopped."""
        return self._lifecycle.stop_reasons

    @property
    def evicted_for(self) -> Mapping[str, str]:
        """The model each engine's last stop, an eviction, made room for."""
        return self._lifecycle.evicted_for

    def load_seconds(self, model_id: str) -> float | None:
        """How long the engine's last way to ready took, from its start (or systemd's
        restart) to ready; None where the gateway did not see it begin (adopted)."""
        return self._registry.load_seconds(model_id)

    # -- start / stop, and what systemd says --------------------------------------------

    async def start(self, model_id: str, *, wait: bool = True, force: bool = False) -> Engine:
        return await self._lifecycle.start(model_id, wait=wait, force=force)

    async def wait_ready(self, model_id: str, timeout: float | None = None) -> Engine:
        return await self._lifecycle.wait_ready(model_id, timeout)

    async def stop(self, model_id: str, *, reason: str = "requested",
                   evicted_for: str | None = None) -> Engine:
        return await self._lifecycle.stop(model_id, reason=reason, evicted_for=evicted_for)

    async def kill_unresponsive(self, model_id: str, main_pid: int, silent_s: float) -> None:
        await self._lifecycle.kill_unresponsive(model_id, main_pid, silent_s)

    async def coming_back(self, model_id: str, main_pid: int) -> bool:
        return await self._lifecycle.coming_back(model_id, main_pid)

    def take_over(self, info: EngineUnitInfo) -> Engine | None:
        return self._lifecycle.take_over(info)

    def observe(self, model_id: str, info: EngineUnitInfo | None) -> None:
        self._lifecycle.observe(model_id, info)

    async def list_units(self) -> list[EngineUnitInfo]:
        """The engine units systemd has now (running or not)."""
        return await self._units.list_engines()

    def desired(self) -> list[str]:
        """The models whose engines are wanted after a reboot, in start order."""
        return self._desired.ids

    def before_ready(self, hook: ReadyHook) -> Callable[[], None]:
        return self._hooks.before_ready(hook)

    async def drop_unconfigured_kv_caches(self) -> list[str]:
        return await self._hooks.drop_unconfigured_kv_caches()

    def forget_learned_memory(self, model_id: str) -> int:
        return self._capacity.forget(model_id)

    # -- room --------------------------------------------------------------------------

    def measured_mib(self, model: Model) -> int | None:
        return self._capacity.measured_mib(model)

    def need_mib(self, model: Model) -> int:
        return self._capacity.need_mib(model)

    def need(self, model: Model) -> Need:
        """What its engine needs, per budget (GPU, RAM), and where each figure came from."""
        return self._capacity.need(model)

    def ram(self, model: Model | None = None) -> RamLedger | None:
        """The RAM ledger now, without model's own engine (None: RAM not checked)."""
        return self._capacity.ram(model)

    def ram_measured(self, model_id: str) -> MemoryUse | None:
        """The engine's last RAM reading (its cgroup, or its processes' PSS)."""
        return self._capacity.ram_measured(model_id)

    def read_ram(self) -> None:
        """Read every engine's RAM now, for ram_measured (a few small files each)."""
        self._capacity.read_ram()

    def vram_held(self) -> dict[str, int]:
        """What each engine's process holds on the GPU now (NVML, MiB), per model."""
        return self._capacity.vram_held()

    def has_gpu(self) -> bool:
        """Whether the GPU budget is checked (NVML found a device)."""
        return self._capacity.has_gpu()

    def check_ram_ceiling(self, model: Model) -> None:
        self._capacity.check_ram_ceiling(model)

    def check_startable(self, model: Model) -> None:
        """What its start would fail on before anything runs (the engine server missing,
        its files missing or unreadable): said before room is made for it, as the failed
        start it would have been (engine_failed, its backoff)."""
        try:
            self._units.check_startable(model)
        except GatewayError as e:
            raise self._lifecycle.refuse_start(model.id, e) from e

    def learn_memory(self) -> list[str]:
        """What ready engines hold now, GPU and RAM, for the next admission of their
        setup: the models whose figure changed."""
        return sorted({*self._capacity.learn_gpu_memory(), *self._capacity.learn_ram()})

    def place(self, model: Model) -> placement.Placement | None:
        return self._capacity.place(model)

    # -- for the admin ---------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The engine layer at a glance: how units are run, the GPU, the limit, engines
        by state, models, what is wanted after a reboot and what is parked."""
        engines = self._registry.engines()
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

    def kv_cache_counts(self) -> Mapping[tuple[str, str], int]:
        return self._hooks.kv_cache_counts()

    async def info(self, engine: Engine) -> EngineUnitInfo | None:
        """What systemd says of the engine's unit now (None: no answer)."""
        return await self._lifecycle.info(engine.unit)

    async def logs(self, model_id: str, lines: int) -> list[str]:
        return await self._logs.tail(self.log_unit(model_id)[0], lines)

    def log_unit(self, model_id: str) -> tuple[str, str]:
        """The unit whose journal is the model's engine's (its engine's, else the one its
        next start makes), and the manager that runs it ("system" or "user")."""
        engine = self._registry.get(model_id)
        unit = engine.unit if engine else self._units.layout(
            configured(self.catalog, model_id).id).unit
        return unit, self._units.manager
