"""The configuration's schema (core/config_schema) holds the parser, the dataclasses and
the reference in docs/configuration.md to one declaration of each key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gatewayd.core import upstreams
from gatewayd.core.auth import parse_keys
from gatewayd.core.config import _OPENAI_ONLY, GatewayConfig, ModelConfig, parse_config
from gatewayd.core.config_schema import KEYS, TABLES, Key, Kind, keys_of, known, markdown
from gatewayd.core.errors import ConfigError
from gatewayd.core.variants import VariantConfig

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"
BEGIN, END = "<!-- config-keys: begin -->\n", "<!-- config-keys: end -->"
# the tables core/config reads (the keys file and [upstreams.NAME] have their own readers)
READ_HERE = [key for key in KEYS if key.table not in ("keys.NAME", "upstreams.NAME")]


def _block() -> str:
    text = PAGE.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)]


def test_the_reference_in_the_docs_is_the_one_the_schema_generates() -> None:
    assert _block() == markdown(), (
        "docs/configuration.md's key reference differs from the schema: replace what is "
        "between its config-keys markers with `python -m gatewayd.core.config_schema "
        "--markdown`")


def test_every_key_is_documented_under_its_table() -> None:
    block = _block()
    for table in TABLES:
        heading = "### Top level" if table == "" else f"### `[{table}]`"
        assert heading in block, heading
        section = block[block.index(heading):].split("\n### ")[0]
        for key in keys_of(table):
            assert f"| `{key.name}` |" in section, f"{table or 'top level'}: {key.name}"
            assert key.doc.strip(), f"{key.name} has no description"


def test_the_command_prints_the_reference() -> None:
    proc = subprocess.run([sys.executable, "-m", "gatewayd.core.config_schema", "--markdown"],
                          capture_output=True, text=True, check=True, cwd=REPO)
    assert proc.stdout == markdown()


def test_every_key_has_one_table_and_one_name() -> None:
    assert all(key.table in TABLES for key in KEYS)
    names = [(key.table, key.name) for key in KEYS]
    assert len(names) == len(set(names))
    assert all(key.words for key in KEYS if key.kind is Kind.WORD)


def test_the_defaults_are_the_dataclasses_defaults() -> None:
    """The schema's defaults and GatewayConfig's / ModelConfig's are one set of values: an
    empty file is the default configuration, a model with only a path the default model."""
    assert parse_config({}) == GatewayConfig()
    (model,) = parse_config({"models": {"m": {"path": "/m.gguf"}}}).models
    assert model == ModelConfig(name="m", path=Path("/m.gguf"))


def test_every_key_fills_a_field() -> None:
    gateway = {f.name for f in dataclasses.fields(GatewayConfig)}
    model = {f.name for f in dataclasses.fields(ModelConfig)}
    variant = {f.name for f in dataclasses.fields(VariantConfig)}
    for key in READ_HERE:
        if not key.custom:
            fields = {"models.NAME": model, "models.VARIANT": variant}.get(key.table, gateway)
            assert key.fills in fields, key


def test_the_other_readers_know_the_keys_the_schema_declares() -> None:
    """[upstreams.NAME] (core/upstreams) and the keys file (core/auth) are read by their
    own modules: they accept exactly the keys declared for them."""
    assert known("upstreams.NAME") == upstreams._UPSTREAM_KEYS
    entry: dict[str, Any] = {"sha256": "0" * 64, "models": ["*"], "scopes": ["inference"],
                             "priority": "high"}
    assert set(entry) == known("keys.NAME")
    parse_keys({"keys": {"k": entry}}, "keys.toml")
    with pytest.raises(ConfigError, match="unknown key"):
        parse_keys({"keys": {"k": {**entry, "scope": ["admin"]}}}, "keys.toml")


def _file(key: Key, value: Any) -> tuple[dict[str, Any], str]:
    """A configuration that sets key to value, and the key as its messages name it."""
    if key.table == "":
        return {key.name: value}, key.name
    if key.table == "models.NAME":
        model = {"path": "/m.gguf"} if key.name != "path" else {}
        return {"models": {"m": {**model, key.name: value}}}, f"models.m.{key.name}"
    if key.table == "models.VARIANT":   # a variant of m
        return ({"models": {"m": {"path": "/m.gguf"},
                            "v": {"variant_of": "m", key.name: value}}}, f"models.v.{key.name}")
    return {key.table: {key.name: value}}, f"{key.table}.{key.name}"


WRONG: dict[Kind, Any] = {
    Kind.INTEGER: "4", Kind.NUMBER: "4", Kind.BOOLEAN: "yes", Kind.STRING: 4,
    Kind.WORD: "nonesuch", Kind.PATH: 4, Kind.PROGRAM: 4, Kind.SIZE: "lots",
    Kind.CPU_QUOTA: "2", Kind.STRINGS: "x", Kind.STRING_TABLE: "x", Kind.TABLE: "x"}


@pytest.mark.parametrize("key", READ_HERE, ids=lambda k: f"{k.table}.{k.name}".strip("."))
def test_a_value_of_the_wrong_type_is_refused_naming_its_key(key: Key) -> None:
    data, name = _file(key, WRONG[key.kind])
    if key.name in _OPENAI_ONLY:   # openai's keys
        data["models"]["m"] = {**data["models"]["m"], "backend": "openai"}
    with pytest.raises(ConfigError) as refused:
        parse_config(data)
    assert name in str(refused.value)


@pytest.mark.parametrize("key", [k for k in READ_HERE if k.bounds],
                         ids=lambda k: f"{k.table}.{k.name}".strip("."))
def test_each_bound_holds_at_its_edges_and_refuses_past_them(key: Key) -> None:
    edges: list[tuple[float, float]] = [
        (b.low + 1 if b.above else b.low, b.low if b.above else b.low - 1) for b in key.bounds]
    edges += [(b.high, b.high + 1) for b in key.bounds if b.high != float("inf")]
    openai = {"backend": "openai", "command": ["srv", "--uds", "{socket}"]}
    for inside, outside in edges:
        # a key's bounds hold together: NOT_NEGATIVE's 0 is not inside POSITIVE
        for value, ok in ((inside, all(b.holds(inside) for b in key.bounds)), (outside, False)):
            data, name = _file(key, value)
            if key.name == "ready_status":
                data["models"]["m"] = {**data["models"]["m"], **openai}
            if ok:
                parse_config(data)
            else:
                with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
                    parse_config(data)
