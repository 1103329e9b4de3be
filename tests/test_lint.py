"""ruff and mypy are part of the test suite: a lint failure is a test failure."""

from __future__ import annotations

import subprocess
import sys

from tests.harness.plugin import REPO


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True,
                          text=True, check=False)


def test_ruff() -> None:
    proc = _run("ruff", "check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy() -> None:
    # incremental (its cache in .mypy_cache, keyed by each file's hash and the options): a
    # fresh clone checks everything (~35 s here), a later run what changed (~2 s), which
    # keeps the fast tier under a minute
    proc = _run("mypy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
