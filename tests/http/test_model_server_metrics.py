"""The model-server protocol (core/model_server): /admin/metrics read as an endpoint
picker reads it (Prometheus's text parser, the first series of each family), with
requests in flight and queued on fake engines that answer llama-server's GET /slots."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.http.admin_api import DISPATCHER
from tests.fake_engine import SLOT_CTX, SLOT_TOKENS
from tests.http.test_front_door import Gateway, _gateway, chat
from tests.http.test_variants_http import ADAPTERS

FLEET_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "fleet.md"
VARIANTS = {"coder": {"variant_of": "a", "aliases": ["code"]}}


@pytest.fixture(params=[2])
async def gw(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Gateway]:
    """a and b ready; max_engines the parameter."""
    async for g in _gateway(tmp_path, ("a", "b"), max_engines=request.param,
                            variants=VARIANTS, models_config=ADAPTERS):
        yield g


async def picked(gw: Gateway) -> dict[str, tuple[dict[str, str], float]]:
    """Per family, what a picker takes: its first series (labels, value)."""
    text = await (await gw.client.get("/admin/metrics")).text()
    return {f.name: (dict(f.samples[0].labels), f.samples[0].value)
            for f in text_string_to_metric_families(text) if f.samples}


async def per_model(gw: Gateway, family: str) -> dict[str, float]:
    """Every series of a family, by its model label."""
    text = await (await gw.client.get("/admin/metrics")).text()
    return {s.labels["model"]: s.value for f in text_string_to_metric_families(text)
            if f.name == family for s in f.samples}


async def until(check: Callable[[], bool], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def streaming(gw: Gateway, model: str) -> Awaitable[Any]:
    """A request its engine takes ~2 s to answer."""
    async def go() -> int:
        body = {**chat(model, prompt="slow 200"), "stream": True, "max_tokens": 10}
        async with gw.client.post("/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status
    return asyncio.ensure_future(go())


@pytest.mark.parametrize("gw", [3], indirect=True)
async def test_an_idle_host_reads_empty_with_its_warm_models_and_room(gw: Gateway) -> None:
    m = await picked(gw)
    assert m["llm_gateway_requests_waiting"][1] == 0
    assert m["llm_gateway_requests_running"][1] == 0
    assert m["llm_gateway_kv_cache_usage_ratio"][1] == 0
    labels, stamp = m["llm_gateway_models_warm_info"]
    running = labels["running_lora_adapters"].split(",")
    # every name a request may carry for a warm engine (a's variant and adapters too),
    # and only those
    assert {"a", "b", "coder", "code", "a:sql", "a:fr"} <= set(running) == {
        n for n in running if (s := gw.engines.catalog.find_served(n)) is not None
        and s.model.id in ("a", "b")} and running == sorted(running)
    assert labels["waiting_lora_adapters"] == ""
    assert int(labels["max_lora"]) == len(running) + 1   # a third engine has a place
    assert abs(stamp - time.time()) < 60                 # vLLM's: the reading's time


async def test_requests_in_flight_and_queued_are_the_hosts_figures(gw: Gateway) -> None:
    busy = [streaming(gw, "a"), streaming(gw, "a"), streaming(gw, "b")]
    await until(lambda: gw.fakes["a"].in_flight == 2 and gw.fakes["b"].in_flight == 1)
    m = await picked(gw)
    assert m["llm_gateway_requests_running"][1] == 3
    assert m["llm_gateway_requests_waiting"][1] == 0
    # the models run llama-server's default (-np auto): the slots share one cache, each
    # reporting all of it (SLOT_CTX); a: two requests of SLOT_TOKENS, b: one
    assert (await per_model(gw, "llm_gateway_engine_kv_cache_usage_ratio")) == {
        "a": 2 * SLOT_TOKENS / SLOT_CTX, "b": SLOT_TOKENS / SLOT_CTX}
    assert m["llm_gateway_kv_cache_usage_ratio"][1] == 3 * SLOT_TOKENS / (2 * SLOT_CTX)

    # both places taken by busy engines: c's request waits, c is on its way, no room
    queued = streaming(gw, "c")
    deadline = time.monotonic() + 5
    while (m := await picked(gw))["llm_gateway_requests_waiting"][1] != 1:
        assert time.monotonic() < deadline, m["llm_gateway_requests_waiting"]
        await asyncio.sleep(0.02)
    assert m["llm_gateway_requests_running"][1] == 3
    # c has no engine yet, and a queue
    assert (await per_model(gw, "llm_gateway_queue_depth")) == {"a": 0, "b": 0, "c": 1}
    labels, _ = m["llm_gateway_models_warm_info"]
    running, waiting = (labels[k].split(",") for k in ("running_lora_adapters",
                                                        "waiting_lora_adapters"))
    assert waiting == ["c", "c.gguf"] and "a" in running and "b" in running
    # loading c evicts: no room for one more
    assert int(labels["max_lora"]) == len(running) + len(waiting)
    assert [await t for t in (*busy, queued)] == [200] * 4


async def test_every_figure_the_fleet_guide_names_is_in_a_scrape(gw: Gateway) -> None:
    """docs/fleet.md's tables and recipe name series a picker is configured with: each
    is in a real scrape, under that name."""
    text = await (await gw.client.get("/admin/metrics")).text()
    present = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    named = set(re.findall(r"\bllm_gateway_[a-z_]+", FLEET_GUIDE.read_text()))
    assert named >= {"llm_gateway_requests_waiting", "llm_gateway_models_warm_info"}
    assert named <= present, named - present


async def test_an_engine_drained_to_make_room_is_not_warm(tmp_path: Path) -> None:
    """Past its wait bound, a queued model's room is made by draining a busy engine: that
    engine is on its way out, and a picker must not score the host as having it."""
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2, max_wait_s=0.2):
        await one_drained(gw)


async def one_drained(gw: Gateway) -> None:
    """a and b busy, c queued past its bound: one of a and b drains, and is not warm."""
    fakes, dispatcher = gw.fakes, gw.client.app[DISPATCHER]
    busy = [streaming(gw, "a"), streaming(gw, "b")]
    await until(lambda: fakes["a"].in_flight == 1 and fakes["b"].in_flight == 1)
    queued = streaming(gw, "c")
    await until(lambda: any(u.draining for u in dispatcher.usages()))
    [leaving] = [u.model_id for u in dispatcher.usages() if u.draining]
    labels, _ = (await picked(gw))["llm_gateway_models_warm_info"]
    running = labels["running_lora_adapters"].split(",")
    assert leaving not in running and ({"a", "b"} - {leaving}) <= set(running), labels
    assert labels["waiting_lora_adapters"].split(",")[0] == "c"
    assert [await t for t in (*busy, queued)] == [200] * 3
