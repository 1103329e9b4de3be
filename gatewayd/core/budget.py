"""Admission arithmetic: may this model's engine start now? Pure.

Checked in this order, each with its own error:
1. one instance per model (`already_running`);
2. the engine limit (`engine_limit_reached`);
3. the VRAM budget: required = what an engine of this setup was measured to hold
   (else model file + mmproj) + margin, against the free memory of the devices
   placement chose (core/placement.py), read fresh right before deciding
   (`insufficient_gpu`, with every device's figures). Without a GPU (no NVML),
   there is nothing to measure: the check is skipped, and engines run on the CPU
   within the engine limit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from gatewayd.core.catalog import Model
from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.errors import (
    AlreadyRunning,
    EngineLimitReached,
    InsufficientGpu,
    InsufficientMemory,
)
from gatewayd.core.placement import Placement
from gatewayd.core.ram_budget import RamLedger, describe_shortage

MIB = 1024 * 1024


def required_mib(size_bytes: int, margin_mib: int) -> int:
    """Estimated GPU memory an engine needs: weights (rounded up) plus a margin."""
    return -(-size_bytes // MIB) + margin_mib


def model_need_mib(model: Model, default_margin_mib: int,
                   learned_mib: int | None = None) -> int:
    """The one definition of what a model's engine is expected to hold: what an engine of
    the same setup was measured to hold (learned_mib, NVML per process), else its files
    (model + mmproj); plus its margin (the model's vram_margin_mib, else the default)."""
    margin = model.config.vram_margin_mib
    margin = default_margin_mib if margin is None else margin
    if learned_mib is not None:
        return learned_mib + margin
    return required_mib(model.size_bytes, margin)


@dataclass(frozen=True)
class Need:
    """What a model's engine is expected to hold, per budget (MiB), and why we think so."""

    vram_mib: int    # margin included; what the GPU check counts (unused without a GPU)
    ram_mib: int
    vram_source: str   # "learned" (NVML saw it), "declared" (vram_mib), "estimate"
                       # (GGUF) or "files"
    ram_source: str    # "learned" (its cgroup or PSS peak), "declared" (ram_mib),
                       # "estimate" or "files"

    def describe(self) -> dict[str, object]:
        return {"vram_mib": self.vram_mib, "ram_mib": self.ram_mib,
                "vram_source": self.vram_source, "ram_source": self.ram_source}


def model_need(model: Model, *, gpu: bool, vram_margin_mib: int, ram_margin_mib: int,
               learned_vram_mib: int | None, learned_ram_mib: int | None,
               estimate: Estimate | None) -> Need:
    """The one definition of what a model's engine needs. GPU: learned (NVML) + margin,
    else the declared vram_mib, else the estimate's VRAM part + margin, else the files +
    margin (model_need_mib). RAM: the declared ram_mib, else the estimate's RAM part +
    ram_margin, else (no header to estimate from: whisper)
    the files + ram_margin without a GPU and ram_margin with one; or its learned peak where
    that is more."""
    margin = model.config.vram_margin_mib
    margin = vram_margin_mib if margin is None else margin
    declared_vram, declared_ram = model.config.vram_mib, model.config.ram_mib
    if learned_vram_mib is not None:
        vram, vram_source = learned_vram_mib + margin, "learned"
    elif declared_vram is not None:
        # what its configuration says it takes (vLLM: --gpu-memory-utilization of the
        # card), all of it: no margin on top
        vram, vram_source = declared_vram, "declared"
    elif estimate is not None and gpu:
        vram, vram_source = estimate.vram_mib + margin, "estimate"
    else:
        vram, vram_source = required_mib(model.size_bytes, margin), "files"
    if declared_ram is not None:
        ram, ram_source = declared_ram, "declared"
    elif estimate is not None:
        # (the margin: the process itself, its libraries, a CUDA runtime's host memory,
        # which the estimate of llama-server's buffers leaves out)
        ram, ram_source = estimate.ram_mib + ram_margin_mib, "estimate"
    else:
        ram = ram_margin_mib + (0 if gpu else required_mib(model.size_bytes, 0))
        ram_source = "files"
    if learned_ram_mib is not None and learned_ram_mib >= ram:
        # a learned figure raises the need, never lowers it below the estimate: a unit's
        # cgroup is not charged for weights it maps from a file already in the page cache
        # (an earlier engine read it), yet they are in RAM all the same
        ram, ram_source = learned_ram_mib, "learned"
    return Need(vram_mib=vram, ram_mib=ram, vram_source=vram_source, ram_source=ram_source)


class Estimate(Protocol):
    """What core/memory_estimate says an engine will hold (MiB, per memory)."""

    @property
    def ram_mib(self) -> int: ...
    @property
    def vram_mib(self) -> int: ...


def still_to_load_mib(state: EngineState, holds_place: bool, estimate_mib: int,
                      measured_mib: int | None) -> int:
    """GPU memory an engine may still take beyond what NVML shows it holding: one that
    holds a place and is not ready (starting, loading, restarting, stopping) counts its
    estimate less what it holds (the ledger's "pending")."""
    if not holds_place or state is EngineState.READY:
        return 0
    return max(0, estimate_mib - (measured_mib or 0))


def check_admission(model_id: str, engines: Iterable[Engine], *, max_engines: int,
                    need_mib: int, placement: Placement | None,
                    ram_need_mib: int = 0, ram: RamLedger | None = None) -> None:
    """placement: where the engine would go (None: no GPU, memory not checked); ram: the
    RAM ledger without this model's engine (None: RAM not checked)."""
    engines = list(engines)
    for engine in engines:
        if engine.model_id == model_id and engine.holds_place:
            raise AlreadyRunning(
                f"an engine for {model_id!r} is already {engine.state.value} "
                f"({engine.unit})", model=model_id, state=engine.state.value, unit=engine.unit)
    active = [e for e in engines if e.holds_place]
    if len(active) >= max_engines:
        raise EngineLimitReached(
            f"{len(active)} engines are running, the limit (max_engines) is {max_engines}; "
            f"stop one first: {', '.join(e.model_id for e in active)}",
            max_engines=max_engines, running=[e.model_id for e in active])
    if placement is not None and not placement.fits:
        raise insufficient_gpu(model_id, need_mib, placement,
                               running=[e.model_id for e in active])
    if ram is not None and ram_need_mib > ram.plan_free_mib:
        raise insufficient_ram(model_id, ram_need_mib, ram,
                               running=[e.model_id for e in active])


def insufficient_ram(model_id: str, need_mib: int, ledger: RamLedger, *, running: list[str],
                     retry_after: int | None = None, prefix: str = "",
                     held_by: str = "") -> InsufficientMemory:
    never = need_mib > ledger.ceiling_mib
    advice = ("More than this machine's RAM budget could give it even with every engine "
              "stopped: lower its ctx_size or parallel slots, use a smaller quantisation, "
              "or raise ram_budget_mib / lower ram_reserve_mib" if never else
              "Stop an engine, or wait for one to go idle")
    return InsufficientMemory(
        prefix + describe_shortage(model_id, need_mib, ledger)
        + (f"; held by {held_by}" if held_by else "") + f". {advice}",
        retry_after=None if never else retry_after, memory="ram", required_mib=need_mib,
        free_mib=ledger.plan_free_mib, ceiling_mib=ledger.ceiling_mib,
        ram=ledger.describe(), running=running)


def insufficient_gpu(model_id: str, need_mib: int, placement: Placement, *,
                     running: list[str], retry_after: int | None = None,
                     prefix: str = "", held_by: str = "") -> InsufficientGpu:
    """The refusal, with the free memory of every device (free_mib, total_mib: over the
    devices the model may use)."""
    where = ("" if len(placement.rooms) == 1 and not placement.named else
             f" on {', '.join(f'GPU {d.index}' for d in placement.devices) or 'no device'}")
    return InsufficientGpu(
        f"{prefix}{model_id!r} needs about {need_mib} MiB of GPU memory and "
        f"{placement.free_mib} MiB are free{where} (of {placement.total_mib} MiB)"
        + (f"; held by {held_by}" if held_by else "")
        + f". Per device: {placement.describe_devices()}. Stop an engine, or lower "
        "vram_margin_mib", retry_after=retry_after,
        memory="gpu", required_mib=need_mib, free_mib=placement.free_mib,
        total_mib=placement.total_mib,
        devices=placement.per_device(), running=running)
