"""Memory truth with real engines in a real systemd (issue 36): RAM as a budget that
evicts the least recently used idle engine, a need beyond the budget refused at once,
figures learned from each unit's cgroup, and an OOM kill answered once, not restarted
into the same wall."""

from __future__ import annotations

import json
import time
import tomllib
from itertools import combinations
from pathlib import Path

import make_tiny_model  # (scripts/, on the path from tests/conftest.py)
import openai
import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import GatewayService, stop_all_engine_units, toml_str
from tests.integration.test_scheduling_e2e import ask, journal_cursor, unit_starts

pytestmark = [pytest.mark.systemd, pytest.mark.engine]
HUNGRY = ("wide-a", "wide-b", "wide-c")


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three ~35 MB models, different files: loaded without mmap (`-lm none`), their
    weights are each engine's own memory, so what two hold together is not what three do
    by more than the libraries the engines share."""
    root = tmp_path_factory.mktemp("wide")
    paths = {}
    for seed, name in enumerate(HUNGRY):
        paths[name] = root / f"{name}.gguf"
        make_tiny_model.write_model(str(paths[name]), name=name, seed=10 + seed, n_embd=256,
                                    n_layer=8, n_ff=1024, n_head=4, n_head_kv=4)
    return paths


def wide_tables(paths: dict[str, Path], **settings: str) -> str:
    extra = "".join(f"{k} = {v}\n" for k, v in settings.items())
    return "".join(f'[models.{name}]\npath = {toml_str(str(path))}\nthreads = 1\n'
                   f'args = ["-lm", "none"]\n{extra}' for name, path in paths.items())


def learned_ram(gw: GatewayService) -> dict[str, int]:
    """ram-memory.json: each model's learned RAM peak (MiB)."""
    state = Path(tomllib.loads(gw.config.read_text())["state_dir"])
    book = json.loads((state / "ram-memory.json").read_text())
    return {entry["model"]: entry["mib"] for entry in book.values()}


def ram_needs(gw: GatewayService) -> dict[str, tuple[int, str]]:
    """What the gateway counts each model's engine to need in RAM, and why."""
    code, body = gw.api("GET", "/v1/models")
    assert code == 200, body
    return {m["id"]: (m["ram_estimate_mib"], m["ram_estimate_source"]) for m in body["data"]
            if "ram_estimate_mib" in m}


def test_a_ram_budget_for_two_evicts_the_least_recently_used_idle_one_for_the_third(
        gateway_factory: GatewayFactory, wide_models: dict[str, Path]) -> None:
    tables = wide_tables(wide_models)
    gw = gateway_factory(extra=tables + "[memory]\nram_reserve_mib = 0\n", max_engines=8)
    for model in HUNGRY:
        ask(gw, model)
    learned = learned_ram(gw)
    assert set(learned) >= set(HUNGRY), learned
    journal = gw.journal()
    for model in HUNGRY:   # each figure came from the unit's memory cgroup
        assert f"{model}: its engine holds {learned[model]} MiB of RAM at its peak (cgroup" \
            in journal, journal[-3000:]
        assert 40 <= learned[model] <= 200, learned   # ~35 MiB of weights, not mapped
    needs = {m: need for m, (need, _) in ram_needs(gw).items() if m in HUNGRY}
    for model in HUNGRY:   # the need: the learned peak, or the estimate where that is more
        assert needs[model] >= learned[model], (needs, learned)
    gw.stop()
    stop_all_engine_units()   # (engines outlive their gateway: it would adopt them)

    # any two fit, all three do not, whatever the order
    budget = max(needs[a] + needs[b] for a, b in combinations(HUNGRY, 2)) \
        + min(needs.values()) // 2
    gw = gateway_factory(extra=tables + f"[memory]\nram_reserve_mib = 0\n"
                         f"ram_budget_mib = {budget}\n", max_engines=8)
    cursor = journal_cursor()
    ask(gw, "wide-a")
    ask(gw, "wide-b")
    ask(gw, "wide-a")                 # b is now the least recently used
    ask(gw, "wide-c")
    running = {m for m, e in gw.engines().items() if e["state"] == "ready"}
    assert running == {"wide-a", "wide-c"}, gw.engines()
    assert "evicting wide-b (making room for wide-c: needs" in gw.journal()
    assert unit_starts("llm-engine-wide\\x2db.service", cursor) == 1

    # a busy engine is never the one to go: c streams (busy, and least recently used)
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="-", max_retries=0, timeout=120)
    ask(gw, "wide-a")
    stream = oa.chat.completions.create(model="wide-c", max_tokens=400, stream=True,
                                        messages=[{"role": "user", "content": "go"}])
    next(iter(stream))                # c is serving
    ask(gw, "wide-b")
    running = {m for m, e in gw.engines().items() if e["state"] == "ready"}
    assert running == {"wide-b", "wide-c"}, gw.engines()
    stream.close()


def test_a_need_beyond_the_ram_budget_is_refused_at_once_naming_ram(
        gateway_factory: GatewayFactory) -> None:
    gw = gateway_factory(extra="eviction_wait_s = 60\n[memory]\nram_budget_mib = 1\n")
    started = time.monotonic()
    code, body = gw.api("POST", "/v1/chat/completions", {
        "model": "tiny-beta", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert code == 503, body
    error = body["error"]
    assert error["code"] == "insufficient_memory" and error["memory"] == "ram", error
    assert "MiB of RAM" in error["message"] and "ram_budget_mib" in error["message"]
    assert time.monotonic() - started < 10       # not after the 60 s eviction wait
    assert "tiny-beta" not in gw.engines()        # nothing was started


def test_an_oom_killed_engine_is_answered_once_and_not_restarted_until_its_limit_is_raised(
        gateway_factory: GatewayFactory, wide_models: dict[str, Path]) -> None:
    one = {"wide-a": wide_models["wide-a"]}
    gw = gateway_factory(extra=wide_tables(one, memory_max='"32M"'))
    cursor = journal_cursor()
    code, body = gw.api("POST", "/v1/chat/completions", {
        "model": "wide-a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    if code != 503:   # the gateway's own account of it, in full
        pytest.fail(f"{code} {body}\n" + "\n".join(gw.journal().splitlines()[-80:]))
    error = body["error"]
    assert error["code"] == "engine_out_of_memory", error
    assert "killed for want of memory" in error["message"] and "memory_max" in error["message"]
    assert error["memory_max_mib"] == 32 and error["required_mib"] > 32
    engine = gw.wait_engine("wide-a", lambda e: e["state"] == "failed")
    assert engine["failure"]["out_of_memory"] is True
    deadline = time.monotonic() + 3   # systemd's RestartSec is 1 s: a restart would show
    while time.monotonic() < deadline:
        assert unit_starts("llm-engine-wide\\x2da.service", cursor) == 1
        time.sleep(0.2)

    gw.config.write_text(gw.config.read_text().replace('memory_max = "32M"',
                                                        'memory_max = "512M"'))
    code, plan = gw.api("POST", "/admin/reload")
    assert code == 200, plan
    deadline = time.monotonic() + 30
    while True:   # the retry backoff after a failure (seconds) runs out first
        code, body = gw.api("POST", "/v1/chat/completions", {
            "model": "wide-a", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]})
        if code == 200 or time.monotonic() > deadline:
            break
        assert body["error"]["code"] in ("engine_out_of_memory", "engine_failed"), body
        time.sleep(0.5)
    assert code == 200, body
