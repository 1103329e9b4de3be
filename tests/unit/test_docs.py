"""The docs (README.md, the front door, and the pages under docs/) say what is true: their
configuration examples are valid, their links lead somewhere, the README stays short."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from gatewayd.core.catalog import build_catalog
from gatewayd.core.config import parse_config
from tests.harness.plugin import REPO

README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]


def test_every_config_example_in_the_docs_parses() -> None:
    """Every toml block of README.md and docs/*.md is a valid configuration with models."""
    ids = []
    for doc in DOCS:
        for block in re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S):
            config = parse_config(tomllib.loads(block))
            assert config.models, f"{doc.name}: the example should show model entries"
            build_catalog(config, (), {})   # its names and variants hold together
            ids += [m.name for m in config.models]
    assert re.findall(r"```toml\n", README.read_text()), "README.md has no toml example"
    assert "qwen2.5-7b" in ids and "qwen-vllm" in ids   # the configuration; the recipes


def test_readme_opens_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    first_block = lines[lines.index("```sh") + 1: lines.index("```sh") + 3]
    assert first_block[0].startswith("./scripts/demo")
    assert first_block[1].startswith("./scripts/test")
    ci = (REPO / ".ci" / "run").read_text()
    command = first_block[1].split("#")[0].strip()
    assert f"\n{command}\n" in ci  # CI runs exactly the README's test command


def test_design_names_every_module_under_its_layer() -> None:
    """docs/design.md's "Layers" section names each module in its folder's bullet."""
    design = (REPO / "docs" / "design.md").read_text()
    layers = design[design.index("## Layers"):design.index("### Why dbus-fast")]
    bullets = {m.group(1): m.group(0) for m in re.finditer(
        r"^- \*\*`?([\w /]+?)/?`?\*\*.*?(?=^- \*\*|\Z)", layers, re.S | re.M)}
    package = REPO / "gatewayd"
    missing = []
    for path in sorted(package.rglob("*.py")):
        if path.stem == "__init__":
            continue
        folder = str(path.parent.relative_to(package)) if path.parent != package \
            else "top level"
        if f"`{path.stem}`" not in bullets.get(folder, ""):
            missing.append(f"{path.relative_to(REPO)} (under {folder})")
    assert missing == []


def test_the_docs_say_the_need_an_oom_kill_teaches_as_the_code_takes_it() -> None:
    """learn_oom takes OOM_GROWTH times the largest of the need, the peak and memory_max
    (the docs said "25 % above what it reached", the peak alone)."""
    from gatewayd.service.engine_capacity import OOM_GROWTH
    said = f"{OOM_GROWTH:g} \u00d7 the largest of"   # the multiplication sign
    for doc in (REPO / "docs" / "memory.md", REPO / "docs" / "design.md"):
        text = " ".join(doc.read_text().split())
        assert said in text, f"{doc.name} does not say {said!r}"
    for doc in DOCS:
        assert "25 % above" not in " ".join(doc.read_text().split()), doc.name


def test_the_memory_docs_name_the_load_mode_flag_this_llama_server_takes() -> None:
    """The llama-server scripts/get_llama_server.sh builds refuses llama.cpp's older
    --no-mmap (tests/integration/test_llama_flags_real.py runs it): the docs say -lm none
    and mention --no-mmap only as refused."""
    memory = " ".join((REPO / "docs" / "memory.md").read_text().split())
    assert '`"-lm", "none"`' in memory
    for doc in DOCS:
        for line in doc.read_text().replace("\n", " ").split(". "):
            if "--no-mmap" in line:
                assert "refuses" in line, f"{doc.name} recommends --no-mmap: {line!r}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(doc: Path) -> list[str]:
    """The targets of a page's markdown links and images, outside code blocks."""
    targets, fenced = [], False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            targets += re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line)
    return targets


def test_every_relative_link_in_the_docs_leads_somewhere() -> None:
    """A relative link in README.md or docs/*.md names a file that exists, and its #anchor a
    heading of that page."""
    broken = []
    for doc in DOCS:
        for target in _links(doc):
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):    # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            page = (doc.parent / path).resolve() if path else doc
            if not page.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_is_a_front_door() -> None:
    """README.md stays short (the rest lives under docs/), and every page under docs/ is
    reachable from it."""
    lines = README.read_text().splitlines()
    assert len(lines) < 220, f"README.md has {len(lines)} lines: move sections into docs/"
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README)}
    unlinked = [p.name for p in DOCS[1:] if p.resolve() not in linked]
    assert unlinked == [], "pages under docs/ that README.md does not link"
