"""Room for engines: what a model's engine needs, where it would go, whether it may start.

Need: learned once an engine of the same setup was measured (NVML per process,
kept by adapters/learned_memory), estimated from the files before. Placement
is core/placement.py on a fresh reading of every device; admission is
core/budget.py. Synchronous: a start admits and registers without an await in
between, so two starts cannot both take the last place.
"""

from __future__ import annotations

import logging

from gatewayd.core import budget, placement
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engine_units import settings_stamp
from gatewayd.core.engines import EngineState
from gatewayd.core.errors import GatewayError
from gatewayd.core.ports import GpuProbe, MemoryBook
from gatewayd.service.engine_registry import EngineRegistry

log = logging.getLogger("gatewayd.engines")


class EngineCapacity:
    def __init__(self, *, catalog: Catalog, config: GatewayConfig, gpu: GpuProbe,
                 learned: MemoryBook | None, registry: EngineRegistry) -> None:
        self._catalog = catalog
        self._config = config
        self._gpu = gpu
        self._learned = learned
        self._registry = registry

    def reconfigure(self, config: GatewayConfig) -> None:
        self._config = config

    def measured_mib(self, model: Model) -> int | None:
        """What an engine of this model's setup was seen holding (None: not yet)."""
        if self._learned is None:
            return None
        return self._learned.get(settings_stamp(model, self._config))

    def need_mib(self, model: Model) -> int:
        """Its engine's expected GPU memory: learned once measured, estimated before."""
        return budget.model_need_mib(model, self._config.vram_margin_mib,
                                     self.measured_mib(model))

    def learn_gpu_memory(self) -> list[str]:
        """Record what each ready engine's process holds now (NVML per process, its
        MainPID): the next admission of that setup uses it. The models whose figure
        changed."""
        if self._learned is None:
            return []
        per_process = self._gpu.process_mib()
        if not per_process:
            return []
        changed = []
        for engine in self._registry.engines():
            model = self._catalog.get(engine.model_id)
            held = per_process.get(engine.main_pid)
            if engine.state is EngineState.READY and model is not None and held and \
                    self._learned.record(settings_stamp(model, self._config), model.id, held):
                log.info("%s: its engine holds %d MiB of GPU memory (learned; the files "
                         "are %d MiB)", model.id, held, budget.model_need_mib(model, 0))
                changed.append(model.id)
        return changed

    def place(self, model: Model) -> placement.Placement | None:
        """Where the model's engine would go now (core/placement.py), from a fresh
        reading of every device; None: no GPU. Raises GpuUnavailable."""
        devices = self._gpu.devices()
        if devices is None:
            return None
        per_process = self._gpu.process_mib() or {}
        placed = []
        for engine in self._registry.engines():
            other = self._catalog.get(engine.model_id)
            if other is None or not engine.holds_place or engine.model_id == model.id:
                continue
            need, held = self.need_mib(other), per_process.get(engine.main_pid)
            placed.append(placement.Placed(
                engine.devices,
                # loads in progress will take memory that NVML does not show as used yet
                pending_mib=budget.still_to_load_mib(engine.state, True, need, held),
                evictable_mib=(held or need) if engine.state is EngineState.READY
                and not other.config.pin else 0))
        return placement.place(self.need_mib(model), placement.rooms(devices, placed),
                               model.config.cuda_visible_devices)

    def admit(self, model: Model, *, force: bool = False) -> placement.Placement | None:
        """Admission (budget.check_admission); where the engine goes. force skips the
        memory check, not the placement."""
        where = self.place(model)
        budget.check_admission(model.id, self._registry.engines(),
                               max_engines=self._config.max_engines,
                               need_mib=self.need_mib(model),
                               placement=None if force else where)
        return where

    def devices_of(self, spec: str | None) -> tuple[str, ...]:
        """An adopted unit's CUDA_VISIBLE_DEVICES as device UUIDs (): all or unknown."""
        if spec is None:
            return ()
        try:
            devices = self._gpu.devices() or []
        except GatewayError:
            return ()
        return tuple(d.uuid for d in placement.select(spec, devices))
