"""Variants and LoRA adapters on the real engine, in the test container's systemd: one
llama-server with two generated adapters answers the base and each adapter differently
at temperature 0, without a restart; a variant's defaults and limit reach llama-server
(its /completion answer says the settings it used); the official openai SDK sees them
all as ordinary models, and so does the anthropic SDK."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import anthropic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import GatewayService, toml_str, unit_property
from tests.integration.test_front_door_e2e import client, records, start

pytestmark = [pytest.mark.systemd, pytest.mark.engine]


def config(alpha: Path, loras: dict[str, Path]) -> str:
    return f"""
[models.tiny-alpha]
path = {toml_str(str(alpha))}

[models.tiny-alpha.adapters]
sql = {toml_str(str(loras["sql"]))}
fr = {{ path = {toml_str(str(loras["fr"]))}, aliases = ["french"] }}

[models.coder]
variant_of = "tiny-alpha"
adapter = "sql"
defaults = {{ top_k = 7, temperature = 0.0 }}
limits = {{ max_tokens = 6 }}
system_prompt = "You write SQL."

[models.beta-short]
variant_of = "tiny-beta"
limits = {{ max_tokens = 5 }}
"""


def answer(gw: GatewayService, model: str, **extra: Any) -> tuple[str, int]:
    done = client(gw).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}],
        temperature=0, **{"max_tokens": 12, **extra})
    assert done.usage is not None
    return done.choices[0].message.content or "", done.usage.completion_tokens


def completion(gw: GatewayService, **body: Any) -> dict[str, Any]:
    status, answered = gw.api("POST", "/completion", {"prompt": "hello", **body})
    assert status == 200, answered
    assert isinstance(answered, dict)
    return answered


def test_adapters_and_variants_share_one_engine_and_answer_each_their_own_way(
        gateway_factory: GatewayFactory, tiny_models: dict[str, Path],
        tiny_loras: dict[str, Path]) -> None:
    gw = gateway_factory(extra=config(tiny_models["alpha"], tiny_loras))
    start(gw, "tiny-alpha")
    unit = gw.engines()["tiny-alpha"]["unit"]
    pid = unit_property(unit, "MainPID")

    listed = {m.id for m in client(gw).models.list()}
    assert {"tiny-alpha", "tiny-alpha:sql", "tiny-alpha:fr", "coder"} <= listed
    base, sql, fr = (answer(gw, name) for name in ("tiny-alpha", "tiny-alpha:sql", "french"))
    assert len({base, sql, fr}) == 3, (base, sql, fr)
    # the base again after an adapter: the same answer (llama-server keeps a prompt
    # cached under the adapter unless every request sends the whole lora list)
    assert answer(gw, "tiny-alpha") == base
    assert answer(gw, "tiny-alpha:sql") == sql
    assert unit_property(unit, "MainPID") == pid   # one engine, never restarted

    # the variant: its adapter, defaults and limit reach llama-server
    settings = completion(gw, model="coder")["generation_settings"]
    assert (settings["top_k"], settings["n_predict"]) == (7, 6)
    assert settings["lora"] == [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]
    settings = completion(gw, model="coder", top_k=3, n_predict=500)["generation_settings"]
    assert (settings["top_k"], settings["n_predict"]) == (3, 6)   # the client's default wins
    _, tokens = answer(gw, "coder", max_tokens=100)
    assert tokens == 6
    # llama-server's Anthropic path drops the lora list: refused on an engine with adapters,
    # a variant's limit holds there on one without
    claude = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="/v1/chat/completions"):
        claude.messages.create(model="coder", max_tokens=500,
                               messages=[{"role": "user", "content": "hello there"}])
    message = claude.messages.create(model="beta-short", max_tokens=500,
                                     messages=[{"role": "user", "content": "hello there"}])
    assert message.usage.output_tokens == 5
    assert completion(gw, model="tiny-alpha")["generation_settings"]["lora"] == [
        {"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    assert unit_property(unit, "MainPID") == pid

    rows = records(gw, 11)
    assert {r["model"] for r in rows} >= {"tiny-alpha", "tiny-alpha:sql", "tiny-alpha:fr",
                                          "coder"}
    assert {r["engine"] for r in rows if r["status"] == 200
            and r["model"] != "beta-short"} == {unit}


def scrape(gw: GatewayService) -> dict[str, list[tuple[dict[str, str], float]]]:
    """/admin/metrics through Prometheus's own text parser: each family's series."""
    with urllib.request.urlopen(gw.url + "/admin/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {f.name: [(dict(s.labels), s.value) for s in f.samples]
            for f in text_string_to_metric_families(text)}


def test_a_pickers_scrape_after_real_requests_says_what_runs_and_what_it_holds(
        gateway_factory: GatewayFactory, tiny_models: dict[str, Path],
        tiny_loras: dict[str, Path]) -> None:
    """The model-server protocol (docs/fleet.md) read from a real scrape: while the real
    engine generates, its slots hold tokens, and the host's figures say one request runs;
    the warm names are every name the engine answers; after it, nothing is held."""
    gw = gateway_factory(extra=config(tiny_models["alpha"], tiny_loras))
    start(gw, "tiny-alpha")
    assert answer(gw, "tiny-alpha:sql")[1] > 0
    result: list[tuple[int, Any]] = []
    long = threading.Thread(target=lambda: result.append(gw.api(
        "POST", "/v1/completions", {"model": "french", "prompt": "hello there",
                                    "max_tokens": 400, "ignore_eos": True})))
    long.start()
    deadline, seen = time.monotonic() + 30, None
    while long.is_alive() and time.monotonic() < deadline:
        m = scrape(gw)
        if m["llm_gateway_requests_running"][0][1] == 1 and \
                m["llm_gateway_kv_cache_usage_ratio"][0][1] > 0:
            seen = m
            break
        time.sleep(0.05)
    long.join(60)
    assert result and result[0][0] == 200, result
    assert seen is not None, "no scrape saw the request running and holding the cache"
    engine_kv = dict((labels["model"], v) for labels, v in
                     seen["llm_gateway_engine_kv_cache_usage_ratio"])
    assert 0 < engine_kv["tiny-alpha"] <= 1
    assert seen["llm_gateway_requests_waiting"][0][1] == 0
    [(warm, _)] = seen["llm_gateway_models_warm_info"]
    assert {"tiny-alpha", "tiny-alpha:sql", "tiny-alpha:fr", "french", "coder"} <= set(
        warm["running_lora_adapters"].split(","))
    assert "tiny-beta" not in warm["running_lora_adapters"].split(",")
    [(lora, _)] = seen["llm_gateway_engine_lora_adapters_info"]
    assert (lora["model"], lora["running_lora_adapters"]) == ("tiny-alpha", "sql,fr")

    after = scrape(gw)   # the request has ended: nothing runs, the cache held is free
    assert after["llm_gateway_requests_running"][0][1] == 0
    assert after["llm_gateway_kv_cache_usage_ratio"][0][1] == 0
