"""GPU memory from NVML (nvidia-ml-py, imported as pynvml), or a clear "no GPU".

Readings are always fresh (nvmlDeviceGetMemoryInfo on each call): memory an
engine just released shows up late, so the budget is decided on a read taken
right before the decision, never on a cached one.

No NVML (no NVIDIA driver, as on our CI machines) is a normal configuration:
`open_gpu()` returns `NoGpu` with the reason, the VRAM check is skipped, and
`llm-gateway status` says so. `LLM_GATEWAY_FAKE_GPU=TOTAL_MIB:FREE_MIB` makes
it a fixed fake device instead, for tests of the budget through a real gateway.
"""

from __future__ import annotations

import os
from typing import Any

from gatewayd.core.budget import MIB, GpuMemory
from gatewayd.core.errors import GpuUnavailable

FAKE_GPU_ENV = "LLM_GATEWAY_FAKE_GPU"


class NoGpu:
    def __init__(self, reason: str) -> None:
        self.description = f"none ({reason}); the VRAM budget is not enforced"

    def memory(self, devices: str | None = None) -> GpuMemory | None:
        return None

    def process_mib(self) -> dict[int, int] | None:
        return None


class FakeGpu:
    """A fixed device, set from the environment or by tests."""

    def __init__(self, total_mib: int, free_mib: int) -> None:
        self.total_mib, self.free_mib = total_mib, free_mib
        self.description = f"fake device ({free_mib} of {total_mib} MiB free)"

    def memory(self, devices: str | None = None) -> GpuMemory | None:
        return GpuMemory(total_mib=self.total_mib, free_mib=self.free_mib, devices=("fake",))

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

    def memory(self, devices: str | None = None) -> GpuMemory | None:
        """Fresh figures of the chosen devices; GpuUnavailable, naming the device, when NVML
        fails on one (never None then: that would switch the budget off)."""
        chosen = self._select(devices)
        if not chosen:
            return None
        total = free = 0
        for i in chosen:
            try:
                info = self._nvml.nvmlDeviceGetMemoryInfo(self._handles[i])
            except self._nvml.NVMLError as e:
                raise GpuUnavailable(
                    f"NVML cannot read GPU {i} ({self._names[i]}, {self._uuids[i]}): {e}; new "
                    "engines are refused until it answers again, running ones are left alone",
                    device=self._uuids[i]) from e
            total += info.total
            free += info.free
        return GpuMemory(total_mib=total // MIB, free_mib=free // MIB,
                         devices=tuple(self._uuids[i] for i in chosen))

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

    def _select(self, devices: str | None) -> list[int]:
        """Device indices named by a CUDA_VISIBLE_DEVICES value (indices or UUIDs)."""
        if devices is None:
            return list(range(len(self._handles)))
        chosen = []
        for item in (d.strip() for d in devices.split(",") if d.strip()):
            if item.isdigit() and int(item) < len(self._handles):
                chosen.append(int(item))
            else:
                chosen += [i for i, uuid in enumerate(self._uuids) if uuid.startswith(item)]
        return chosen


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def open_gpu() -> NvmlGpu | NoGpu | FakeGpu:
    if fake := os.environ.get(FAKE_GPU_ENV):
        total, _, free = fake.partition(":")
        return FakeGpu(int(total), int(free or total))
    try:
        import pynvml
    except ImportError:
        return NoGpu("nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
        return NvmlGpu(pynvml)
    except pynvml.NVMLError as e:
        return NoGpu(f"NVML unavailable: {e}")
