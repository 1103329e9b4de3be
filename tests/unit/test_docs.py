"""The configuration shown in README.md is valid."""

from __future__ import annotations

import re
import tomllib

from gatewayd.core.config import parse_config
from tests.harness.plugin import REPO


def test_readme_config_example_parses() -> None:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", readme, re.S)
    assert blocks, "README.md has no toml example"
    ids = []
    for block in blocks:
        config = parse_config(tomllib.loads(block))
        assert config.models, "the example should show model entries"
        ids += [m.name for m in config.models]
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
    (the README said "25 % above what it reached", the peak alone)."""
    from gatewayd.service.engine_capacity import OOM_GROWTH
    said = f"{OOM_GROWTH:g} \u00d7 the largest of"   # the multiplication sign
    for doc in (REPO / "README.md", REPO / "docs" / "design.md"):
        text = " ".join(doc.read_text().split())
        assert said in text, f"{doc.name} does not say {said!r}"
        assert "25 % above" not in text


def test_the_memory_docs_name_the_load_mode_flag_this_llama_server_takes() -> None:
    """The llama-server scripts/get_llama_server.sh builds refuses llama.cpp's older
    --no-mmap (tests/integration/test_llama_flags_real.py runs it): the docs say -lm none
    and mention --no-mmap only as refused."""
    readme = " ".join((REPO / "README.md").read_text().split())
    assert '`"-lm", "none"`' in readme
    for doc in (REPO / "README.md", REPO / "docs" / "design.md"):
        for line in doc.read_text().replace("\n", " ").split(". "):
            if "--no-mmap" in line:
                assert "refuses" in line, f"{doc.name} recommends --no-mmap: {line!r}"
