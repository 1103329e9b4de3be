"""The console in headless Chromium against the real gateway in the test container: real
llama-server engines as systemd units, their journals in the container's journald, the
records in SQLite. After traffic the charts carry its figures, the memory bars match
/admin/status, a forced eviction shows on the timeline with its reason, the playground
streams an answer from a real engine and shows an embedding's size, and the live log shows
a line its engine wrote after the page began following it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.browser import browser_page
from tests.http.test_console import drawn, play
from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import toml_str

pytestmark = [pytest.mark.systemd, pytest.mark.engine, pytest.mark.slow]

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def test_console_against_real_engines(gateway_factory: GatewayFactory,
                                      tiny_models: dict[str, Path]) -> None:
    gw = gateway_factory(max_engines=1, extra=(
        f"[models.embed]\npath = {toml_str(str(tiny_models['gamma']))}\n"
        'kind = "embedding"\nthreads = 1\n'))
    for _ in range(2):
        status, body = gw.api("POST", "/v1/chat/completions", {"model": "tiny-alpha", **CHAT})
        assert status == 200, body
    # one place: beta's call evicts alpha (the timeline must say so, and for whom)
    status, body = gw.api("POST", "/v1/chat/completions", {"model": "tiny-beta", **CHAT})
    assert status == 200, body
    dimensions = asyncio.run(_drive(gw.url))
    # the vector the playground measured is the engine's: the same call, made here
    status, body = gw.api("POST", "/v1/embeddings", {"model": "embed", "input": "hello"})
    assert status == 200, body
    assert dimensions == len(body["data"][0]["embedding"]) > 0
    # the playground from a terminal: the same engines, streamed
    proc = gw.cli("chat", "tiny-beta", "hello", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and ", 4 tokens, " in proc.stderr, proc.stderr
    proc = gw.cli("embed", "embed", "hello")
    assert proc.returncode == 0 and proc.stdout.startswith(f"{dimensions} dimensions: ["), \
        proc.stdout + proc.stderr


async def _drive(url: str) -> int:
    """What the page shows, checked as it goes; the embedding's size it showed."""
    async with browser_page() as page:
        await page.goto(f"{url}/admin/")
        await page.wait_for("document.getElementById('live').textContent === 'live'",
                            what="the event feed")
        # the charts: 3 calls in the hour's buckets (per minute: calls / 1)
        points = "svg[data-chart=requests] circle"
        await page.wait_for(f"document.querySelectorAll({json.dumps(points)}).length >= 2",
                            what="the requests chart", timeout=30)
        alpha = sum(float(v) for v in await drawn(page, f"{points}[data-line=tiny-alpha]"))
        beta = sum(float(v) for v in await drawn(page, f"{points}[data-line=tiny-beta]"))
        assert (alpha, beta) == (2, 1)
        latency = await drawn(page, "svg[data-chart=latency] circle[data-line=p95]")
        assert latency and all(float(v) > 0 for v in latency)

        # memory: the RAM bar's engine is beta, at what /admin/engines measured
        status = await page.evaluate("fetch('/admin/status').then(r => r.json())")
        engines = await page.evaluate("fetch('/admin/engines').then(r => r.json())")
        beta_engine = next(e for e in engines["engines"] if e["model"] == "tiny-beta")
        ram = status["ram_memory_mib"]
        assert ram is not None   # systemd's cgroups measure the engine: RAM is a budget here
        await page.wait_for("!!document.querySelector('[data-memory=ram] "
                            ".seg[data-label=tiny-beta]')", what="beta's RAM")
        assert await drawn(page, "[data-memory=ram]", "totalMib") == [str(ram["total_mib"])]
        if beta_engine["ram_bytes"] is not None:   # measured (its cgroup, or PSS): read
            # by the page a moment apart from the test's reading, an idle engine's pages
            # may have moved a little
            [shown] = await drawn(page, "[data-memory=ram] .seg[data-label=tiny-beta]", "mib")
            assert abs(int(shown) - beta_engine["ram_bytes"] / 1048576) <= 4, shown
        assert await drawn(page, ".place:not(.empty)", "place") == ["tiny-beta"]
        assert await page.evaluate("document.querySelectorAll('.place').length") == 1

        # the timeline: alpha evicted for beta
        evicted = "#marks li[data-kind=evicted][data-model=tiny-alpha]"
        await page.wait_for(f"!!document.querySelector('{evicted}')", what="alpha's eviction")
        text = await page.evaluate(f"document.querySelector('{evicted}').textContent")
        assert "evicted for 'tiny-beta'" in text, text

        # live logs: follow beta's journal, then make its engine write (a request)
        await page.evaluate("void followLogs('tiny-beta')")
        await page.wait_for("document.getElementById('log-state').dataset.following "
                            "=== 'tiny-beta'", what="the follow under way")
        # llama-server logs "prompt eval time" once per request: beta's first is among
        # the journal's last lines; the playground's must arrive as it is written
        count = ("document.getElementById('log-lines').textContent"
                 ".split('prompt eval time').length - 1")
        before = await page.wait_for(f"{count} >= 1 && {count}", what="the journal's tail")
        answer = await play(page, "tiny-beta")   # the playground: streamed from llama-server
        assert answer["state"] == "done", answer
        assert answer["out"].strip() and "TTFT" in answer["figures"], answer
        await page.wait_for(f"{count} > {before}", what="a line written after the follow "
                            "began", timeout=20)
        # an embedding model: the playground shows the vector's size
        embedded = await play(page, "embed")
        assert embedded["state"] == "done" and embedded["mode"] == "embedding", embedded
        assert page.errors == []
        return int(embedded["figures"]["dimensions"].split()[1])
