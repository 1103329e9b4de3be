"""Scheduling decisions. Pure: usage snapshots in, decisions out; no I/O, no awaits.

The dispatcher (dispatcher.py) gathers a snapshot, asks one of these functions,
and carries out the answer (stop a victim, start an engine, wake waiters).
Because a decision never awaits, nothing can change under it: no locks.

Eviction picks the least recently *used* engine (used = an inference request;
status polls do not count) among those that can go: ready, serving nobody,
awaited by nobody, not pinned. One victim at a time; the dispatcher waits for
its memory to come back before deciding again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gatewayd.engines import EngineState


@dataclass(frozen=True)
class Usage:
    """One engine as the scheduler sees it."""

    model_id: str
    state: EngineState
    in_flight: int = 0        # requests being served right now
    queued: int = 0           # requests waiting for this engine
    pinned: bool = False
    last_used: float = 0.0    # monotonic time of the last inference request
    estimate_mib: int = 0     # what it is expected to hold (file + mmproj + margin)
    measured_mib: int | None = None   # what NVML says its process holds, where known
    idle_ttl_s: float | None = None

    @property
    def holds_slot(self) -> bool:
        return self.state in (EngineState.STARTING, EngineState.LOADING, EngineState.READY,
                              EngineState.STOPPING)

    def why_not_evictable(self) -> str | None:
        if self.pinned:
            return "pinned"
        if self.state is not EngineState.READY:
            return self.state.value
        if self.in_flight:
            return f"serving {self.in_flight} request(s)"
        if self.queued:
            return f"awaited by {self.queued} request(s)"
        return None


@dataclass(frozen=True)
class Fits:
    """Start now: there is room."""


@dataclass(frozen=True)
class Evict:
    """Stop this engine first (then decide again)."""

    model_id: str
    reason: str


@dataclass(frozen=True)
class Blocked:
    """No room and nothing may go now. `holders` say what is holding the resources."""

    limit: str                      # "engine_limit" or "gpu_memory"
    holders: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class TryAnyway:
    """Nothing else is running and it still does not fit by estimate: the estimate is
    conservative, so start it and report the engine's own failure if it does not load."""


Decision = Fits | Evict | Blocked | TryAnyway


def plan_start(model_id: str, usages: Sequence[Usage], *, max_engines: int, need_mib: int,
               free_mib: int | None) -> Decision:
    """Can model_id's engine start now, and if not, which engine goes first?

    free_mib is a fresh reading of free GPU memory (None: no GPU, memory not checked).
    """
    others = [u for u in usages if u.model_id != model_id and u.holds_slot]
    slots_short = len(others) >= max_engines
    memory_short = free_mib is not None and need_mib > free_mib
    if not slots_short and not memory_short:
        return Fits()
    limit = "engine_limit" if slots_short else "gpu_memory"
    victims = sorted((u for u in others if u.why_not_evictable() is None),
                     key=lambda u: u.last_used)
    if victims:
        reason = (f"making room for {model_id}: "
                  + ("max_engines reached" if slots_short else
                     f"needs {need_mib} MiB, {free_mib} MiB free"))
        return Evict(victims[0].model_id, reason)
    if not others and memory_short:
        return TryAnyway()
    holders = tuple((u.model_id, u.why_not_evictable() or "running") for u in others)
    return Blocked(limit, holders)


@dataclass(frozen=True)
class Ledger:
    """GPU memory, accounted for. All MiB.

    held     = Σ measured use of the engines' processes (NVML per process; 0 where unknown)
    pending  = Σ over starting/loading engines of max(0, estimate - measured): memory a
               load will still take, which NVML's free figure does not show yet
    external = max(0, total - free - held): what other processes hold
    plan_free = max(0, free - pending): what a new engine may count on
    """

    total_mib: int
    free_mib: int
    held_mib: int
    pending_mib: int
    external_mib: int

    @property
    def plan_free_mib(self) -> int:
        return max(0, self.free_mib - self.pending_mib)


def memory_ledger(total_mib: int, free_mib: int, usages: Iterable[Usage]) -> Ledger:
    held = pending = 0
    for u in usages:
        if not u.holds_slot:
            continue
        held += u.measured_mib or 0
        if u.state in (EngineState.STARTING, EngineState.LOADING):
            pending += max(0, u.estimate_mib - (u.measured_mib or 0))
    return Ledger(total_mib=total_mib, free_mib=free_mib, held_mib=held, pending_mib=pending,
                  external_mib=max(0, total_mib - free_mib - held))


def idle_expired(usages: Iterable[Usage], now: float) -> list[str]:
    """Engines idle (ready, serving and awaited by nobody) for longer than their idle_ttl."""
    return [u.model_id for u in usages
            if u.idle_ttl_s is not None and u.state is EngineState.READY and not u.in_flight
            and not u.queued and not u.pinned and now - u.last_used >= u.idle_ttl_s]
