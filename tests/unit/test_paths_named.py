"""Every path the code's comments and the docs name exists: a module that moved leaves no
pointer to where it was (comments named http/engine_client and http/native_relay long after
they moved to adapters/engine_wire)."""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).parents[2]
# a module under gatewayd's layers ("core/routes", "gatewayd/http/auth.py") or a file of
# the repository's own folders ("tests/unit/test_x.py", "bench/run")
NAMED = re.compile(
    r"(?<![\w./-])(?:gatewayd/)?(?:core|service|adapters|http)/[\w/]+(?:\.(?:py|c|js|html)\b)?"
    r"|(?<![\w./-])(?:tests|bench|scripts|units|packaging|tmpfiles\.d|docs|\.ci)/[\w./@-]*\w")
SUFFIXES = ("", ".py", ".c", ".js", ".html", ".md", ".sh")


@functools.cache
def tracked() -> frozenset[str]:
    """The repository's files and their folders, as a clean clone has them: what exists only
    on one machine (a run's output, a build) must not decide the check (CI's clone lacked the
    bench's results folder that this machine had)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    return frozenset(str(parent) for name in files if name
                     for parent in (Path(name), *Path(name).parents) if str(parent) != ".")


def is_output(path: str) -> bool:
    """The path is one a run writes (ignored by .gitignore), so it is named rightly though a
    clean clone has no such file yet."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path],
                          cwd=REPO).returncode == 0


def exists(named: str) -> bool:
    path = named.split("::")[0].rstrip("/")
    candidates = [f"{base}{suffix}" for base in (path, f"gatewayd/{path}") for suffix in SUFFIXES]
    # a folder pattern ("/bench/results/") matches a path that does not exist only with a slash
    return any(c in tracked() for c in candidates) or is_output(path) or is_output(f"{path}/")


def named_paths(text: str) -> list[tuple[int, str]]:
    return [(number, m.group(0)) for number, line in enumerate(text.splitlines(), 1)
            for m in NAMED.finditer(line)]


def test_every_path_named_in_the_code_and_the_docs_exists() -> None:
    sources = [p for p in (REPO / "gatewayd").rglob("*")
               if p.suffix in (".py", ".c", ".js", ".html")]
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = [f"{path.relative_to(REPO)}:{number}: {named}"
               for path in sources + docs
               for number, named in named_paths(path.read_text())
               if not exists(named)]
    assert missing == []


def test_the_check_finds_a_moved_module() -> None:
    text = "spoken to by http/engine_client; see core/routes.py and tests/unit/test_nope.py"
    assert [named for _, named in named_paths(text) if not exists(named)] == [
        "http/engine_client", "tests/unit/test_nope.py"]
    assert exists("core/routes") and exists("gatewayd/http/auth.py") and exists("bench/run")


def test_a_run_s_output_is_named_rightly_but_an_untracked_file_is_not(tmp_path: Path) -> None:
    # bench/results is written by a run (ignored), so a clean clone lacks it and it counts;
    # a file that exists only on this machine and is not ignored does not
    assert exists("bench/results/runs")
    stray = REPO / "docs" / "stray-untracked-note.md"
    stray.write_text("x")
    try:
        tracked.cache_clear()
        assert not exists("docs/stray-untracked-note.md")
    finally:
        stray.unlink()
