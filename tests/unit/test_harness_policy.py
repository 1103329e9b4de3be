"""Where the real thing cannot run, tests skip locally but fail under CI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness.container import SystemdContainer
from tests.harness.plugin import unavailable


def test_unavailable_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no container here"):
        unavailable("no container here")


def test_unavailable_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        unavailable("no container here")


@pytest.mark.parametrize("name", ["", "Upper", "-x", "a/b", "x" * 40, "a b"])
def test_container_names_are_checked(name: str) -> None:
    with pytest.raises(ValueError):
        SystemdContainer(name)


def test_no_test_kills_a_pid_it_did_not_check() -> None:
    """`kill -9 $(... MainPID ...)` with an empty or 0 PID would be `kill -9 0`: every
    process in the group. Shell snippets in tests must check the PID first."""
    offenders = [str(p) for p in Path(__file__).parents[1].rglob("*.py")
                 if p != Path(__file__) and re.search(r"kill\s+-(9|KILL)\s+\$\(", p.read_text())]
    assert offenders == []
