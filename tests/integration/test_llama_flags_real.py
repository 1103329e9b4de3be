"""What the docs tell users to pass to llama-server, against the llama-server this project
builds (scripts/get_llama_server.sh): a flag the docs name must start it, and one they
name as refused must be refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine


def run(binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # --version after the flag: the flags are parsed first, then it prints and exits
    return subprocess.run([str(binary), *args, "--version"], capture_output=True,
                          text=True, timeout=30, check=False)


def test_the_load_mode_the_memory_docs_name_is_taken_and_no_mmap_is_refused(
        llama_server: Path) -> None:
    taken = run(llama_server, "-lm", "none")
    assert taken.returncode == 0, taken.stderr[-2000:]
    refused = run(llama_server, "--no-mmap")
    assert refused.returncode != 0
    assert "--no-mmap" in refused.stderr + refused.stdout
