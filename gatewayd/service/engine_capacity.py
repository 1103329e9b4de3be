"""Room for engines: what a model's engine needs, where it would go, whether it may start.

Two budgets: the GPU's (per device) and the host's RAM. Need, per budget: learned
once an engine of the same setup was measured (GPU: NVML per process; RAM: the
peak of its unit's cgroup, or its processes' PSS; both kept by
adapters/learned_memory), estimated from the GGUF header before
(core/memory_estimate.py), else from the files. Placement is core/placement.py on a
fresh reading of every device; the RAM ledger is core/ram_budget.py on a fresh
/proc/meminfo and fresh readings of each engine's memory; admission is
core/budget.py. Synchronous: a start admits and registers without an await in
between, so two starts cannot both take the last place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from signal import SIGKILL

from gatewayd.core import budget, placement, ram_budget
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engine_units import settings_stamp
from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.errors import GatewayError
from gatewayd.core.ports import GpuProbe, HostMemoryProbe, MemoryBook, MemoryMeter, MemoryUse
from gatewayd.service.engine_registry import EngineRegistry

log = logging.getLogger("gatewayd.engines")


# core.memory_estimate.estimate_for: (model, gpu present) -> its estimate, or None
EstimateFor = Callable[..., budget.Estimate | None]
MIB = 1024 * 1024
OOM_GROWTH = 1.25   # an engine killed for want of memory needs at least this much more
# PSS (where the cgroup cannot be read) walks the processes' page tables: ~16 ms per GiB
# mapped on 2 CPUs (adapters/engine_memory): read at most this often, cgroups every time
PSS_REREAD_S = 1.0


class EngineCapacity:
    def __init__(self, *, catalog: Catalog, config: GatewayConfig, gpu: GpuProbe,
                 learned: MemoryBook | None, registry: EngineRegistry,
                 host: HostMemoryProbe | None = None, meter: MemoryMeter | None = None,
                 learned_ram: MemoryBook | None = None,
                 estimate: EstimateFor | None = None) -> None:
        self._catalog = catalog
        self._config = config
        self._gpu = gpu
        self._learned = learned
        self._registry = registry
        self._host = host
        self._meter = meter
        self._learned_ram = learned_ram
        self._estimate = estimate
        self._has_gpu: bool | None = None
        self._control_groups: dict[str, str] = {}    # model -> its unit's ControlGroup
        self._ram_now: dict[str, MemoryUse] = {}     # model -> its last reading
        self._oom_seen: dict[str, int] = {}          # model -> OOM kills counted so far
        self._read_at: dict[str, float] = {}         # model -> when _ram_now was read
        self._host_ooms: dict[str, int] = {}         # model -> the kernel's OOM kills then

    def reconfigure(self, config: GatewayConfig) -> None:
        self._config = config

    def forget(self, model_id: str) -> int:
        """Drop the memory learned for a removed model, from both books."""
        return sum(book.forget_model(model_id)
                   for book in (self._learned, self._learned_ram) if book is not None)

    def measured_mib(self, model: Model) -> int | None:
        """What an engine of this model's setup was seen holding (None: not yet)."""
        if self._learned is None:
            return None
        return self._learned.get(settings_stamp(model, self._config))

    def has_gpu(self) -> bool:
        if self._has_gpu is None:
            try:
                self._has_gpu = self._gpu.devices() is not None
            except GatewayError:
                return True   # NVML answered once: a GPU that fails now is still one
        return self._has_gpu

    def need(self, model: Model) -> budget.Need:
        """Its engine's expected memory, per budget: learned once measured, estimated
        before."""
        gpu = self.has_gpu()
        stamp = settings_stamp(model, self._config)
        return budget.model_need(
            model, gpu=gpu, vram_margin_mib=self._config.vram_margin_mib,
            ram_margin_mib=self._config.ram_margin_mib,
            learned_vram_mib=self._learned.get(stamp) if self._learned else None,
            learned_ram_mib=self._learned_ram.get(stamp) if self._learned_ram else None,
            estimate=self._estimate(model, gpu=gpu) if self._estimate else None)

    def need_mib(self, model: Model) -> int:
        """Its engine's expected GPU memory: learned once measured, estimated before."""
        return self.need(model).vram_mib

    # -- RAM ---------------------------------------------------------------------------

    def track(self, model_id: str, control_group: str | None) -> None:
        """The unit's cgroup, where its memory is read (from what systemd said of it)."""
        if control_group:
            self._control_groups[model_id] = control_group
        if model_id not in self._host_ooms:
            self.note_start(model_id)

    def note_start(self, model_id: str) -> None:
        """Its engine starts: the kernel's OOM kills so far, to tell an OOM kill of it
        from any other SIGKILL later."""
        if self._host is not None and (kills := self._host.oom_kills()) is not None:
            self._host_ooms[model_id] = kills

    def tracked(self, model_id: str) -> bool:
        return model_id in self._control_groups

    def ram_measured(self, model_id: str) -> MemoryUse | None:
        """The engine's last RAM reading (None: none yet, or not measurable here)."""
        return self._ram_now.get(model_id)

    def read_ram(self) -> None:
        """Read every engine's memory now (a few small files each): cgroup figures, or
        PSS where the cgroup's are not to be had. Forgets the engines that are gone."""
        if self._meter is None:
            return
        engines = {e.model_id: e for e in self._registry.engines() if e.holds_place}
        for model_id in list(self._ram_now):
            if model_id not in engines:
                self._ram_now.pop(model_id)
        for model_id in list(self._control_groups):
            if model_id not in engines:
                self._control_groups.pop(model_id)
                self._oom_seen.pop(model_id, None)
                self._host_ooms.pop(model_id, None)
        now = time.monotonic()
        for model_id, cgroup in self._control_groups.items():
            last = self._ram_now.get(model_id)
            if last is not None and last.source == "pss" and \
                    now - self._read_at.get(model_id, 0.0) < PSS_REREAD_S:
                continue   # the page-table walk costs ms per GiB mapped: not every decision
            if (use := self._meter.read(cgroup)) is not None:
                self._ram_now[model_id] = use
                self._read_at[model_id] = now
            else:
                self._ram_now.pop(model_id, None)

    def ram(self, model: Model | None = None) -> ram_budget.RamLedger | None:
        """The RAM ledger from a fresh reading, without model's own engine (None: RAM is
        not checked: no host probe)."""
        if self._host is None:
            return None
        self.read_ram()
        rows = []
        for engine in self._registry.engines():
            other = self._catalog.get(engine.model_id)
            if other is None or not engine.holds_place or (model and engine.model_id == model.id):
                continue
            use = self._ram_now.get(engine.model_id)
            rows.append(ram_budget.EngineRam(
                engine.model_id, ready=engine.state is EngineState.READY,
                need_mib=self.need(other).ram_mib,
                measured_mib=use.current_mib if use else None))
        return ram_budget.ram_ledger(self._host.read(), rows,
                                     reserve_mib=self._config.ram_reserve_mib,
                                     budget_mib=self._config.ram_budget_mib)

    def check_ram_ceiling(self, model: Model) -> None:
        """More RAM than the budget could ever give (every engine stopped): refused at
        once, naming RAM, rather than after evicting everything."""
        ledger = self.ram(model)
        need = self.need(model).ram_mib
        if ledger is not None and need > ledger.ceiling_mib:
            raise budget.insufficient_ram(model.id, need, ledger, running=[
                e.model_id for e in self._registry.engines() if e.holds_place])

    def learn_ram(self) -> list[str]:
        """Record what each ready engine held at its peak (its cgroup's, else what it
        holds now): the next admission of that setup uses it. The models whose figure
        changed."""
        if self._learned_ram is None or self._meter is None:
            return []
        self.read_ram()
        changed = []
        for engine in self._registry.engines():
            model = self._catalog.get(engine.model_id)
            use = self._ram_now.get(engine.model_id)
            if engine.state is not EngineState.READY or model is None or use is None:
                continue
            mib = use.peak_mib or use.current_mib
            stamp = settings_stamp(model, self._config)
            known = self._learned_ram.get(stamp)
            # a peak only grows (a figure learned at an OOM is not lowered by a calm run)
            if (known is None or mib > known) and self._learned_ram.record(stamp, model.id, mib):
                log.info("%s: its engine holds %d MiB of RAM at its peak (%s; learned)",
                         model.id, mib, use.source)
                changed.append(model.id)
        return changed

    def memory_high(self, model: Model) -> int | None:
        """auto_memory_high: MemoryHigh= (bytes) for its running unit, its learned RAM
        peak plus the headroom; None: off, set by the model itself, or not learned yet."""
        if not self._config.auto_memory_high or model.config.memory_high is not None \
                or self._learned_ram is None:
            return None
        learned = self._learned_ram.get(settings_stamp(model, self._config))
        if learned is None:
            return None
        return round(learned * (1 + self._config.memory_high_headroom_pct / 100)) * MIB

    def out_of_memory(self, model_id: str, result_says_oom: bool,
                      signal: int | None = None) -> bool:
        """Whether the engine's last process was killed for want of memory:
        - systemd said so (Result=oom-kill: cgroup v2);
        - the kernel counted an OOM kill in its cgroup since we last looked (v1, where
          systemd does not tell), if the cgroup is still there to read: systemd removes
          an empty one even while the restart is pending;
        - it died of a SIGKILL the gateway did not send (a hung engine's kill is not asked
          about) while the kernel's count of OOM kills on the machine rose since it
          started. (Another process OOM-killed in the same moment as someone's kill -9 of
          the engine would read as its OOM: rare, and it errs on the side of not
          restarting into what may be the same wall.)"""
        cgroup = self._control_groups.get(model_id)
        use = self._meter.read(cgroup) if self._meter is not None and cgroup else None
        seen = self._oom_seen.get(model_id, 0)
        if use is not None and use.oom_kills is not None:
            self._oom_seen[model_id] = use.oom_kills
            if use.oom_kills > seen:
                return True
        before = self._host_ooms.get(model_id)
        now = self._host.oom_kills() if self._host is not None else None
        if now is not None:
            self._host_ooms[model_id] = now
        if signal == SIGKILL and before is not None and now is not None and now > before:
            return True
        return result_says_oom

    def learn_oom(self, model: Model) -> int:
        """After an OOM kill: its RAM need is at least OOM_GROWTH times what it had (its peak,
        its limit, or what was thought); the next admission counts that. The new need."""
        need = self.need(model).ram_mib
        use = self._ram_now.get(model.id)
        peak = (use.peak_mib or use.current_mib) if use else 0
        limit = -(-model.config.memory_max // MIB) if model.config.memory_max else 0
        grown = round(max(need, peak, limit) * OOM_GROWTH)
        if self._learned_ram is not None:
            self._learned_ram.record(settings_stamp(model, self._config), model.id, grown)
        return grown

    def learn_gpu_memory(self) -> list[str]:
        """Record what each ready engine's processes hold now (NVML per process, summed
        over its unit's: _gpu_held): the next admission of that setup uses it. The
        models whose figure changed."""
        if self._learned is None:
            return []
        per_process = self._gpu.process_mib()
        if not per_process:
            return []
        changed = []
        for engine in self._registry.engines():
            model = self._catalog.get(engine.model_id)
            held = self._gpu_held(engine, per_process)
            if engine.state is EngineState.READY and model is not None and held and \
                    self._learned.record(settings_stamp(model, self._config), model.id, held):
                log.info("%s: its engine holds %d MiB of GPU memory (learned; the files "
                         "are %d MiB)", model.id, held, budget.model_need_mib(model, 0))
                changed.append(model.id)
        return changed

    def vram_held(self) -> dict[str, int]:
        """What each engine's process holds on the GPU now (NVML per process, MiB; summed
        over devices): the engines NVML does not show are absent."""
        per_process = self._gpu.process_mib() or {}
        return {e.model_id: held for e in self._registry.engines()
                if (held := self._gpu_held(e, per_process))}

    def _gpu_held(self, engine: Engine, per_process: Mapping[int, int]) -> int | None:
        """What NVML shows the engine's processes holding (MiB): every process of its
        unit where its cgroup can be listed (a server's GPU work may run in its children:
        vLLM's workers, a TCP engine's server under the launcher), else its MainPID's."""
        if not per_process:
            return None   # no GPU, or NVML shows no process: no cgroup to list
        cgroup = self._control_groups.get(engine.model_id)
        pids = self._meter.pids(cgroup) if cgroup and self._meter is not None else None
        if not pids:
            return per_process.get(engine.main_pid) if engine.main_pid else None
        return sum(per_process.get(pid, 0) for pid in pids) or None

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
            need, held = self.need_mib(other), self._gpu_held(engine, per_process)
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
        GPU memory check (the scheduler's "try anyway"), not the placement nor RAM."""
        where = self.place(model)
        need = self.need(model)
        budget.check_admission(model.id, self._registry.engines(),
                               max_engines=self._config.max_engines,
                               need_mib=need.vram_mib, placement=None if force else where,
                               ram_need_mib=need.ram_mib, ram=self.ram(model))
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
