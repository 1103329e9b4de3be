"""What an engine unit holds in RAM, read from the kernel: the MemoryMeter adapter.

First choice, the unit's memory cgroup, in whichever hierarchy holds the memory
controller: cgroup v2 (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid host, where
memory is enabled there) or v1 (/sys/fs/cgroup/memory). That is the kernel's own
figure, with a peak and the OOM kills it made in the cgroup, and what MemoryMax= limits.

Where the unit has no memory cgroup (the controller is not delegated to this systemd,
e.g. a container on a hybrid host, or MemoryAccounting= is off), the fallback is the
sum of the proportional set size of the unit's processes, listed by the unit's cgroup in
systemd's own hierarchy (v1 name=systemd, else v2). /proc/<pid>/smaps_rollup needs
ptrace read access: a gateway that is neither root nor the engines' user cannot read
it, and then there is no figure (None), never a partial sum.

Plain blocking reads; PSS costs time in proportion to what the processes map (see
MemoryMeter.read).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from gatewayd.core.ports import MemoryUse

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_ROOT = Path("/proc")


class CgroupMemoryMeter:
    """Reads one unit's memory now (MemoryMeter). The roots are arguments so that tests
    can point the meter at a tree of their own."""

    def __init__(self, cgroup_root: Path = CGROUP_ROOT, proc_root: Path = PROC_ROOT) -> None:
        self._root = cgroup_root
        self._proc = proc_root
        # PSS has no kernel peak: the highest sum read per control group, with the
        # processes it was read over (a unit whose processes are all new has restarted)
        self._pss_peaks: dict[str, tuple[frozenset[int], int]] = {}

    def read(self, control_group: str) -> MemoryUse | None:
        relative = control_group.strip("/")
        if not relative or ".." in relative.split("/"):
            return None   # the root cgroup is no unit; ".." would leave the hierarchy
        return self._from_cgroup(relative) or self._from_pss(control_group, relative)

    def pids(self, control_group: str) -> list[int] | None:
        relative = control_group.strip("/")
        if not relative or ".." in relative.split("/"):
            return None
        return self._unit_pids(relative)

    # -- the memory cgroup ---------------------------------------------------------

    def _unified_roots(self) -> list[Path]:
        """The v2 hierarchy: the root itself on a unified host, "unified" on a hybrid one
        (only a cgroup2 root has cgroup.controllers)."""
        return [d for d in (self._root, self._root / "unified")
                if (d / "cgroup.controllers").exists()]

    def _from_cgroup(self, relative: str) -> MemoryUse | None:
        for unified in self._unified_roots():
            cgroup = unified / relative
            # no memory.current: memory is not enabled for it (the controller is v1's, or
            # the parent's subtree_control leaves it out)
            if (current := _read_int(cgroup / "memory.current")) is not None:
                return MemoryUse(current_bytes=current,
                                 peak_bytes=_read_int(cgroup / "memory.peak"),   # kernel 5.19+
                                 source="cgroup",
                                 oom_kills=_read_field(cgroup / "memory.events", "oom_kill"))
        cgroup = self._root / "memory" / relative
        # usage_in_bytes is what systemd itself reads as MemoryCurrent on v1; v1 counts an
        # OOM kill only in the cgroup whose limit was hit (the unit's own MemoryMax=, not a
        # parent slice's), v2 in every ancestor as well
        if (current := _read_int(cgroup / "memory.usage_in_bytes")) is not None:
            return MemoryUse(current_bytes=current,
                             peak_bytes=_read_int(cgroup / "memory.max_usage_in_bytes"),
                             source="cgroup",
                             oom_kills=_read_field(cgroup / "memory.oom_control", "oom_kill"))
        return None

    # -- the processes' PSS --------------------------------------------------------

    def _from_pss(self, control_group: str, relative: str) -> MemoryUse | None:
        pids = self._unit_pids(relative)
        if pids is None:
            self._pss_peaks.pop(control_group, None)
            return None
        total = 0
        seen = set()
        for pid in pids:
            pss = self._pss_bytes(pid)
            if pss is None:
                return None
            if pss >= 0:   # -1: the process is gone, its memory with it
                total += pss
                seen.add(pid)
        return MemoryUse(current_bytes=total, peak_bytes=self._pss_peak(control_group, seen, total),
                         source="pss", oom_kills=None)

    def _pss_peak(self, control_group: str, pids: set[int], total: int) -> int | None:
        if not pids:
            self._pss_peaks.pop(control_group, None)   # nothing left to measure
            return None
        before_pids, before = self._pss_peaks.get(control_group, (frozenset(), 0))
        peak = max(before, total) if before_pids & pids else total
        self._pss_peaks[control_group] = (frozenset(pids), peak)
        return peak

    def _unit_pids(self, relative: str) -> list[int] | None:
        """Every process in the unit's cgroup and below, from systemd's own hierarchy;
        None: the unit has no cgroup there (or it cannot be read)."""
        for hierarchy in (self._root / "systemd", *self._unified_roots()):
            cgroup = hierarchy / relative
            if not (cgroup / "cgroup.procs").exists():
                continue
            try:
                return [pid for procs in _procs_files(cgroup)
                        for pid in _read_pids(procs)]
            except OSError:
                return None
        return None

    def _pss_bytes(self, pid: int) -> int | None:
        """PSS of one process; -1 if it has exited meanwhile, None if it may not be read."""
        try:
            with open(self._proc / str(pid) / "smaps_rollup", "rb") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError):
            return -1
        except OSError:   # EACCES: another user's process, without ptrace read access
            return None
        for line in text.splitlines():
            if line.startswith(b"Pss:"):
                return int(line.split()[1]) * 1024   # "Pss:   1234 kB"
        return 0   # a zombie or kernel thread: no mappings


def _procs_files(cgroup: Path) -> Iterator[Path]:
    """cgroup.procs of the cgroup and of every cgroup below it (each lists only its own)."""
    def fail(error: OSError) -> None:
        raise error
    for directory, subdirs, _files in os.walk(cgroup, onerror=fail):
        subdirs.sort()
        yield Path(directory) / "cgroup.procs"


def _read_pids(procs: Path) -> list[int]:
    try:
        text = procs.read_text()
    except FileNotFoundError:   # a sub-cgroup removed while we walked
        return []
    # 0: a process outside our PID namespace, which we cannot look at
    return [pid for pid in map(int, text.split()) if pid > 0]


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _read_field(path: Path, key: str) -> int | None:
    """The value of "key N" in a flat-keyed cgroup file (memory.events, oom_control)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return None
    return None
