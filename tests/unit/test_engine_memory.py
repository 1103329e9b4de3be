"""The memory meter reads the unit's memory cgroup where there is one (v2, hybrid, v1),
else its processes' PSS, and says which; what it cannot read is None, never a guess.

The trees here are laid out like the kernel's; the real kernel is read by
tests/integration/test_engine_memory_systemd.py (in the container) and below (PSS of
real processes, and what an unprivileged reader gets)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gatewayd.adapters.engine_memory import CgroupMemoryMeter
from gatewayd.core.ports import MemoryUse

UNIT = "/system.slice/llm-engine@x.service"
MIB = 1 << 20


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v2_root(root: Path) -> Path:
    _write(root / "cgroup.controllers", "cpu io memory pids\n")
    return root


def _proc(proc: Path, pid: int, pss_kib: int | None) -> None:
    """A /proc/<pid>/smaps_rollup as the kernel writes it (None: a process without
    mappings, whose file has no lines)."""
    lines = "" if pss_kib is None else (
        f"55d0c0000000-7ffd00000000 ---p 00000000 00:00 0   [rollup]\n"
        f"Rss:              {pss_kib + 100} kB\nPss:              {pss_kib} kB\n"
        f"Pss_Anon:         {pss_kib - 1} kB\nPss_File:             1 kB\n")
    _write(proc / str(pid) / "smaps_rollup", lines)


def test_cgroup_v2_unified_host(tmp_path: Path) -> None:
    unit = _v2_root(tmp_path / "cg") / UNIT.lstrip("/")
    _write(unit / "cgroup.procs", "42\n")
    _write(unit / "memory.current", "123456789\n")
    _write(unit / "memory.peak", "223456789\n")
    _write(unit / "memory.events", "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    meter = CgroupMemoryMeter(tmp_path / "cg", tmp_path / "proc")
    assert meter.read(UNIT) == MemoryUse(123456789, 223456789, "cgroup", 1)


def test_cgroup_v2_without_memory_peak_has_no_peak(tmp_path: Path) -> None:
    """memory.peak came with Linux 5.19."""
    unit = _v2_root(tmp_path / "cg") / UNIT.lstrip("/")
    _write(unit / "memory.current", "4096\n")
    meter = CgroupMemoryMeter(tmp_path / "cg", tmp_path / "proc")
    assert meter.read(UNIT) == MemoryUse(4096, None, "cgroup", None)


def test_cgroup_v1_on_a_hybrid_host(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _v2_root(root / "unified")   # the unified hierarchy holds no memory controller here
    _write(root / "unified" / UNIT.lstrip("/") / "cgroup.procs", "42\n")
    memory = root / "memory" / UNIT.lstrip("/")
    _write(memory / "memory.usage_in_bytes", f"{100 * MIB}\n")
    _write(memory / "memory.max_usage_in_bytes", f"{150 * MIB}\n")
    _write(memory / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    meter = CgroupMemoryMeter(root, tmp_path / "proc")
    assert meter.read(UNIT) == MemoryUse(100 * MIB, 150 * MIB, "cgroup", 2)


def test_hybrid_host_with_memory_on_the_unified_hierarchy(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    unit = _v2_root(root / "unified") / UNIT.lstrip("/")
    _write(unit / "memory.current", "8192\n")
    _write(unit / "memory.events", "oom_kill 0\n")
    meter = CgroupMemoryMeter(root, tmp_path / "proc")
    assert meter.read(UNIT) == MemoryUse(8192, None, "cgroup", 0)


def test_old_v1_kernel_without_oom_kill_count(tmp_path: Path) -> None:
    memory = tmp_path / "cg" / "memory" / UNIT.lstrip("/")
    _write(memory / "memory.usage_in_bytes", "1000\n")
    _write(memory / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\n")
    meter = CgroupMemoryMeter(tmp_path / "cg", tmp_path / "proc")
    assert meter.read(UNIT) == MemoryUse(1000, None, "cgroup", None)


def _v1_without_memory_cgroup(tmp_path: Path, procs: str) -> CgroupMemoryMeter:
    """A hybrid host whose memory hierarchy has no cgroup for the unit (not delegated to
    this systemd): the unit's processes are listed in name=systemd only."""
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    _write(root / "memory" / "memory.usage_in_bytes", "999999999\n")   # not the unit's
    _write(root / "systemd" / UNIT.lstrip("/") / "cgroup.procs", procs)
    _v2_root(root / "unified")
    return CgroupMemoryMeter(root, tmp_path / "proc")


def test_pss_sum_over_the_unit_processes_and_below(tmp_path: Path) -> None:
    meter = _v1_without_memory_cgroup(tmp_path, "10\n11\n")
    _write(tmp_path / "cg/systemd" / UNIT.lstrip("/") / "helper" / "cgroup.procs", "12\n")
    for pid, kib in ((10, 1000), (11, 2000), (12, 3000)):
        _proc(tmp_path / "proc", pid, kib)
    assert meter.read(UNIT) == MemoryUse(6000 * 1024, 6000 * 1024, "pss", None)


def test_pss_skips_a_vanished_process_and_one_without_mappings(tmp_path: Path) -> None:
    meter = _v1_without_memory_cgroup(tmp_path, "10\n11\n12\n0\n")   # 0: another PID ns
    _proc(tmp_path / "proc", 10, 1000)
    _proc(tmp_path / "proc", 12, None)   # a zombie: empty smaps_rollup
    assert meter.read(UNIT) == MemoryUse(1000 * 1024, 1000 * 1024, "pss", None)


def test_pss_of_a_process_it_may_not_read_is_no_figure(tmp_path: Path) -> None:
    """A partial sum would understate the unit: None instead."""
    meter = _v1_without_memory_cgroup(tmp_path, "10\n11\n")
    _proc(tmp_path / "proc", 10, 1000)
    (tmp_path / "proc/11/smaps_rollup").mkdir(parents=True)   # reading it fails (EISDIR)
    assert meter.read(UNIT) is None


def test_pss_peak_is_the_highest_read_until_the_processes_are_all_new(tmp_path: Path) -> None:
    meter = _v1_without_memory_cgroup(tmp_path, "10\n")
    procs = tmp_path / "cg/systemd" / UNIT.lstrip("/") / "cgroup.procs"
    proc = tmp_path / "proc"
    for kib, peak in ((1000, 1000), (3000, 3000), (2000, 3000)):
        _proc(proc, 10, kib)
        use = meter.read(UNIT)
        assert use is not None and (use.current_bytes, use.peak_bytes) == (kib * 1024, peak * 1024)
    procs.write_text("10\n11\n")   # a child came, the unit goes on
    _proc(proc, 11, 500)
    assert (use := meter.read(UNIT)) is not None and use.peak_bytes == 3000 * 1024
    procs.write_text("20\n")       # restarted: its peak starts afresh
    _proc(proc, 20, 700)
    assert (use := meter.read(UNIT)) is not None and use.peak_bytes == 700 * 1024


def test_pss_on_a_unified_host_lists_processes_there(tmp_path: Path) -> None:
    root = _v2_root(tmp_path / "cg")   # memory not enabled for the unit: no memory.current
    _write(root / UNIT.lstrip("/") / "cgroup.procs", "10\n")
    _proc(tmp_path / "proc", 10, 1234)
    meter = CgroupMemoryMeter(root, tmp_path / "proc")
    assert meter.read(UNIT) == MemoryUse(1234 * 1024, 1234 * 1024, "pss", None)


@pytest.mark.parametrize("control_group", [
    UNIT, "", "/", "/system.slice/../../etc", "/system.slice/gone.service"])
def test_no_cgroup_anywhere_is_no_figure(tmp_path: Path, control_group: str) -> None:
    meter = CgroupMemoryMeter(tmp_path / "cg", tmp_path / "proc")
    (tmp_path / "cg/memory").mkdir(parents=True)
    _write(tmp_path / "cg/memory/memory.usage_in_bytes", "1\n")
    _write(tmp_path / "cg/etc/memory.usage_in_bytes", "1\n")
    assert meter.read(control_group) is None


def test_unreadable_or_garbled_cgroup_falls_back_to_pss(tmp_path: Path) -> None:
    meter = _v1_without_memory_cgroup(tmp_path, "10\n")
    memory = tmp_path / "cg/memory" / UNIT.lstrip("/")
    memory.mkdir(parents=True)
    (memory / "memory.usage_in_bytes").mkdir()     # cannot be read as a file
    _proc(tmp_path / "proc", 10, 64)
    use = meter.read(UNIT)
    assert use is not None and use.source == "pss"


# -- real processes ----------------------------------------------------------------


def _toucher(mib: int) -> subprocess.Popen[str]:
    """A process that has written mib MiB of its own memory, then waits."""
    code = (f"b = bytearray({mib} << 20)\n"
            f"for i in range(0, len(b), 4096): b[i] = 1\n"
            "print('ready', flush=True)\nimport sys; sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _tree_listing(tmp_path: Path, *pids: int) -> CgroupMemoryMeter:
    procs = tmp_path / "cg/systemd" / UNIT.lstrip("/") / "cgroup.procs"
    _write(procs, "".join(f"{p}\n" for p in pids))
    return CgroupMemoryMeter(tmp_path / "cg", Path("/proc"))


def test_pss_of_real_processes(tmp_path: Path) -> None:
    toucher = _toucher(100)
    try:
        gone = subprocess.Popen(["true"])
        gone.wait()
        meter = _tree_listing(tmp_path, toucher.pid, gone.pid)
        use = meter.read(UNIT)
        assert use is not None and use.source == "pss"
        assert 100 * MIB < use.current_bytes < 200 * MIB, use
    finally:
        toucher.kill()
        toucher.wait()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root, to read as another user")
def test_another_users_processes_are_no_figure() -> None:
    """A gateway running as its own user, engines as theirs: /proc/<pid>/smaps_rollup
    needs ptrace read access (EACCES without it), so the meter answers None; the same
    reader gets a figure for its own user's process."""
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    roots = _toucher(10)
    own = subprocess.Popen([*nobody, "sleep", "60"])
    tree = Path(tempfile.mkdtemp(prefix="llmgw-meter-"))   # pytest's tmp_path is 0700
    try:
        tree.chmod(0o755)
        for unit, pid in ((UNIT, roots.pid), ("/system.slice/own.service", own.pid)):
            _write(tree / "systemd" / unit.lstrip("/") / "cgroup.procs", f"{pid}\n")
        code = ("from pathlib import Path\n"
                "from gatewayd.adapters.engine_memory import CgroupMemoryMeter\n"
                f"meter = CgroupMemoryMeter(Path({str(tree)!r}))\n"
                f"print(meter.read({UNIT!r}))\n"
                "print(meter.read('/system.slice/own.service').source)\n"
                f"open('/proc/{roots.pid}/smaps_rollup').read()\n")
        out = subprocess.run([*nobody, sys.executable, "-c", code], capture_output=True,
                             text=True, cwd=Path(__file__).parents[2], check=False)
        assert out.stdout == "None\npss\n", out
        assert "PermissionError" in out.stderr, out.stderr
    finally:
        for proc in (roots, own):
            proc.kill()
            proc.wait()
        shutil.rmtree(tree)


def test_the_units_control_group_comes_from_systemd() -> None:
    from gatewayd.adapters.unit_control import info_from_properties
    info = info_from_properties("u.service", {}, {"ControlGroup": UNIT})
    assert info.control_group == UNIT
    # "" while the unit has no cgroup (inactive)
    assert info_from_properties("u.service", {}, {"ControlGroup": ""}).control_group is None
    assert info_from_properties("u.service", {}, {}).control_group is None
