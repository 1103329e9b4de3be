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
    for block in blocks:
        config = parse_config(tomllib.loads(block))
        assert config.models, "the example should show model entries"
    ids = [m.name for m in config.models]
    assert "qwen2.5-7b" in ids


def test_readme_opens_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    first_block = lines[lines.index("```sh") + 1: lines.index("```sh") + 3]
    assert first_block[0].startswith("./scripts/demo")
    assert first_block[1].startswith("./scripts/test")
    ci = (REPO / ".ci" / "run").read_text()
    command = first_block[1].split("#")[0].strip()
    assert f"\n{command}\n" in ci  # CI runs exactly the README's test command
