"""Placement: which GPU(s) a new engine goes to. Pure.

Input: one fresh reading per device (NVML, taken right before the decision), and
the engines already placed, each with its devices and what it may still load
(its "pending": an engine that is starting or loading holds less than it will).
Per device, what a new engine may count on is

    plan_free = free (NVML) - Σ pending of the engines loading there

(an engine spread over n devices counts 1/n of its pending on each).

The rule, for a model whose need is N MiB (learned, else files + margin):
1. the model names its devices (`cuda_visible_devices`): those, as given;
2. else the one device where it fits best: the smallest plan_free ≥ N (ties: the
   lower index), so big holes stay free for big models;
3. else, with several devices whose plan_free adds up to N, all devices that have
   room: llama.cpp splits the layers by each device's free memory;
4. else it does not fit now. Room is made on the one device where the free memory
   plus what its evictable engines (ready, not pinned) hold comes closest to N
   (the largest such sum; ties: the lower index): eviction stops engines on that
   device only, so the memory freed is where the model will go. If no single
   device can ever hold it, room is made on all devices (then 3. applies).

A machine with one device places every engine there without naming it
(CUDA_VISIBLE_DEVICES is set only where there is a choice).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceMemory:
    """One device, read fresh (MiB)."""

    index: int
    uuid: str
    name: str
    total_mib: int
    free_mib: int

    def describe(self) -> str:
        return f"GPU {self.index} ({self.name}): {self.free_mib} of {self.total_mib} MiB free"


@dataclass(frozen=True)
class Placed:
    """An engine already on the devices, as placement sees it."""

    devices: tuple[str, ...]    # UUIDs; () = not known (all): its pending counts whole
                                # on every device, what it would free is split
    pending_mib: int = 0        # what it may still load (starting, loading, restarting)
    evictable_mib: int = 0      # what stopping it would free (0: pinned or not ready)


@dataclass(frozen=True)
class Room:
    """One device's memory as placement plans it: free, promised, and what eviction frees."""
    device: DeviceMemory
    pending_mib: int = 0
    evictable_mib: int = 0

    @property
    def plan_free_mib(self) -> int:
        return max(0, self.device.free_mib - self.pending_mib)


@dataclass(frozen=True)
class Placement:
    """Where an engine goes. fits: it fits there now; else room must be made there."""

    devices: tuple[DeviceMemory, ...]
    free_mib: int              # plan_free summed over those devices
    total_mib: int
    fits: bool
    named: bool                # the model's own cuda_visible_devices
    rooms: tuple[Room, ...]    # every device, for error messages and status

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(d.uuid for d in self.devices)

    def visible_devices(self) -> str | None:
        """CUDA_VISIBLE_DEVICES for the engine: its devices by UUID (stable across
        reboots and CUDA's own device ordering), or None where there was no choice."""
        if self.named or len(self.rooms) < 2:
            return None
        return ",".join(self.uuids)

    def per_device(self) -> list[dict[str, object]]:
        return [{"index": r.device.index, "uuid": r.device.uuid, "name": r.device.name,
                 "total_mib": r.device.total_mib, "free_mib": r.device.free_mib,
                 "free_for_planning_mib": r.plan_free_mib} for r in self.rooms]

    def describe_devices(self) -> str:
        return "; ".join(r.device.describe() + (f", {r.pending_mib} MiB of it being loaded"
                                                if r.pending_mib else "")
                         for r in self.rooms)


def select(spec: str | None, devices: Sequence[DeviceMemory]) -> list[DeviceMemory]:
    """The devices a CUDA_VISIBLE_DEVICES value names (indices or UUID prefixes, as
    CUDA reads it); None: all of them."""
    if spec is None:
        return list(devices)
    chosen: list[DeviceMemory] = []
    for item in (d.strip() for d in spec.split(",") if d.strip()):
        if item.isdigit():
            chosen += [d for d in devices if d.index == int(item)]
        else:
            chosen += [d for d in devices if d.uuid.startswith(item)]
    return chosen


def rooms(devices: Sequence[DeviceMemory], placed: Iterable[Placed]) -> list[Room]:
    pending = {d.uuid: 0 for d in devices}
    evictable = {d.uuid: 0 for d in devices}
    for engine in placed:
        on = [u for u in engine.devices if u in pending]
        share = len(on) or 1   # where it is not known, its pending errs on the safe side
        for uuid in on or list(pending):
            pending[uuid] += -(-engine.pending_mib // share)
            evictable[uuid] += engine.evictable_mib // (len(on) or len(pending))
    return [Room(d, pending[d.uuid], evictable[d.uuid]) for d in devices]


def place(need_mib: int, all_rooms: Sequence[Room], named: str | None = None) -> Placement:
    """Where an engine needing need_mib goes (see the module's rule)."""
    rooms_ = tuple(all_rooms)
    if named is not None:
        chosen = {d.uuid for d in select(named, [r.device for r in rooms_])}
        return _placement([r for r in rooms_ if r.device.uuid in chosen], need_mib, rooms_,
                          named=True)
    fitting = [r for r in rooms_ if r.plan_free_mib >= need_mib]
    if fitting:
        best = min(fitting, key=lambda r: (r.plan_free_mib, r.device.index))
        return _placement([best], need_mib, rooms_)
    with_room = [r for r in rooms_ if r.plan_free_mib > 0]
    if len(with_room) > 1 and sum(r.plan_free_mib for r in with_room) >= need_mib:
        return _placement(with_room, need_mib, rooms_)
    if not rooms_:
        return _placement([], need_mib, rooms_)
    target = max(rooms_, key=lambda r: (r.plan_free_mib + r.evictable_mib, -r.device.index))
    if target.plan_free_mib + target.evictable_mib >= need_mib or len(rooms_) == 1:
        return _placement([target], need_mib, rooms_)
    return _placement(list(rooms_), need_mib, rooms_)


def _placement(chosen: list[Room], need_mib: int, all_rooms: tuple[Room, ...], *,
               named: bool = False) -> Placement:
    free = sum(r.plan_free_mib for r in chosen)
    return Placement(devices=tuple(r.device for r in chosen), free_mib=free,
                     total_mib=sum(r.device.total_mib for r in chosen),
                     fits=bool(chosen) and free >= need_mib, named=named, rooms=all_rooms)


def total(devices: Sequence[DeviceMemory]) -> tuple[int, int]:
    """(total, free) MiB over devices."""
    return sum(d.total_mib for d in devices), sum(d.free_mib for d in devices)
