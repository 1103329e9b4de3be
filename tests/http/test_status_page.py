"""The status page at /admin/, in a real headless Chromium (Debian's package), against
the gateway's real HTTP stack with fake engines: the page loads, its script runs
without errors, the engines appear with their states and memory (RAM and its budget), a
start from the page's own button and a stop from outside both arrive live (no reload),
the journal shows on demand, it fits a phone's width, and its screenshot is a real
image."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import aiohttp
import pytest

from gatewayd.core.auth import digest, parse_keys
from gatewayd.core.upstreams import UpstreamConfig
from gatewayd.http.batches_api import BATCHES
from gatewayd.http.openai_api import FRONT
from tests.browser import browser_page, png_size
from tests.fake_hub import FakeHub, serve_hub
from tests.fake_upstream import FakeUpstream
from tests.http.test_front_door import _gateway, chat
from tests.unit.test_pulls import FILES, REPO
from tests.unit.test_ram_budget import FakeHost, FakeMeter

pytestmark = pytest.mark.slow

def state_of(model: str) -> str:
    return (f"(document.querySelector('#engines tr[data-model={json.dumps(model)}] .state') "
            "|| {}).textContent")


async def test_status_page_shows_engines_and_follows_them_live(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), host=FakeHost(), meter=FakeMeter()):
        assert (await gw.client.post("/v1/chat/completions", json=chat("a"))).status == 200
        await gw.records(1)
        url = str(gw.client.make_url("/admin/"))
        async with browser_page() as page:
            await page.goto(url)
            assert await page.evaluate("document.title") == "llm-gateway"
            await page.wait_for(f"{state_of('a')} === 'ready' && {state_of('b')} === 'ready' "
                                f"&& {state_of('c')} === 'stopped'", what="the engines")
            await page.wait_for("document.getElementById('live').textContent === 'live'",
                                what="the event feed")
            await page.wait_for("document.querySelectorAll('#calls tbody tr').length === 1 && "
                                "document.querySelector('#calls tbody tr').textContent"
                                ".includes('/v1/chat/completions')", what="the last call")
            # memory: the RAM budget among the facts; each engine's RAM, who measured it,
            # and its need (no GPU here: RAM only)
            facts = await page.evaluate("document.getElementById('facts').textContent")
            assert "RAM: 57.6 GiB free of 62.5 GiB (engines 518.0 MiB, loading 0 B, " \
                "reserve 1.0 GiB)" in facts
            memory = await page.evaluate("document.querySelector('#engines "
                                         "tr[data-model=\"a\"] td.memory').textContent")
            assert memory == "3.0 MiB (cgroup)need 259.0 MiB RAM"
            await page.evaluate("window.sameDocument = true")
            # the page's own start button, through the admin API
            await page.evaluate("document.querySelector('#engines tr[data-model=\"c\"] "
                                "button').click()")
            await page.wait_for(f"{state_of('c')} === 'ready'", what="c started from the page")
            assert gw.engines.registry.get("c") is not None
            # a change made elsewhere arrives over the event feed
            await gw.client.post("/admin/engines/stop", json={"model": "b"})
            await page.wait_for(f"{state_of('b')} === 'stopped'", what="b's stop, live")
            # its unit parked after the stop, among the facts (at the latest by the page's
            # own refresh every 10 s)
            await page.wait_for("document.getElementById('facts').textContent"
                                ".includes('parked: b')", what="b's parked unit", timeout=20)
            assert await page.evaluate("window.sameDocument") is True     # never reloaded
            # the journal, on demand: followed live (tests/http/test_console.py reads it)
            await page.evaluate("[...document.querySelectorAll('#engines tr[data-model=\"a\"] "
                                "button')].find(b => b.textContent === 'logs').click()")
            await page.wait_for("document.getElementById('log-source').value === 'a' && "
                                "document.getElementById('log-state').textContent"
                                ".includes('a')", what="a's journal followed")
            shot = await page.screenshot(tmp_path / "status.png")
            width, height = png_size(shot)
            assert width == 1100 and height >= 400 and shot.stat().st_size > 10_000
            assert page.errors == []
        rows = await gw.records(1)
        assert {r["endpoint"] for r in rows} == {"/v1/chat/completions"}  # the page calls no engine


async def test_status_page_draws_a_download_as_it_arrives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = FakeHub()
    hub.publish(REPO, FILES)
    hub.throttle_bps = 1 << 20     # 3 s for the 3 MiB file: the page sees it under way
    async with serve_hub(hub) as hub_url:
        monkeypatch.setenv("HF_ENDPOINT", hub_url)   # the gateway's hub client reads it
        async for gw in _gateway(tmp_path, (), models_dir=tmp_path):
            async with browser_page() as page:
                await page.goto(str(gw.client.make_url("/admin/")))
                await page.wait_for("document.getElementById('live').textContent === 'live'",
                                    what="the event feed")
                assert await page.evaluate("document.getElementById('pulls-box').hidden")
                resp = await gw.client.post("/admin/models/pull",
                                            json={"source": f"{REPO}:Q8_0"})
                assert resp.status == 202
                bar = "document.querySelector('#pulls tr[data-pull=\"Tiny-Q8_0\"] progress')"
                await page.wait_for(f"{bar} && {bar}.value > 0 && {bar}.value < {bar}.max",
                                    what="the download under way")
                await page.wait_for(f"{bar}.value === {bar}.max && document.querySelector("
                                    "'#pulls tr[data-pull=\"Tiny-Q8_0\"] .state')"
                                    ".textContent === 'done'", what="the download done")
                assert await page.evaluate(f"{bar}.max") == 3 << 20
                # the new model joins the catalog's count among the facts, no reload
                await page.wait_for("document.getElementById('facts').textContent"
                                    ".includes('4 models')", what="the pulled model counted")
                assert page.errors == []


async def test_status_page_draws_a_batch_and_its_cancel_live(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        # two lines: a's answered at once, b's waits (interactive traffic just now, and b
        # not loaded: nothing is loaded for a batch until the gateway is quiet)
        batches = gw.client.app[BATCHES]
        batches.config = dataclasses.replace(batches.config, batch_idle_s=3600)
        gw.client.app[FRONT].activity.seen()
        lines = b"".join(json.dumps({"custom_id": f"q{m}", "method": "POST",
                                     "url": "/v1/chat/completions",
                                     "body": chat(m)}).encode() + b"\n" for m in "ab")
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", lines, filename="in.jsonl")
        uploaded = await (await gw.client.post("/v1/files", data=form)).json()
        async with browser_page() as page:
            await page.goto(str(gw.client.make_url("/admin/")))
            await page.wait_for("document.getElementById('live').textContent === 'live'",
                                what="the event feed")
            assert await page.evaluate("document.getElementById('batches-box').hidden")
            batch = await (await gw.client.post("/v1/batches", json={
                "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"})).json()
            row = f"document.querySelector('#batches tr[data-batch=\"{batch['id']}\"]')"
            await page.wait_for(f"{row} && {row}.querySelector('progress').value === 1 && "
                                f"{row}.querySelector('progress').max === 2 && "
                                f"{row}.querySelector('.state').textContent === 'in_progress'",
                                what="the batch half done", timeout=15)
            await gw.client.post(f"/v1/batches/{batch['id']}/cancel")
            # (the row is drawn anew as the batch changes: absent for a moment, not an error)
            await page.wait_for(f"{row} && {row}.querySelector('.state').textContent === "
                                "'cancelled'", what="the cancel, live")
            assert page.errors == []


async def test_status_page_fits_a_phone(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",)):
        async with browser_page(width=390, height=844) as page:
            await page.goto(str(gw.client.make_url("/admin")))
            await page.wait_for(f"{state_of('a')} === 'ready'", what="the engines")
            # wide tables scroll inside their box; the page itself never scrolls sideways
            assert await page.evaluate("document.documentElement.scrollWidth") <= 390
            assert page.errors == []


async def test_status_page_with_api_keys_asks_for_an_admin_key_and_shows_upstreams(
        tmp_path: Path) -> None:
    ring = parse_keys({"keys": {"ops": {"sha256": digest("k-ops"), "scopes": ["admin"]},
                                "app": {"sha256": digest("k-app")}}}, "test")
    fake = FakeUpstream("far-box", models=["far-model"])
    await fake.start()
    try:
        async for gw in _gateway(tmp_path, ("a",), api_keys=ring, upstreams=(UpstreamConfig(
                name="far-box", url=fake.url, models=("far-model",)),)):
            # the page loads without a key; the data behind it does not
            assert (await gw.client.get("/admin/")).status == 200
            assert (await gw.client.get("/admin/status")).status == 401
            async with browser_page() as page:
                await page.goto(str(gw.client.make_url("/admin/")))
                await page.wait_for("!document.getElementById('key-form').hidden",
                                    what="the key form")
                assert await page.evaluate(
                    "document.querySelectorAll('#engines tbody tr').length") == 0
                for key, then in (("k-app", "the form again (an inference key)"),
                                  ("k-ops", "the engines")):
                    await page.evaluate(
                        f"document.getElementById('key').value = {json.dumps(key)}; "
                        "document.getElementById('key-form').requestSubmit()")
                    if key == "k-app":
                        await page.wait_for(
                            "!document.getElementById('key-form').hidden && document."
                            "getElementById('error').textContent.includes('scope')", what=then)
                        continue
                    await page.wait_for(f"{state_of('a')} === 'ready'", what=then)
                await page.wait_for("document.getElementById('live').textContent === 'live'",
                                    what="the event feed, read with the key")
                await page.wait_for(
                    "document.querySelector('#upstreams tr[data-upstream=\"far-box\"]') && "
                    "!document.getElementById('upstreams-box').hidden", what="the upstream")
                row = await page.evaluate("document.querySelector('#upstreams tr[data-upstream"
                                          "=\"far-box\"]').textContent")
                assert "far-model" in row and fake.url in row
                # live over the fetched feed: a stop made elsewhere arrives
                await gw.client.post("/admin/engines/stop", json={"model": "a"},
                                     headers={"Authorization": "Bearer k-ops"})
                await page.wait_for(f"{state_of('a')} === 'stopped'", what="a's stop, live")
                assert page.errors == []
    finally:
        await fake.stop()
