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

from gatewayd.core.catalog import Model
from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.errors import AlreadyRunning, EngineLimitReached, InsufficientGpu
from gatewayd.core.placement import Placement

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


def still_to_load_mib(state: EngineState, holds_place: bool, estimate_mib: int,
                      measured_mib: int | None) -> int:
    """GPU memory an engine may still take beyond what NVML shows it holding: one that
    holds a place and is not ready (starting, loading, restarting, stopping) counts its
    estimate less what it holds (the ledger's "pending")."""
    if not holds_place or state is EngineState.READY:
        return 0
    return max(0, estimate_mib - (measured_mib or 0))


def check_admission(model_id: str, engines: Iterable[Engine], *, max_engines: int,
                    need_mib: int, placement: Placement | None) -> None:
    """placement: where the engine would go (None: no GPU, memory not checked)."""
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
        required_mib=need_mib, free_mib=placement.free_mib, total_mib=placement.total_mib,
        devices=placement.per_device(), running=running)
