"""The machine's memory from /proc/meminfo (MemTotal, MemAvailable), and the kernel's
count of OOM kills from /proc/vmstat."""

from __future__ import annotations

from pathlib import Path

from gatewayd.core.errors import GatewayError
from gatewayd.core.ram_budget import HostMemory

MEMINFO = Path("/proc/meminfo")
VMSTAT = Path("/proc/vmstat")


class MemInfo:
    """Reads /proc/meminfo (one small file: well under a millisecond) at each decision."""

    def __init__(self, path: Path = MEMINFO, vmstat: Path = VMSTAT) -> None:
        self.path = path
        self.vmstat = vmstat

    def oom_kills(self) -> int | None:
        """The kernel's OOM kills since boot (Linux 4.13+; the same in a container, whose
        /proc/vmstat is the machine's)."""
        try:
            for line in self.vmstat.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return None

    def read(self) -> HostMemory:
        fields: dict[str, int] = {}
        try:
            for line in self.path.read_text().splitlines():
                name, _, value = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    fields[name] = int(value.split()[0])   # kB
        except (OSError, ValueError, IndexError) as e:
            raise GatewayError(f"cannot read {self.path}: {e}") from None
        if "MemTotal" not in fields:
            raise GatewayError(f"{self.path} has no MemTotal")
        # kernels before 3.14 have no MemAvailable: nothing is known to be free beyond it
        total = fields["MemTotal"] // 1024
        return HostMemory(total_mib=total,
                          available_mib=fields.get("MemAvailable", 0) // 1024)
