"""The status page's JavaScript: its computations' unit tests (node --test, node's own
runner) and ESLint over every script the page is made of. Fast tier: no gateway."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.harness.plugin import unavailable

REPO = Path(__file__).resolve().parents[1]
ESLINT = REPO / "tests/js/node_modules/.bin/eslint"
SCRIPTS = sorted((REPO / "gatewayd/http").glob("*.js"))


def node() -> str:
    if found := shutil.which("node"):
        return found
    unavailable("no node: scripts/setup installs Debian's nodejs")


def test_the_pages_computations() -> None:
    proc = subprocess.run([node(), "--test", "tests/js/"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout and "# pass 0" not in proc.stdout, proc.stdout[-2000:]


def test_the_pages_scripts_pass_eslint() -> None:
    node()
    if not ESLINT.exists():
        unavailable("ESLint is not installed: scripts/setup runs npm ci in tests/js")
    assert {p.name for p in SCRIPTS} >= {"console_core.js", "console_page.js"}
    proc = subprocess.run([str(ESLINT), "-c", "tests/js/eslint.config.js", "--max-warnings=0",
                           *(str(p.relative_to(REPO)) for p in SCRIPTS), "tests/js/"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
