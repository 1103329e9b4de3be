"""The folders are the layers, and dependencies point one way.

    core/      pure: the standard library and gatewayd.core only
    service/   + core (effects go through the Protocols of core.ports)
    adapters/  + core and third-party libraries; never service/ or http/
    http/      + core, service, adapters; the aiohttp edge
    (top level: entry points and the composition root, anything)

Read from the folders (every module that exists is checked, none is listed by
hand), by parsing each module's imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gatewayd"
ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "service": {"core", "service"},
    "adapters": {"core", "adapters"},
    "http": {"core", "service", "adapters", "http"},
}
THIRD_PARTY_ALLOWED = {"core": False, "service": False, "adapters": True, "http": True}
ADAPTER_LIBRARIES = ["aiohttp", "dbus_fast", "sdnotify", "pynvml", "sqlite3", "gguf", "numpy",
                     "prometheus_client", "huggingface_hub", "httpx2"]


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "gatewayd":   # from gatewayd import core, adapters...
                found += [(node.lineno, f"gatewayd.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def violations(package: Path) -> list[str]:
    """Every import that points the wrong way, as 'file:line: reason'."""
    problems = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((package / layer).rglob("*.py")):
            for line, name in imports_of(path):
                where = f"{path.relative_to(package.parent)}:{line}"
                top = name.split(".")[0]
                if top == "gatewayd":
                    parts = name.split(".")
                    target = parts[1] if len(parts) > 1 else ""
                    if target not in allowed:
                        problems.append(f"{where}: {layer}/ imports {name}")
                elif top == "__future__" or top in sys.stdlib_module_names:
                    if top == "sqlite3" and not THIRD_PARTY_ALLOWED[layer]:
                        problems.append(f"{where}: {layer}/ does I/O through {name}")
                elif not THIRD_PARTY_ALLOWED[layer]:
                    problems.append(f"{where}: {layer}/ imports the library {name}")
    return problems


def test_every_module_lives_in_a_layer_or_is_an_entry_point() -> None:
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == {"__init__", "__main__", "app", "cli", "cli_fleet", "cli_play", "cli_pull",
                   "engine_launch"}, top
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert layers == set(ALLOWED)


def test_imports_point_one_way() -> None:
    assert violations(PACKAGE) == []


def test_the_check_catches_a_core_module_importing_an_adapter(tmp_path: Path) -> None:
    for layer in ALLOWED:
        (tmp_path / "gatewayd" / layer).mkdir(parents=True)
    (tmp_path / "gatewayd" / "core" / "bad.py").write_text(
        "from gatewayd.adapters.systemd import Systemd\nimport aiohttp\n")
    (tmp_path / "gatewayd" / "service" / "worse.py").write_text("from gatewayd.http import proxy\n")
    (tmp_path / "gatewayd" / "adapters" / "up.py").write_text(
        "from gatewayd.service.dispatcher import Dispatcher\n")
    found = violations(tmp_path / "gatewayd")
    assert found == [
        "gatewayd/core/bad.py:1: core/ imports gatewayd.adapters.systemd",
        "gatewayd/core/bad.py:2: core/ imports the library aiohttp",
        "gatewayd/service/worse.py:1: service/ imports gatewayd.http",
        "gatewayd/adapters/up.py:1: adapters/ imports gatewayd.service.dispatcher",
    ]


@pytest.mark.parametrize("module", sorted(
    f"{layer}.{p.stem}" for layer in ("core", "service")
    for p in (PACKAGE / layer).glob("*.py") if p.stem != "__init__"))
def test_core_and_service_import_without_adapter_libraries(module: str) -> None:
    """The same rule at run time: importing them loads no I/O library at all."""
    blocker = "; ".join(f"sys.modules[{lib!r}] = None" for lib in ADAPTER_LIBRARIES)
    code = f"import sys; {blocker}; import gatewayd.{module}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
