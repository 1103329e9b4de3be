"""Regenerate the console's screenshots in docs/: `scripts/screenshots` (or
`.venv/bin/python -m tests.console_shots [OUT_DIR] [--seconds S]`).

The gateway's real HTTP stack with fake engines (the test harness's, as the status page
tests use) is given a few minutes' worth of traffic in `seconds`: chats and streams of
varied speed on three models where two places are free (so evictions happen), a refused
call now and then; the page then plays a chat in its playground, and headless Chromium
takes the whole page at a desktop's and a phone's width (live logs stay empty: fake
engines write no journal).
tests/http/test_console.py::test_the_screenshot_script_makes_both_pictures keeps it working.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path

from tests.browser import Page, browser_page
from tests.http.test_front_door import Gateway, _gateway, chat
from tests.unit.test_engine_manager import MeasuringGpu
from tests.unit.test_ram_budget import FakeHost, FakeMeter

DOCS = Path(__file__).resolve().parents[1] / "docs"
SHOTS = {"console.png": (1100, 900), "console-phone.png": (390, 844)}
VRAM_MIB = {"a": 2300, "b": 1400, "c": 3100}


async def traffic(gw: Gateway, gpu: MeasuringGpu, seconds: float, seed: int = 7) -> None:
    rand = random.Random(seed)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    start = loop.time()
    while loop.time() < end:
        # a and b, then c's turn (it evicts a), then a again (it evicts c): a few evictions
        # with their reasons, not a thrash; and now and then a model nobody has
        phase = (loop.time() - start) / seconds
        pair = ["b", "c"] if 0.45 <= phase < 0.7 else ["a", "b"]
        model = rand.choices([*pair, "nope"], weights=[6, 4, 0.2])[0]
        body = chat(model, stream=rand.random() < 0.6, max_tokens=rand.randint(8, 40),
                    prompt=f"slow {rand.randint(1, 12)}")
        resp = await gw.client.post("/v1/chat/completions", json=body)
        await resp.read()
        for engine in gw.engines.registry.engines():   # what each engine's process holds on the GPU
            if engine.main_pid:
                gpu.per_process[engine.main_pid] = VRAM_MIB.get(engine.model_id, 0)


async def settle(page: Page) -> None:
    await page.wait_for("document.getElementById('live').textContent === 'live' && "
                        "document.querySelectorAll('svg[data-chart] circle').length > 0 && "
                        "document.getElementById('play-out').dataset.state === 'done'",
                        what="the console drawn", timeout=30)


async def shoot(out: Path, seconds: float) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    gpu = MeasuringGpu(24_576, 24_576)
    made = []
    with tempfile.TemporaryDirectory(prefix="llmgw-shots-") as tmp:
        async for gw in _gateway(Path(tmp), ("a", "b"), max_engines=2, gpu=gpu,
                                 host=FakeHost(), meter=FakeMeter()):
            await traffic(gw, gpu, seconds)
            for name, (width, height) in SHOTS.items():
                async with browser_page(width=width, height=height) as page:
                    await page.goto(str(gw.client.make_url("/admin/")))
                    await page.evaluate(
                        "document.getElementById('chart-window').value = '15m';"
                        "document.getElementById('chart-window').dispatchEvent("
                        "new Event('change'));"
                        "document.getElementById('play-prompt').value = 'slow 20 say hello';"
                        "document.getElementById('play-max').value = '24';")
                    await page.wait_for("[...document.querySelectorAll('#play-model option')]"
                                        ".some(o => o.value === 'b')", what="the models")
                    await page.evaluate("document.getElementById('play-model').value = 'b';"
                                        "document.getElementById('play-form').requestSubmit()")
                    await settle(page)
                    made.append(await page.screenshot(out / name))
                    if page.errors:
                        raise AssertionError(f"the page reported errors: {page.errors}")
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=DOCS)
    parser.add_argument("--seconds", type=float, default=240,
                        help="how long the traffic runs before the pictures are taken")
    args = parser.parse_args()
    for path in asyncio.run(shoot(args.out, args.seconds)):
        print(path)


if __name__ == "__main__":
    main()
