"""Every path the code's comments and the docs name exists: a module that moved leaves no
pointer to where it was (comments named http/engine_client and http/native_relay long after
they moved to adapters/engine_wire)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).parents[2]
# a module under gatewayd's layers ("core/routes", "gatewayd/http/auth.py") or a file of
# the repository's own folders ("tests/unit/test_x.py", "bench/run")
NAMED = re.compile(
    r"(?<![\w./-])(?:gatewayd/)?(?:core|service|adapters|http)/[\w/]+(?:\.(?:py|c|js|html)\b)?"
    r"|(?<![\w./-])(?:tests|bench|scripts|units|packaging|tmpfiles\.d|docs|\.ci)/[\w./@-]*\w")
SUFFIXES = ("", ".py", ".c", ".js", ".html", ".md", ".sh")


def exists(named: str) -> bool:
    path = named.split("::")[0]
    return any((REPO / base).with_name((REPO / base).name + suffix).exists()
               for base in (path, f"gatewayd/{path}") for suffix in SUFFIXES)


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
