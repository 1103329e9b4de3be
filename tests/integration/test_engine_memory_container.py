"""The test container hands its systemd the memory controller (hybrid hosts), after a
reboot too; where it does not (LAB_MEMORY_CGROUP=0, like a container nobody set up so),
units have no MemoryCurrent and the meter, inside, falls back to their PSS."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.harness.container import SystemdContainer, why_unavailable
from tests.harness.plugin import REPO, unavailable

pytestmark = pytest.mark.container
MIB = 1 << 20
# run inside the container: a unit that writes to 100 MiB, then the meter on it
HOG = ("b = bytearray(100 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
       "open('/run/meter-hog-ready', 'w').write('ready\\n')\nimport time; time.sleep(600)\n")
READ = ("import dataclasses, json, subprocess, sys\n"
        "from gatewayd.adapters.engine_memory import CgroupMemoryMeter\n"
        "group = subprocess.run(['systemctl', 'show', '-P', 'ControlGroup', sys.argv[1]],\n"
        "                       capture_output=True, text=True, check=True).stdout.strip()\n"
        "use = CgroupMemoryMeter().read(group)\n"
        "print(json.dumps(use and dataclasses.asdict(use)))\n")


def memory_current(box: SystemdContainer) -> str:
    """What systemd says of a unit's MemoryCurrent, asked from inside that unit."""
    own_unit = 'basename "$(sed -n "s/^0:://p" /proc/self/cgroup)"'
    return box.run("bash", "-c", f"systemctl show -P MemoryCurrent $({own_unit})",
                   properties={"MemoryAccounting": "yes"}).stdout.strip()


def wait_file(box: SystemdContainer, inside: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not box.host_path(inside).exists():
        assert time.monotonic() < deadline, f"{inside} never appeared in {box.name}"
        time.sleep(0.05)


def test_memory_controller_is_delegated_and_stays_so_after_a_reboot(
        systemd_container: SystemdContainer) -> None:
    box = systemd_container
    if box.shell("stat -fc %T /sys/fs/cgroup").strip() == "cgroup2fs":
        pytest.skip("a unified (v2) host: nspawn delegates the memory controller itself")
    assert memory_current(box).isdigit()
    box.reboot()
    assert memory_current(box).isdigit()


def test_without_the_memory_controller_the_meter_sums_pss() -> None:
    if reason := why_unavailable():
        unavailable(reason)
    box = SystemdContainer(f"nomem-{os.getpid() % 100000}", binds=[REPO], memory_cgroup=False)
    started = box.start()
    try:
        if box.shell("stat -fc %T /sys/fs/cgroup").strip() == "cgroup2fs":
            pytest.skip("a unified (v2) host: the memory controller is always there")
        assert "memory controller not delegated" in started
        assert memory_current(box) == "[not set]"
        python = sys.executable
        box.exec("systemd-run", "--quiet", "--unit=meter-hog", "-p", "MemoryAccounting=yes",
                 python, "-c", HOG)
        wait_file(box, "/run/meter-hog-ready")
        out = box.exec("env", f"PYTHONPATH={REPO}", python, "-c", READ,
                       "meter-hog.service").stdout
        use = json.loads(out)
        assert use is not None and use["source"] == "pss", use
        assert 100 * MIB < use["current_bytes"] < 200 * MIB, use
        assert use["oom_kills"] is None
    finally:
        box.stop()
