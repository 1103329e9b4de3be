"""On-demand scheduling with real engines: autoload, one loader, LRU eviction that never
touches a busy engine, idle TTL, preload and pin across a gateway restart."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import GatewayService, toml_str

pytestmark = [pytest.mark.systemd, pytest.mark.engine]


def ask(gw: GatewayService, model: str, max_tokens: int = 2) -> int:
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="-", max_retries=0, timeout=120)
    answer = oa.chat.completions.create(model=model, max_tokens=max_tokens,
                                        messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None
    return answer.usage.completion_tokens


def journal_cursor() -> str:
    out = subprocess.run(["journalctl", "-n", "0", "--show-cursor", "--no-pager"],
                         capture_output=True, text=True, check=True).stdout
    return out.strip().rsplit("-- cursor: ", 1)[1]


def unit_starts(model_unit: str, after: str) -> int:
    """How often systemd started the unit since the cursor."""
    subprocess.run(["journalctl", "--sync"], check=False)
    out = subprocess.run(["journalctl", "-u", model_unit, "-o", "cat", "--no-pager",
                          f"--after-cursor={after}"],
                         capture_output=True, text=True, check=False).stdout
    return sum(1 for line in out.splitlines() if line.startswith("Started "))


def test_twenty_concurrent_requests_start_one_engine(gateway: GatewayService) -> None:
    cursor = journal_cursor()
    with ThreadPoolExecutor(20) as pool:
        tokens = list(pool.map(lambda _: ask(gateway, "tiny-gamma"), range(20)))
    assert tokens == [2] * 20
    assert gateway.journal().count("starting tiny-gamma as") == 1
    assert unit_starts("llm-engine-tiny\\x2dgamma.service", cursor) == 1


def test_cycling_three_models_in_two_places_never_evicts_the_streaming_one(
        gateway_factory: GatewayFactory, slow_model: Path) -> None:
    gw = gateway_factory(max_engines=2, extra=(
        f"[models.long]\npath = {toml_str(str(slow_model))}\nthreads = 1\n"))
    ask(gw, "long")
    long_pid = gw.engines()["long"]["pid"]
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="-", max_retries=0, timeout=120)
    streamed: list[int] = []

    first_chunk = threading.Event()

    def stream_long() -> None:
        for chunk in oa.chat.completions.create(
                model="long", messages=[{"role": "user", "content": "go"}], max_tokens=2000,
                stream=True, stream_options={"include_usage": True}):
            first_chunk.set()
            if chunk.usage:
                streamed.append(chunk.usage.completion_tokens)
    reader = threading.Thread(target=stream_long)
    reader.start()
    assert first_chunk.wait(30), "the stream did not start"   # long is busy from here
    for model in ("tiny-beta", "tiny-gamma", "tiny-beta", "tiny-gamma"):
        assert ask(gw, model) == 2          # each needs the place the other one holds
    assert reader.is_alive(), "the stream should still be running (a slow model)"
    reader.join(60)
    assert streamed and streamed[0] > 1000           # the stream ran to its end
    engines = gw.engines()
    assert engines["long"]["pid"] == long_pid and engines["long"]["restarts"] == 0
    log = gw.journal()
    assert "evicting long" not in log
    assert log.count("evicting tiny-beta") >= 1 and log.count("evicting tiny-gamma") >= 1


def test_idle_ttl_stops_an_idle_engine(gateway_factory: GatewayFactory,
                                       tiny_models: dict[str, Path]) -> None:
    gw = gateway_factory(extra=(
        f"[models.brief]\npath = {toml_str(str(tiny_models['beta']))}\nidle_ttl_s = 1\n"))
    ask(gw, "brief")
    assert "brief" in gw.engines()
    deadline = time.monotonic() + 15
    while "brief" in gw.engines():
        assert time.monotonic() < deadline, "the idle engine was not stopped"
        time.sleep(0.2)
    assert "stopping brief" in gw.journal() and "idle_ttl" in gw.journal()


def test_preload_and_pin_after_a_gateway_restart(gateway_factory: GatewayFactory,
                                                 tiny_models: dict[str, Path]) -> None:
    gw = gateway_factory(max_engines=1, extra=(
        "eviction_wait_s = 1\n"
        f"[models.kept]\npath = {toml_str(str(tiny_models['alpha']))}\n"
        "preload = true\npin = true\n"))
    first = gw.wait_engine("kept", lambda e: e["state"] == "ready")   # preloaded, unasked
    status, body = _post(gw, {"model": "tiny-beta", "max_tokens": 1,
                              "messages": [{"role": "user", "content": "x"}]})
    assert status == 503 and body["error"]["code"] == "engine_limit_reached"
    assert "kept (pinned)" in body["error"]["message"]
    gw.stop()
    gw.start()
    again = gw.wait_engine("kept", lambda e: e["state"] == "ready")
    assert again["pid"] == first["pid"] and again["adopted"]      # not restarted
    status, body = _post(gw, {"model": "tiny-beta", "max_tokens": 1,
                              "messages": [{"role": "user", "content": "x"}]})
    assert status == 503 and "kept (pinned)" in body["error"]["message"]


def _post(gw: GatewayService, body: dict[str, object]) -> tuple[int, Any]:
    import urllib.error
    import urllib.request
    req = urllib.request.Request(gw.url + "/v1/chat/completions", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
