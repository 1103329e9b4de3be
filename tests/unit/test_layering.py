"""Dependencies point one way: the core imports no adapter library (D-Bus, aiohttp, NVML...)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE = ["errors", "config", "catalog", "gguf_meta", "unit_spec", "engine_units", "engines",
        "budget", "routing", "sse", "ports"]
ADAPTER_LIBRARIES = ["aiohttp", "dbus_fast", "sdnotify", "pynvml", "sqlite3", "gguf", "numpy"]


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_without_adapter_libraries(module: str) -> None:
    blocker = "; ".join(f"sys.modules[{lib!r}] = None" for lib in ADAPTER_LIBRARIES)
    code = f"import sys; {blocker}; import gatewayd.{module}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
