"""The real NVML adapter (nvidia-ml-py → libnvidia-ml.so.1) against the fake library from
tests/harness/fake_nvml.c: each case runs in its own process, as the gateway does, with
the library found through LD_LIBRARY_PATH. Replace the adapter with a stub and these fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.harness.fake_nvml import GPU_IS_LOST, FakeNvml, devices

PROBE = """
import json, sys
from gatewayd.adapters.gpu import open_gpu
from gatewayd.core.placement import select, total
gpu = open_gpu()
out = {"description": gpu.description}
try:
    found = gpu.devices()
    out["devices"] = found and [[d.index, d.uuid, d.name, d.total_mib, d.free_mib]
                                for d in found]
    for spec in (None, "1", "GPU-fake-0"):
        chosen = found and select(spec, found)
        out[str(spec)] = chosen and [*total(chosen), [d.uuid for d in chosen]]
    out["processes"] = gpu.process_mib()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def probe(fake: FakeNvml, library_dir: Path) -> dict[str, Any]:
    fake.write()
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env={**os.environ, **fake.env(library_dir)}, check=True)
    return dict(json.loads(proc.stdout))


def test_memory_per_device_and_per_process(tmp_path: Path, fake_nvml_dir: Path) -> None:
    fake = FakeNvml(tmp_path / "nvml.state", devices=devices(
        ("NVIDIA Fake H100 80GB", 81920, 10240), ("NVIDIA Fake L4", 24576, 1024)),
        processes=[(0, 4242, 8192), (1, 4242, 512), (1, 777, 256)])
    out = probe(fake, fake_nvml_dir)
    assert out["description"] == ("NVML, 2 device(s): NVIDIA Fake H100 80GB, "
                                  "NVIDIA Fake L4")
    assert out["devices"] == [[0, "GPU-fake-0", "NVIDIA Fake H100 80GB", 81920, 71680],
                              [1, "GPU-fake-1", "NVIDIA Fake L4", 24576, 23552]]
    assert out["None"] == [106496, 95232, ["GPU-fake-0", "GPU-fake-1"]]
    assert out["1"] == [24576, 23552, ["GPU-fake-1"]]          # CUDA_VISIBLE_DEVICES=1
    assert out["GPU-fake-0"] == [81920, 71680, ["GPU-fake-0"]]  # ... or a UUID
    assert out["processes"] == {"4242": 8704, "777": 256}      # summed over devices


def test_no_device_a_failed_init_and_a_lost_gpu(tmp_path: Path, fake_nvml_dir: Path) -> None:
    empty = probe(FakeNvml(tmp_path / "none.state"), fake_nvml_dir)
    assert empty["description"] == "NVML, 0 device(s): none" and empty["None"] is None
    failing = FakeNvml(tmp_path / "init.state", errors={"nvmlInit": 999})
    assert probe(failing, fake_nvml_dir)["description"].startswith(
        "none (NVML unavailable: Unknown Error)")
    lost = FakeNvml(tmp_path / "lost.state", devices=devices(("Fake", 1024, 0)),
                    errors={"nvmlDeviceGetMemoryInfo": GPU_IS_LOST})
    error = probe(lost, fake_nvml_dir)["error"]   # never None: that would lift the budget
    assert error.startswith("GpuUnavailable") and "GPU is lost" in error
    assert "GPU-fake-0" in error


def test_the_gpu_check_script_says_what_admission_would_decide(
        tmp_path: Path, fake_nvml_dir: Path) -> None:
    """scripts/gpu-check, the one run to make where a GPU is lent: the adapter's figures
    and admission's verdict per model (here on the fake library)."""
    fake = FakeNvml(tmp_path / "nvml.state", devices=devices(
        ("NVIDIA Fake A", 8192, 7168), ("NVIDIA Fake B", 8192, 0)))
    fake.write()
    for name in ("a", "b"):
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF" + b"\0" * 1024)
    config = tmp_path / "gateway.toml"
    config.write_text(f'[models.small]\npath = "{tmp_path / "a.gguf"}"\n'
                      'cuda_visible_devices = "0"\n'
                      f'[models.other]\npath = "{tmp_path / "b.gguf"}"\n'
                      'cuda_visible_devices = "1"\n')
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"
    proc = subprocess.run([sys.executable, str(script), "--config", str(config), "--json"],
                          capture_output=True, text=True, check=False,
                          env={**os.environ, **fake.env(fake_nvml_dir)})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["per_device_mib"]["GPU-fake-1"] == {"index": 1, "name": "NVIDIA Fake B",
                                                      "total": 8192, "free": 8192}
    small, other = report["admission"]
    assert small.startswith("small: needs 1025 MiB; 1024 MiB free on GPU-fake-0: refused")
    assert other.startswith("other: needs 1025 MiB; 8192 MiB free on GPU-fake-1: admitted")


def test_no_library_is_no_gpu_without_importing_pynvml(tmp_path: Path) -> None:
    """A machine without the NVIDIA driver: NoGpu, said as NVML itself says it, and pynvml
    (~9 ms of every start) never imported."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    proc = subprocess.run([sys.executable, "-c", (
        "import json, sys; from gatewayd.adapters.gpu import open_gpu; gpu = open_gpu(); "
        "print(json.dumps([gpu.description, 'pynvml' in sys.modules]))")],
        capture_output=True, text=True, env={**env, "LD_LIBRARY_PATH": str(tmp_path)},
        check=True)
    description, imported = json.loads(proc.stdout)
    assert description.startswith("none (NVML unavailable: NVML Shared Library Not Found)")
    assert imported is False
