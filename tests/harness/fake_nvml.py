"""The fake libnvidia-ml.so.1 (fake_nvml.c): built with gcc in seconds, found by the real
nvidia-ml-py through LD_LIBRARY_PATH, driven by a state file the tests rewrite at run time."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_nvml.c")
LIBRARY = "libnvidia-ml.so.1"
STATE_ENV = "FAKE_NVML_STATE"
MIB = 1024 * 1024
GPU_IS_LOST = 15
UNKNOWN = 999


def build(directory: Path) -> Path:
    """directory/libnvidia-ml.so.1, compiled from fake_nvml.c; the directory to put on
    LD_LIBRARY_PATH."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror",
                    f"-Wl,-soname,{LIBRARY}", "-o", str(directory / LIBRARY), str(SOURCE)],
                   check=True)
    return directory


@dataclass
class Device:
    uuid: str
    name: str
    total_mib: int
    used_mib: int = 0


@dataclass
class FakeNvml:
    """What the fake library reports; write() puts it in the state file it reads on
    every call."""

    path: Path
    devices: list[Device] = field(default_factory=list)
    processes: list[tuple[int, int, int]] = field(default_factory=list)  # (device, pid, MiB)
    errors: dict[str, int] = field(default_factory=dict)   # NVML function (or "*") -> code
    driver: str = "550.54.15"

    def env(self, library_dir: Path) -> dict[str, str]:
        return {"LD_LIBRARY_PATH": str(library_dir), STATE_ENV: str(self.path)}

    def write(self) -> None:
        lines = [f"driver {self.driver}"]
        lines += [f"device {d.uuid} {d.total_mib * MIB} {d.used_mib * MIB} {d.name}"
                  for d in self.devices]
        lines += [f"proc {device} {pid} {mib * MIB}" for device, pid, mib in self.processes]
        lines += [f"error {function} {code}" for function, code in self.errors.items()]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)   # the library never reads half a file


def devices(*specs: tuple[str, int, int]) -> list[Device]:
    """(name, total MiB, used MiB) -> devices with UUIDs GPU-fake-0, GPU-fake-1, ..."""
    return [Device(f"GPU-fake-{i}", name, total, used)
            for i, (name, total, used) in enumerate(specs)]
