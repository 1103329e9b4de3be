"""The test container is a real systemd, isolated from the host, and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.harness.container import SystemdContainer

pytestmark = pytest.mark.container


def _host_processes_in(cgroup_name: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if cgroup_name in (proc / "cgroup").read_text():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_boots_a_real_system_manager_with_bus_and_journal(
        systemd_container: SystemdContainer) -> None:
    box = systemd_container
    assert box.shell("cat /proc/1/comm").strip() == "systemd"
    assert box.shell("systemctl is-system-running").strip() in {"running", "degraded"}
    # PID 1 of the container is a different process from the host's PID 1.
    assert Path(f"/proc/{box.leader}/comm").read_text().strip() == "systemd"
    assert box.leader != 1
    names = box.shell("busctl --system --no-legend list --acquired").split()
    assert "org.freedesktop.systemd1" in names
    marker = f"journal-probe-{os.getpid()}"
    box.shell(f"logger -t probe {marker}")
    box.shell("journalctl --sync")
    assert marker in box.shell("journalctl -t probe -o cat --no-pager")
    # the bus is reachable from the host too, at a /proc/<leader>/root path
    assert Path(box.bus_address.removeprefix("unix:path=")).is_socket()


def test_run_executes_as_a_service_with_its_own_cgroup(
        systemd_container: SystemdContainer) -> None:
    out = systemd_container.run("bash", "-c", "cat /proc/self/cgroup; echo arg=$1", "--",
                                "x y").stdout
    assert "/system.slice/run-u" in out and ".service" in out
    assert "arg=x y" in out
    failed = systemd_container.run("bash", "-c", "exit 7", check=False)
    assert failed.returncode == 7


def test_container_writes_never_reach_the_host(systemd_container: SystemdContainer) -> None:
    box = systemd_container
    with tempfile.NamedTemporaryFile(dir="/tmp", prefix="llmgw-host-marker-") as marker:
        box.shell("echo inside > /etc/llmgw-container-probe; touch /var/lib/llmgw-probe")
        assert not Path("/etc/llmgw-container-probe").exists()
        assert not Path("/var/lib/llmgw-probe").exists()
        # the container's /tmp is its own: the host's /tmp (and this file) stays
        assert box.exec("test", "-e", marker.name, check=False).returncode != 0
        assert Path(marker.name).exists()
    assert (box.state_dir / "upper/etc/llmgw-container-probe").exists()


def test_reboot_in_place_keeps_state(systemd_container: SystemdContainer) -> None:
    box = systemd_container
    box.shell("mkdir -p /var/lib/probe && echo kept > /var/lib/probe/state && "
              "printf '[Service]\\nType=oneshot\\nRemainAfterExit=yes\\nExecStart=/bin/true\\n"
              "[Install]\\nWantedBy=multi-user.target\\n' > /etc/systemd/system/probe.service && "
              "systemctl enable --quiet probe.service")
    boot_before = box.shell("cat /proc/sys/kernel/random/boot_id").strip()
    leader_before = box.leader
    box.reboot()
    assert box.leader != leader_before
    assert box.shell("cat /var/lib/probe/state").strip() == "kept"
    # an enabled unit came up by itself on the new boot: this is a real boot, not a reattach
    assert box.shell("systemctl is-active probe.service").strip() == "active"
    # a new boot: nspawn gives every boot its own boot id, and the journal kept the old one
    boot_after = box.shell("cat /proc/sys/kernel/random/boot_id").strip()
    assert boot_after != boot_before
    boots = box.shell("journalctl --list-boots --no-pager")
    assert boot_before.replace("-", "") in boots and boot_after.replace("-", "") in boots


def test_stop_leaves_nothing_behind(tmp_path: Path) -> None:
    from tests.harness.container import why_unavailable
    from tests.harness.plugin import unavailable

    if reason := why_unavailable():
        unavailable(reason)
    box = SystemdContainer(f"leftover-{os.getpid() % 100000}", state_root=tmp_path / "state")
    box.start()
    leader = box.leader
    box.run("bash", "-c", "sleep 300 & disown; systemd-run --unit=sleeper sleep 300")
    cgroup = f"lab-{box.name}"
    assert _host_processes_in(cgroup), "the container's processes should be in its cgroup"
    memory_file = box.state_dir / "memory-cgroup"   # hybrid hosts: its own v1 memory cgroup
    memory = Path(memory_file.read_text().strip()) if memory_file.exists() else None
    box.stop()
    assert not Path(f"/proc/{leader}").exists()
    assert _host_processes_in(cgroup) == []
    for root in ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        assert not Path(root, cgroup).exists()
    assert memory is None or not memory.exists()
    assert not box.state_dir.exists()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert box.name not in mounts
    leftovers = subprocess.run(["findmnt", "-rn", "-o", "SOURCE"], capture_output=True,
                               text=True, check=True).stdout
    assert f"lab-{box.name}" not in leftovers
