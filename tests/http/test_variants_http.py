"""Variants and LoRA adapters over real HTTP, against fake engines: a variant's request
reaches its base's engine with its defaults and limits, an adapter's with its lora list,
and each is a model of its own to /v1/models, keys and the records. (The real engine's
answers: tests/integration/test_variants_e2e.py.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gatewayd.core.auth import digest, parse_keys
from gatewayd.core.catalog import ModelFile, build_catalog
from gatewayd.core.config import Backend
from gatewayd.core.variants import Adapter
from tests.http.test_front_door import Gateway, _gateway, chat

VARIANTS = {
    "coder": {"variant_of": "a", "aliases": ["code"], "system_prompt": "You write code.",
              "defaults": {"temperature": 0.2,
                           "chat_template_kwargs": {"enable_thinking": False}},
              "limits": {"max_tokens": 8}},
    "sql-low": {"variant_of": "a", "adapter": "sql", "priority": "low"},
}
ADAPTERS = {"a": {"adapters": (Adapter("sql", Path("/m/sql.gguf")),
                               Adapter("fr", Path("/m/fr.gguf"), 0.5))}}
USER, CODER_ONLY, OPS = "sk-llmgw-user", "sk-llmgw-coder-only", "sk-llmgw-ops"


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    keys = parse_keys({"keys": {"user": {"sha256": digest(USER)},
                                "coder": {"sha256": digest(CODER_ONLY), "models": ["coder"]},
                                "ops": {"sha256": digest(OPS), "scopes": ["admin"]}}},
                      "test")
    async for g in _gateway(tmp_path, ("a",), variants=VARIANTS, models_config=ADAPTERS,
                            api_keys=keys):
        yield g


def bearer(key: str = USER) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sent(gw: Gateway) -> dict[str, Any]:
    """The body engine a saw last."""
    body: dict[str, Any] = json.loads(gw.fakes["a"].requests[-1].body)
    return body


def unit_of(gw: Gateway, model: str) -> str:
    engine = gw.engines.registry.get(model)
    assert engine is not None
    return engine.unit


async def test_a_variant_reaches_its_bases_engine_with_its_defaults_and_limit(
        gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", headers=bearer(), json={
        "model": "code", "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 200, await resp.text()
    body = sent(gw)
    assert body["temperature"] == 0.2
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["max_tokens"] == 8
    assert body["messages"][0] == {"role": "system", "content": "You write code."}
    assert body["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    assert [e.model_id for e in gw.engines.registry.engines()] == ["a"]   # no engine of its own
    row = (await gw.records(1))[0]
    assert row["model"] == "coder" and row["engine"] == unit_of(gw, "a")


async def test_the_clients_values_win_over_defaults_never_over_the_limit(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", headers=bearer(), json={
        "model": "coder", "temperature": 1.1, "max_tokens": 500, "n_predict": 9000,
        "chat_template_kwargs": {"enable_thinking": True, "x": 1},
        "messages": [{"role": "system", "content": "mine"},
                     {"role": "user", "content": "hi"}]})
    assert resp.status == 200, await resp.text()
    body = sent(gw)
    assert body["temperature"] == 1.1
    assert body["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}
    assert (body["max_tokens"], body["n_predict"]) == (8, 8)
    assert body["messages"][0] == {"role": "system", "content": "mine"}
    bad = await gw.client.post("/v1/chat/completions", headers=bearer(),
                               json={"model": "coder", "max_tokens": "lots"})
    assert bad.status == 400
    assert (await bad.json())["error"]["param"] == "max_tokens"


async def test_an_adapter_and_the_base_share_one_engine_each_with_its_lora_list(
        gw: Gateway) -> None:
    asked = {"a": [0.0, 0.0], "a:sql": [1.0, 0.0], "A:FR": [0.0, 0.5], "sql-low": [1.0, 0.0]}
    unit = unit_of(gw, "a")
    for name, scales in asked.items():
        resp = await gw.client.post("/v1/chat/completions", headers=bearer(),
                                    json={**chat(name), "lora": [{"id": 1, "scale": 9}]})
        assert resp.status == 200, await resp.text()
        assert sent(gw)["lora"] == [{"id": i, "scale": s} for i, s in enumerate(scales)], name
    assert [(e.model_id, e.unit) for e in gw.engines.registry.engines()] == [("a", unit)]
    rows = await gw.records(4)
    assert sorted(r["model"] for r in rows) == ["a", "a:fr", "a:sql", "sql-low"]


async def test_a_request_that_cannot_carry_the_lora_list_is_refused(gw: Gateway) -> None:
    # (an upload is refused the same way: llama-server takes one only for a transcription,
    # from a chat model whose projector encodes sound)
    resp = await gw.client.post("/v1/completions?model=a:sql", headers=bearer())
    body = await resp.json()
    assert resp.status == 400 and "LoRA adapters" in body["error"]["message"], body
    # llama-server's Anthropic path drops the list (every adapter would apply)
    resp = await gw.client.post("/v1/messages", headers=bearer(), json={
        "model": "a", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    body = await resp.json()
    assert resp.status == 400 and "/v1/chat/completions" in body["error"]["message"], body
    assert not [r for r in gw.fakes["a"].requests
                if r.path in ("/v1/completions", "/v1/messages")]
    # a path that runs no model needs no list: an empty body passes
    await gw.client.post("/slots/0?action=erase&model=a", headers=bearer(OPS))
    assert gw.fakes["a"].requests[-1].path == "/slots/0?action=erase&model=a"


async def test_the_lora_list_is_the_engines_own_after_a_reload_changed_the_adapters(
        gw: Gateway) -> None:
    """A reload restarts an engine whose adapters changed only once it is idle; until then
    (and for an engine adopted at a gateway start) the ids are the running engine's."""
    config = gw.engines.config
    models = [m.config for m in gw.engines.catalog]
    changed = [replace(m, adapters=(Adapter("fr", Path("/m/fr.gguf"), 0.5),
                                    Adapter("de", Path("/m/de.gguf"))))
               if m.name == "a" else m for m in models]
    gw.engines.catalog.replace(build_catalog(
        replace(config, models=tuple(changed), variants=()), (),
        {m.path: ModelFile(1) for m in changed if m.path is not None}))
    resp = await gw.client.post("/v1/chat/completions", headers=bearer(), json=chat("a:fr"))
    assert resp.status == 200, await resp.text()
    assert sent(gw)["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]  # sql, fr
    resp = await gw.client.post("/v1/chat/completions", headers=bearer(), json=chat("a:de"))
    body = await resp.json()
    assert resp.status == 503 and body["error"]["code"] == "adapter_not_loaded", body
    assert resp.headers["Retry-After"]


async def test_a_stream_for_a_variant_keeps_its_changes_and_hides_the_added_usage(
        gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", headers=bearer(),
                                json={**chat("coder"), "stream": True})
    text = await resp.text()
    assert resp.status == 200
    body = sent(gw)
    assert body["temperature"] == 0.2 and body["stream_options"] == {"include_usage": True}
    assert '"usage"' not in text.replace('"usage":null', "")


async def test_variants_are_models_of_their_own_to_the_list_and_to_keys(gw: Gateway) -> None:
    listed = await (await gw.client.get("/v1/models", headers=bearer())).json()
    rows = {m["id"]: m for m in listed["data"]}
    assert {"a", "a:sql", "a:fr", "coder", "sql-low"} <= set(rows)
    assert rows["coder"]["variant_of"] == "a" and rows["coder"]["limits"] == {"max_tokens": 8}
    assert rows["a:fr"]["adapter"] == "fr" and rows["a"]["adapters"] == ["sql", "fr"]
    assert rows["coder"]["state"] == rows["a"]["state"] == "ready"
    one = await (await gw.client.get("/v1/models/code", headers=bearer())).json()
    assert one["id"] == "coder" and one["variant_of"] == "a"

    only = bearer(CODER_ONLY)
    listed = await (await gw.client.get("/v1/models", headers=only)).json()
    assert [m["id"] for m in listed["data"]] == ["coder"]
    assert (await gw.client.post("/v1/chat/completions", headers=only,
                                 json=chat("coder"))).status == 200
    refused = await gw.client.post("/v1/chat/completions", headers=only, json=chat("a"))
    assert refused.status == 403
    assert (await gw.client.post("/v1/chat/completions", headers=only,
                                 json=chat("a:sql"))).status == 403


async def test_the_admin_api_and_the_cli_list_the_variants(gw: Gateway) -> None:
    from gatewayd.cli import model_lines

    listed = await (await gw.client.get("/admin/models", headers=bearer(OPS))).json()
    variants = {v["id"]: v for v in listed["variants"]}
    assert variants["coder"]["system_prompt"] == "You write code."
    assert variants["a:fr"] == {"id": "a:fr", "variant_of": "a", "adapter": "fr",
                                "aliases": ["a:fr"], "defaults": {}, "system_prompt": None,
                                "limits": {}}
    lines = model_lines(listed["models"], listed["variants"])
    (coder,) = [line for line in lines if line.startswith("coder ")]
    assert coder.split()[:2] == ["coder", "a"]
    assert "temperature, chat_template_kwargs, max max_tokens, system prompt" in coder
    (low,) = [line for line in lines if line.startswith("sql-low ")]
    assert low.split() == ["sql-low", "a", "sql"]


async def test_an_openai_servers_request_names_the_model_by_its_id(tmp_path: Path) -> None:
    """A strict OpenAI server (vLLM) answers only the name it was started with ({model}:
    the model's id): an alias's or a variant's request is sent with the id."""
    openai_b = {"b": {"backend": Backend.OPENAI, "aliases": ("bee",),
                      "command": ("srv", "--uds", "{socket}")}}
    async for gw in _gateway(tmp_path, ("b",), models_config=openai_b,
                             variants={"b-cold": {"variant_of": "b",
                                                  "defaults": {"temperature": 0.0}}}):
        for name in ("bee", "b-cold", "b"):
            resp = await gw.client.post("/v1/chat/completions", json=chat(name))
            assert resp.status == 200, await resp.text()
            assert json.loads(gw.fakes["b"].requests[-1].body)["model"] == "b"
        rows = await gw.records(3)
        assert sorted(r["model"] for r in rows) == ["b", "b", "b-cold"]


async def test_the_metrics_say_which_adapters_each_engine_loaded(gw: Gateway) -> None:
    """An endpoint picker's adapter affinity reads it (docs/fleet.md: llm-d's mapping)."""
    text = await (await gw.client.get("/admin/metrics", headers=bearer(OPS))).text()
    (line,) = [x for x in text.splitlines()
               if x.startswith("llm_gateway_engine_lora_adapters_info{")]
    assert 'model="a"' in line and 'running_lora_adapters="sql,fr"' in line
    assert 'max_lora="2"' in line and line.endswith(" 1.0")
