"""The console (/admin/): charts, memory bars, the timeline, the playground, in a real
headless Chromium against the gateway's real HTTP stack with fake engines. Each check
reads what the page drew (the values on the chart's points, a bar's MiB, the timeline's
lines) and holds it against what the gateway says or what the test did."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from gatewayd.core.auth import digest, parse_keys
from gatewayd.core.config import Backend, ModelKind
from tests import console_shots
from tests.browser import Page, browser_page, png_size
from tests.http.test_events_and_logs import gone, runs
from tests.http.test_front_door import _gateway, chat
from tests.unit.test_engine_manager import MeasuringGpu
from tests.unit.test_ram_budget import FakeHost, FakeMeter

pytestmark = pytest.mark.slow


async def drawn(page: Page, selector: str, attr: str = "value") -> list[str]:
    return await page.evaluate(  # type: ignore[no-any-return]
        f"[...document.querySelectorAll({json.dumps(selector)})].map(e => e.dataset.{attr})")


async def choose_model(page: Page, model: str) -> None:
    """The charts' model picker set to model ("": all), and the charts redrawn for it."""
    await page.evaluate(f"document.getElementById('chart-model').value = {json.dumps(model)};"
                        "document.getElementById('chart-model').dispatchEvent("
                        "new Event('change'))")
    await page.wait_for(f"document.getElementById('charts').dataset.model === "
                        f"{json.dumps(model)}", what=f"the charts of {model or 'all models'}")


def bin_of(value: float, bounds: list[float]) -> tuple[float, float]:
    """The histogram bin (lower, upper] that holds value."""
    lower = 0.0
    for bound in bounds:
        if value <= bound:
            return lower, bound
        lower = bound
    return lower, math.inf


async def test_charts_memory_and_timeline_draw_what_happened(tmp_path: Path) -> None:
    gpu = MeasuringGpu(8192, 6000)
    async for gw in _gateway(tmp_path, ("a", "b"), max_engines=2, gpu=gpu, host=FakeHost(),
                             meter=FakeMeter()):
        c = gw.client
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=chat("a"))).status == 200
        for _ in range(2):
            resp = await c.post("/v1/chat/completions", json=chat("b", stream=True))
            assert resp.status == 200
            await resp.read()
        # both places are taken: c's first call evicts the engine idle longest (a)
        assert (await c.post("/v1/chat/completions", json=chat("c"))).status == 200
        assert (await c.post("/v1/chat/completions", json=chat("nope"))).status == 404
        rows = await gw.records(7)
        engines = {e["model"]: e for e in (await (await c.get("/admin/engines")).json())["engines"]}
        for name, engine in engines.items():   # what each engine's process holds on the GPU
            if engine["pid"]:
                gpu.per_process[engine["pid"]] = {"b": 700, "c": 1100}.get(name, 0)
        async with browser_page() as page:
            await page.goto(str(c.make_url("/admin/")))
            await page.evaluate("document.getElementById('chart-window').value = '15m'; "
                                "document.getElementById('chart-window').dispatchEvent("
                                "new Event('change'))")
            requests = "svg[data-chart=requests] circle"
            await page.wait_for("document.getElementById('charts').dataset.window === '15m'",
                                what="the 15 min charts")
            series = await (await c.get("/admin/series?window=15m")).json()
            assert series["step_s"] == 15
            # calls per minute in 15 s buckets: each point is 4 x its calls
            for model, calls in (("a", 3), ("b", 2), ("c", 1), ("(no model)", 1)):
                values = await drawn(page, f"{requests}[data-line={json.dumps(model)}]")
                assert sum(float(v) for v in values) / 4 == calls, (model, values)
            # the overall summary: 7 calls, 1 error (the unknown model's 404)
            summary = await page.evaluate("Object.fromEntries([...document.querySelectorAll("
                                          "'#chart-summary span')].map(s => [s.dataset.summary,"
                                          " s.textContent]))")
            assert summary["calls"] == "calls 7" and summary["errors"] == "errors 1", summary
            # the latency chart's p50 for model a, in the histogram bin of a's true median
            await choose_model(page, "a")
            p50 = [float(v) for v in await drawn(page, "svg[data-chart=latency] "
                                                        "circle[data-line=p50]")]
            latencies = sorted(r["latency_ms"] for r in rows if r["model"] == "a")
            assert len(p50) >= 1
            if len(p50) == 1:   # all of a's calls in one bucket: its p50 is theirs
                low, high = bin_of(latencies[1], series["latency_bounds_ms"])
                assert low <= p50[0] <= high, (p50, latencies)
            # the tokens/s chart of b's streams has a value; the errors chart none for a
            await choose_model(page, "b")
            tps = await drawn(page, "svg[data-chart=tokens] circle")
            assert tps and all(float(v) > 0 for v in tps)

            # memory: the GPU bar holds each engine's measured VRAM, the RAM bar each
            # engine's measured RAM, and the places bar the engines holding a place
            await page.evaluate("refresh()")
            gpu_seg = "[data-memory=gpu-0] .seg"
            await page.wait_for(f"document.querySelector('{gpu_seg}[data-label=c]') && "
                                f"document.querySelector('{gpu_seg}[data-label=c]')"
                                ".dataset.mib === '1100'", what="c's VRAM in the GPU bar")
            status = await (await c.get("/admin/status")).json()
            engines = {e["model"]: e for e in (await (await c.get("/admin/engines"))
                                               .json())["engines"]}
            assert await drawn(page, f"{gpu_seg}[data-label=b]", "mib") == ["700"]
            assert await drawn(page, f"{gpu_seg}[data-label=b]", "estimated") == ["false"]
            device = status["gpu_devices"][0]
            other = device["total"] - device["free"] - 1800
            assert await drawn(page, f"{gpu_seg}.other", "mib") == [str(other)]
            for name in ("b", "c"):
                assert await drawn(page, f"[data-memory=ram] .seg[data-label={name}]", "mib") \
                    == [str(round(engines[name]["ram_bytes"] / 1048576))]
            placed = sorted(n for n, e in engines.items() if e["holds_place"])
            assert sorted(await drawn(page, ".place:not(.empty)", "place")) == placed == ["b", "c"]
            assert await page.evaluate("document.querySelectorAll('.place').length") \
                == status["max_engines"] == 2

            # the timeline: a's eviction, with why and for whom
            await choose_model(page, "")
            evicted = "#marks li[data-kind=evicted][data-model=a]"
            await page.wait_for(f"!!document.querySelector('{evicted}')", what="a's eviction")
            text = await page.evaluate(f"document.querySelector('{evicted}').textContent")
            assert "evicted for 'c'" in text, text
            assert await page.evaluate("document.querySelectorAll('#timeline-svg "
                                       "line[data-mark=evicted]').length") == 1
            ready = await page.evaluate("[...document.querySelectorAll('#timeline-svg "
                                        "rect[data-state=ready]')].map(r => r.dataset.model)")
            assert {"a", "b", "c"} <= set(ready)
            # a's run, outlined, ended by the swap: labelled "→ c", and why on hover
            swaps = await page.evaluate(
                "[...document.querySelectorAll('#timeline-svg text[data-swap]')].map(t => "
                "[t.dataset.model, t.firstChild.textContent, "
                "t.querySelector('title').textContent])")
            assert [(m, label) for m, label, _ in swaps] == [("a", "→ c")], swaps
            assert "evicted for 'c': 'c' waited " in swaps[0][2], swaps
            assert swaps[0][2].endswith(": 'a' served nobody"), swaps
            runs = await page.evaluate("[...document.querySelectorAll('#timeline-svg "
                                       "rect[data-run]')].map(r => r.dataset.model + ' ' + "
                                       "r.dataset.run)")
            assert "a evicted" in runs and "c running" in runs, runs
            # an event after the page opened joins the timeline live: b stopped here
            await c.post("/admin/engines/stop", json={"model": "b"})
            await page.wait_for("!!document.querySelector('#marks li[data-kind=stopped]"
                                "[data-model=b]')", what="b's stop on the timeline")
            assert page.errors == []


async def play(page: Page, model: str) -> dict[str, Any]:
    await page.wait_for(f"[...document.querySelectorAll('#play-model option')].some("
                        f"o => o.value === {json.dumps(model)})", what="the playground's models")
    await page.evaluate(f"document.getElementById('play-model').value = {json.dumps(model)}; "
                        "document.getElementById('play-model').dispatchEvent(new Event('change'));"
                        "document.getElementById('play-form').requestSubmit()")
    await page.wait_for("['done', 'error'].includes(document.getElementById('play-out')"
                        ".dataset.state)", what=f"{model}'s answer")
    return await page.evaluate(  # type: ignore[no-any-return]
        "({state: document.getElementById('play-out').dataset.state, "
        "mode: document.getElementById('play-form').dataset.mode, "
        "out: document.getElementById('play-out').textContent, figures: Object.fromEntries("
        "[...document.querySelectorAll('#play-figures span')].map(s => [s.dataset.figure, "
        "s.textContent]))})")


async def test_playground_streams_a_chat_transcribes_a_file_and_shows_a_refusal(
        tmp_path: Path) -> None:
    server = {"backend": Backend.OPENAI, "command": ("/usr/bin/server", "{socket}")}
    async for gw in _gateway(tmp_path, ("a",), models_config={
            "b": {"kind": ModelKind.EMBEDDING}, "c": {**server, "kind": ModelKind.AUDIO}}):
        async with browser_page() as page:
            await page.goto(str(gw.client.make_url("/admin/")))
            answer = await play(page, "a")
            assert answer["state"] == "done" and answer["mode"] == "chat", answer
            assert set(answer["figures"]) >= {"TTFT", "tokens", "tokens/s"}, answer
            rows = await gw.records(1)
            assert rows[0]["endpoint"] == "/v1/chat/completions" and rows[0]["stream"] == 1
            # the fake engine answers max_tokens (the form's 128) words " w0 w1 ...", and its
            # usage says so: the page shows the words as they came and the engine's count
            assert answer["out"] == "".join(f" w{i}" for i in range(128)), answer["out"][-80:]
            assert answer["figures"]["tokens"] == "tokens 128"
            sent = json.loads(gw.fakes["a"].requests[-1].body)
            assert sent["stream"] is True and sent["max_tokens"] == 128
            # an audio model takes a file (what a user picks, set here as a picker would)
            await page.evaluate(
                "(() => { const dt = new DataTransfer(); dt.items.add(new File("
                "[new Uint8Array([82, 73, 70, 70])], 'hello.wav', {type: 'audio/wav'})); "
                "document.getElementById('play-file').files = dt.files; })()")
            heard = await play(page, "c")
            assert heard["state"] == "done" and heard["mode"] == "audio", heard
            assert heard["out"] == " hello from c\n"
            seen = gw.fakes["c"].requests[-1]
            assert seen.path == "/v1/audio/transcriptions" and b"hello.wav" in seen.body
            # a refusal ends in the engine's message (this fake serves no embeddings), not a
            # hang, and the next answer still comes
            refused = await play(page, "b")
            assert refused["state"] == "error" and refused["mode"] == "embedding", refused
            assert "501: This server does not support embeddings" in refused["out"]
            assert (await play(page, "a"))["state"] == "done"
            assert page.errors == []


async def test_live_logs_follow_a_journal_filter_it_and_end_it(tmp_path: Path,
                                                                 calls: Path) -> None:
    """journalctl is the stand-in of tests/http/conftest.py: two lines, then a third once
    the file "more" appears."""
    async for gw in _gateway(tmp_path, ("a",)):
        async with browser_page() as page:
            await page.goto(str(gw.client.make_url("/admin/")))
            lines = "document.getElementById('log-lines').textContent"
            # an engine's "logs" button follows its journal
            await page.wait_for("!!document.querySelector('#engines tr[data-model=\"a\"]')",
                                what="the engines")
            await page.evaluate("[...document.querySelectorAll('#engines tr[data-model=\"a\"] "
                                "button')].find(b => b.textContent === 'logs').click()")
            await page.wait_for(f"{lines}.includes('ERROR second line')", what="the tail")
            assert await page.evaluate("document.getElementById('log-source').value") == "a"
            # the filter: every word, any case
            await page.evaluate("document.getElementById('log-filter').value = 'error'; "
                                "document.getElementById('log-filter').dispatchEvent("
                                "new Event('input'))")
            assert await page.evaluate(lines) == \
                "2024-05-01T10:00:01+0000 host srv[7]: ERROR second line"
            await page.evaluate("document.getElementById('log-filter').value = ''; "
                                "document.getElementById('log-filter').dispatchEvent("
                                "new Event('input'))")
            (calls / "more").touch()   # a line written after the page began following
            await page.wait_for(f"{lines}.endsWith('written after the follow began')",
                                what="the new line")
            [pid] = runs(calls)
            # "stop" ends the follow, and the gateway ends its journalctl
            await page.evaluate("document.getElementById('log-follow').click()")
            await gone(pid)
            assert await page.evaluate("document.getElementById('log-follow').textContent") \
                == "follow"
            # the gateway's own journal: this one runs under no unit, and says so
            await page.evaluate("document.getElementById('log-source').value = ''; "
                                "document.getElementById('log-source').dispatchEvent("
                                "new Event('change')); document.getElementById('log-follow')"
                                ".click()")
            await page.wait_for("document.getElementById('log-state').textContent.includes("
                                "'not running as a systemd unit')", what="the gateway's log")
            assert page.errors == []


async def test_with_keys_the_tabs_key_draws_the_console_and_plays_what_it_may(
        tmp_path: Path) -> None:
    """Keys on: the admin key in the tab reads the series, the history and the logs; the
    playground lists what the same key may call (an admin-only key: nothing, and says so)."""
    ring = parse_keys({"keys": {
        "ops": {"sha256": digest("k-ops"), "scopes": ["admin", "inference"], "models": ["a"]},
        "watch": {"sha256": digest("k-watch"), "scopes": ["admin"]}}}, "test")
    async for gw in _gateway(tmp_path, ("a",), api_keys=ring):
        async with browser_page() as page:
            await page.goto(str(gw.client.make_url("/admin/")))
            for key in ("k-watch", "k-ops"):
                await page.wait_for("!document.getElementById('key-form').hidden",
                                    what="the key form")
                await page.evaluate(
                    f"document.getElementById('key').value = {json.dumps(key)}; "
                    "document.getElementById('key-form').requestSubmit()")
                await page.wait_for("document.getElementById('charts').dataset.window "
                                    "=== '1h'", what="the charts, read with the key")
                if key == "k-watch":
                    await page.wait_for("document.getElementById('play-kind').textContent"
                                        ".startsWith('no models for this key')",
                                        what="the playground's refusal")
                    await page.evaluate("sessionStorage.clear(); "
                                        "document.getElementById('key-form').hidden = false")
            await page.wait_for("[...document.querySelectorAll('#play-model option')]"
                                ".map(o => o.value).join() === 'a'", what="the key's models")
            answer = await play(page, "a")
            assert answer["state"] == "done" and answer["out"].startswith(" w0"), answer
            rows = await gw.records(1)
            assert rows[0]["api_key"] == "ops" and rows[0]["model"] == "a"


async def test_the_screenshot_script_makes_both_pictures(tmp_path: Path) -> None:
    """scripts/screenshots (tests/console_shots.py), on a short run: both pictures, each the
    whole page at its width, taken with nothing reported by the page."""
    shots = await console_shots.shoot(tmp_path, seconds=3)
    assert [p.name for p in shots] == list(console_shots.SHOTS)
    for path in shots:
        width, height = png_size(path)
        want_width, want_height = console_shots.SHOTS[path.name]
        assert width == want_width and height > want_height, (path, width, height)
