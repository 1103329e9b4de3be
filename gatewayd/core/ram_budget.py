"""The host's memory (RAM) as a budget, beside the GPU's. Pure. All MiB.

The kernel's MemAvailable is what a new allocation can get without swapping, but it
is not all a new engine may count on:

- an engine that is starting or loading holds less than it will (its *pending*:
  need less measured), exactly as on the GPU;
- llama-server maps its weights from the file: those pages are page cache, and the
  kernel counts page cache as available. Starting a model into them would not fail,
  it would evict another engine's weights and make both crawl. So the engines' claims
  (each its need, or what it was measured holding if more) are also counted against
  the total, not only against MemAvailable;
- a reserve (`[memory] ram_reserve_mib`) stays for the rest of the machine, and an
  optional budget (`[memory] ram_budget_mib`) caps what all engines together may hold.

    plan_free = min(available - reserve - pending,
                    total - reserve - claimed,
                    budget - claimed)            (the last only with a budget)

When every engine holds what it claims, the first term is the smaller one and this
is "MemAvailable less the reserve"; the others bite when the kernel would count an
engine's own mapped weights as free, or when the budget is the limit.

An engine's need is what an engine of its setup was measured holding at its peak
(its cgroup, or its processes' PSS, learned like the GPU's figure) once it has run,
and the GGUF estimate (core/memory_estimate.py) before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class HostMemory:
    """/proc/meminfo, read fresh (MiB)."""

    total_mib: int
    available_mib: int


@dataclass(frozen=True)
class EngineRam:
    """One engine holding a place, as the RAM ledger sees it."""

    model_id: str
    ready: bool
    need_mib: int                  # learned peak, else the estimate
    measured_mib: int | None = None   # what it holds now (cgroup or PSS), where known

    @property
    def claim_mib(self) -> int:
        return max(self.need_mib, self.measured_mib or 0)

    @property
    def pending_mib(self) -> int:
        """What it may still take: a loading engine's need less what it holds."""
        return 0 if self.ready else max(0, self.need_mib - (self.measured_mib or 0))


@dataclass(frozen=True)
class RamLedger:
    total_mib: int
    available_mib: int
    reserve_mib: int
    budget_mib: int | None
    claimed_mib: int       # Σ claims of the engines holding a place
    held_mib: int          # Σ measured
    pending_mib: int       # Σ still to load

    @property
    def plan_free_mib(self) -> int:
        """What a new engine may count on now."""
        free = min(self.available_mib - self.reserve_mib - self.pending_mib,
                   self.total_mib - self.reserve_mib - self.claimed_mib)
        if self.budget_mib is not None:
            free = min(free, self.budget_mib - self.claimed_mib)
        return max(0, free)

    @property
    def ceiling_mib(self) -> int:
        """What a new engine could count on if every engine went: more than this is never
        going to fit, and is refused at once."""
        ceiling = min(self.available_mib + self.held_mib, self.total_mib) - self.reserve_mib
        if self.budget_mib is not None:
            ceiling = min(ceiling, self.budget_mib)
        return max(0, ceiling)

    def describe(self) -> dict[str, int | None]:
        return {"total_mib": self.total_mib, "available_mib": self.available_mib,
                "reserve_mib": self.reserve_mib, "budget_mib": self.budget_mib,
                "claimed_mib": self.claimed_mib, "held_mib": self.held_mib,
                "pending_mib": self.pending_mib, "free_for_planning_mib": self.plan_free_mib}


def ram_ledger(host: HostMemory, engines: Iterable[EngineRam], *, reserve_mib: int,
               budget_mib: int | None = None) -> RamLedger:
    engines = list(engines)
    return RamLedger(
        total_mib=host.total_mib, available_mib=host.available_mib, reserve_mib=reserve_mib,
        budget_mib=budget_mib, claimed_mib=sum(e.claim_mib for e in engines),
        held_mib=sum(e.measured_mib or 0 for e in engines),
        pending_mib=sum(e.pending_mib for e in engines))


def describe_shortage(model_id: str, need_mib: int, ledger: RamLedger) -> str:
    budget = (f", engines' budget {ledger.budget_mib} MiB (ram_budget_mib)"
              if ledger.budget_mib is not None else "")
    return (f"{model_id!r} needs about {need_mib} MiB of RAM and {ledger.plan_free_mib} MiB "
            f"are free for it (of {ledger.total_mib} MiB: {ledger.available_mib} MiB "
            f"available, {ledger.reserve_mib} MiB kept back (ram_reserve_mib){budget}; "
            f"engines claim {ledger.claimed_mib} MiB, {ledger.pending_mib} MiB of it still "
            "loading)")
