"""An engine's KV cache kept across its stop: the gateway has llama-server save its slots
before stopping it and restore them when it is ready again, so the same long prompt
reuses its prefix (timings.cache_n) instead of paying the whole prefill. Without
kv_cache_save the second engine starts cold."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import GatewayService, journal_until, toml_str

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

PROMPT = " ".join(f"word{i % 97} and more" for i in range(300))


def complete(gw: GatewayService, model: str) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(gw.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.loads(resp.read()))


def restarted(gw: GatewayService, model: str) -> None:
    for verb in ("stop", "start"):
        proc = gw.cli(verb, model)
        assert proc.returncode == 0, proc.stderr


def test_the_kv_cache_survives_a_stop_and_start(
        tmp_path: Path, gateway_factory: GatewayFactory,
        tiny_models: dict[str, Path]) -> None:
    gw = gateway_factory(extra=(
        f"[models.cold]\npath = {toml_str(str(tiny_models['beta']))}\n"
        "kv_cache_save = false\n"))
    first = complete(gw, "tiny-alpha")
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 500 and first["timings"]["cache_n"] == 0

    restarted(gw, "tiny-alpha")
    again = complete(gw, "tiny-alpha")
    # the whole prompt but its last token came from the restored cache
    assert again["timings"]["cache_n"] >= prompt_tokens - 2, again["timings"]
    assert again["timings"]["prompt_n"] <= 2
    journal_until("tiny-alpha: KV cache of 1 parallel slot(s) saved", "-u", gw.unit)
    journal_until("tiny-alpha: KV cache restored", "-u", gw.unit)
    kv_dir = tmp_path / "state" / "kv-cache"
    assert [p.name for p in kv_dir.glob("*/slot-*.bin")]

    complete(gw, "cold")
    restarted(gw, "cold")
    assert complete(gw, "cold")["timings"]["cache_n"] == 0   # without it: cold
