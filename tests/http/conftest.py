"""Fixtures shared by the HTTP tests: `calls`, a stand-in journalctl first on PATH (the
live-log tests: tests/http/test_events_and_logs.py, the console's)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# prints two lines (one with ERROR), then, following (-f), a third once the file "more"
# appears, and waits for ever; each run leaves its argv in calls/PID.json
STAND_IN = """#!{python}
import json, os, pathlib, sys, time
calls = pathlib.Path({calls!r})
(calls / f"{{os.getpid()}}.json").write_text(json.dumps(sys.argv[1:]))
print("2024-05-01T10:00:00+0000 host srv[7]: first line")
print("2024-05-01T10:00:01+0000 host srv[7]: ERROR second line", flush=True)
if "-f" not in sys.argv:
    sys.exit(0)
while not (calls / "more").exists():
    time.sleep(0.02)
print("2024-05-01T10:00:02+0000 host srv[7]: written after the follow began", flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in journalctl first on PATH; the folder where its runs leave their argv."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    script = bin_dir / "journalctl"
    script.write_text(STAND_IN.format(python=sys.executable, calls=str(calls)))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls
