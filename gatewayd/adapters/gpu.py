"""GPU memory from NVML (nvidia-ml-py, imported as pynvml), or a clear "no GPU".

Readings are always fresh (nvmlDeviceGetMemoryInfo on each call): memory an
engine just released shows up late, so the budget is decided on a read taken
right before the decision, never on a cached one.

No NVML (no NVIDIA driver, as on our CI machines) is a normal configuration:
`open_gpu()` returns `NoGpu` with the reason, the VRAM check is skipped, and
`llm-gateway status` says so. `LLM_GATEWAY_FAKE_GPU=TOTAL_MIB:FREE_MIB` makes
it a fixed fake device instead, for tests of the budget through a real gateway
(the NVML path itself is tested on a fake libnvidia-ml.so.1: tests/harness).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from gatewayd.core.budget import MIB
from gatewayd.core.errors import GpuUnavailable
from gatewayd.core.placement import DeviceMemory

FAKE_GPU_ENV = "LLM_GATEWAY_FAKE_GPU"
NVML_LIBRARY = "libnvidia-ml.so.1"   # what pynvml loads on Linux (LD_LIBRARY_PATH applies)


class NoGpu:
    def __init__(self, reason: str) -> None:
        self.description = f"none ({reason}); the VRAM budget is not enforced"

    def devices(self) -> list[DeviceMemory] | None:
        return None

    def process_mib(self) -> dict[int, int] | None:
        return None


class FakeGpu:
    """A fixed device, set from the environment or by tests."""

    def __init__(self, total_mib: int, free_mib: int) -> None:
        self.total_mib, self.free_mib = total_mib, free_mib
        self.description = f"fake device ({free_mib} of {total_mib} MiB free)"

    def devices(self) -> list[DeviceMemory] | None:
        return [DeviceMemory(0, "fake", "fake device", self.total_mib, self.free_mib)]

    def process_mib(self) -> dict[int, int] | None:
        return None


class NvmlGpu:
    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        count = nvml.nvmlDeviceGetCount()
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        self._names = [_text(nvml.nvmlDeviceGetName(h)) for h in self._handles]
        self.description = f"NVML, {count} device(s): {', '.join(self._names) or 'none'}"

    def devices(self) -> list[DeviceMemory] | None:
        """Fresh figures of every device; GpuUnavailable, naming the device, when NVML
        fails on one (never None then: that would switch the budget off)."""
        if not self._handles:
            return None
        out = []
        for i, handle in enumerate(self._handles):
            try:
                info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except self._nvml.NVMLError as e:
                raise GpuUnavailable(
                    f"NVML cannot read GPU {i} ({self._names[i]}, {self._uuids[i]}): {e}; new "
                    "engines are refused until it answers again, running ones are left alone",
                    device=self._uuids[i]) from e
            out.append(DeviceMemory(i, self._uuids[i], self._names[i],
                                    info.total // MIB, info.free // MIB))
        return out

    def process_mib(self) -> dict[int, int] | None:
        """GPU memory each process holds (MiB, summed over devices), from NVML."""
        held: dict[int, int] = {}
        for handle in self._handles:
            try:
                procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except self._nvml.NVMLError:
                return None
            for proc in procs:
                used = proc.usedGpuMemory or 0   # None when the driver cannot tell
                held[proc.pid] = held.get(proc.pid, 0) + used // MIB
        return held


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _nvml_library_present() -> bool:
    """Whether libnvidia-ml can be loaded, asked the way pynvml loads it, before importing
    pynvml (time on the socket-activated start's path, for nothing on a machine without a
    GPU: docs/benchmarks.md, "Figures behind choices in the code")."""
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return False
    return True


def open_gpu() -> NvmlGpu | NoGpu | FakeGpu:
    if fake := os.environ.get(FAKE_GPU_ENV):
        total, _, free = fake.partition(":")
        return FakeGpu(int(total), int(free or total))
    if not _nvml_library_present():
        return NoGpu("NVML unavailable: NVML Shared Library Not Found")
    try:
        import pynvml
    except ImportError:
        return NoGpu("nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
        return NvmlGpu(pynvml)
    except pynvml.NVMLError as e:
        return NoGpu(f"NVML unavailable: {e}")
