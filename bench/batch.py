"""The batch section of the suite: what a batch job running on the gateway costs its
interactive users, and how much of the machine it gets (issue 53).

One model (the realistic one in the full run, ~1.1 GiB; the small one in --smoke), one
gateway with `[batches] idle_s = IDLE_S`. `batch_clients` interactive clients in a closed
loop ask it for a streamed `ANSWER_TOKENS`-token answer, then the next, for `batch_seconds`:

  alone   no batch;
  beside  a batch of BATCH_LINES lines (`BATCH_TOKENS` tokens each) to the same model,
          created just before the window: while the clients ask, the gateway keeps it to
          one line in flight on the model's engine (service/batches.may_send);

the two windows alternate (alone, beside, alone, beside) so that a drift of the machine
falls on both. Then, with no interactive traffic, the batch goes on for `batch_seconds`
once `idle_s` has passed (`quiet`: it may fill the engine's slots). Reported: the clients'
p50 and p99 (request to the last token) alone and beside, their ratio (the goal: p99 beside
≤ 1.2 x alone), and the batch's lines per minute beside the clients and quiet.

Run by bench/suite.py (`--only batch`); its unit is bench-batch-gateway, stopped after.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.mixed import HttpError, ask
from bench.suite import CHAT, PY, Plan, chat, cleanup, pct, post_json, run_unit, wait_http

PORT = 18680
IDLE_S = 5.0          # the gateway's batches.idle_s here (the default, 30 s, is for people)
ANSWER_TOKENS = 8
BATCH_TOKENS = 16
BATCH_LINES = 400
MODEL = "batch-model"
ROUNDS = 2            # alone, beside, alone, beside


def gateway_config(weights: Path, llama: str, state: Path) -> str:
    return (f'llama_server = "{llama}"\nstate_dir = "{state}"\nmax_engines = 1\n'
            f"[batches]\nidle_s = {IDLE_S:g}\n"
            f"[listen]\nport = {PORT}\n[admin]\npublic = true\n"
            f'[models.{MODEL}]\npath = "{weights}"\n')


def batch_file(lines: int) -> bytes:
    rows = ({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": chat(MODEL, BATCH_TOKENS, prompt=f"write about the number {i}")}
            for i in range(lines))
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


async def create_batch(base: str, lines: int) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", batch_file(lines), filename="bench.jsonl")
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/files", data=form) as resp:
            uploaded = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"batch: upload: HTTP {resp.status}: {uploaded}")
        async with s.post(base + "/v1/batches", json={
                "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}) as resp:
            batch = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"batch: create: HTTP {resp.status}: {batch}")
    return str(batch["id"])


async def batch_done(base: str, batch_id: str) -> int:
    """Lines of the batch answered so far."""
    async with aiohttp.ClientSession() as s, s.get(f"{base}/v1/batches/{batch_id}") as resp:
        counts = (await resp.json())["request_counts"]
    return int(counts["completed"]) + int(counts["failed"])


async def cancel_batch(base: str, batch_id: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base}/v1/batches/{batch_id}/cancel") as resp:
            await resp.read()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            async with s.get(f"{base}/v1/batches/{batch_id}") as resp:
                if (await resp.json())["status"] == "cancelled":
                    return
            await asyncio.sleep(0.2)


async def interactive(base: str, clients: int, seconds: float) -> dict[str, Any]:
    """clients in a closed loop for seconds: their latencies (ms) and errors."""
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            try:
                _, done = await ask(session, base, MODEL)
            except (HttpError, RuntimeError, TimeoutError, aiohttp.ClientError):
                errors += 1
                await asyncio.sleep(0.1)
                continue
            latencies.append((done - sent) * 1000)

    timeout = aiohttp.ClientTimeout(total=seconds + 600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return {"latencies_ms": latencies, "errors": errors}


def figures(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {"answers": len(ordered),
            "p50_ms": round(pct(ordered, 50), 1) if ordered else None,
            "p99_ms": round(pct(ordered, 99), 1) if ordered else None}


async def section(plan: Plan, work: Path, llama: str, models: dict[str, Path],
                  retried: list[dict[str, str]]) -> dict[str, Any]:
    preset = plan.batch_preset
    if preset not in models:
        raise RuntimeError(f"no {preset} model: bench/run passes --model {preset}=PATH "
                           f"(scripts/get_model.sh {preset})")
    root = work / "batch"
    root.mkdir(parents=True, exist_ok=True)
    weights = root / f"{MODEL}.gguf"
    if not weights.exists() or weights.stat().st_size != models[preset].stat().st_size:
        shutil.copyfile(models[preset], weights)   # engines see /srv, not /root's cache
    state = root / "state"
    shutil.rmtree(state, ignore_errors=True)
    cfg = root / "gateway.toml"
    cfg.write_text(gateway_config(weights, llama, state))
    base = f"http://127.0.0.1:{PORT}"
    cleanup()
    alone: list[float] = []
    beside: list[float] = []
    errors = {"alone": 0, "beside": 0}
    lines_beside: list[float] = []
    try:
        run_unit("bench-batch-gateway", [PY, "-m", "gatewayd", "--config", str(cfg), "serve"],
                 notify=True)
        await wait_http(base + "/health")
        status, body = await post_json(base + CHAT, chat(MODEL, 1))   # loaded, warm
        if status != 200:
            raise RuntimeError(f"batch: warming: HTTP {status}: {body}")
        seconds = plan.batch_seconds
        batch_id = ""
        for _ in range(ROUNDS):
            run = await interactive(base, plan.batch_clients, seconds)
            alone += run["latencies_ms"]
            errors["alone"] += run["errors"]
            batch_id = await create_batch(base, BATCH_LINES)
            t0, done0 = time.monotonic(), await batch_done(base, batch_id)
            run = await interactive(base, plan.batch_clients, seconds)
            done1 = await batch_done(base, batch_id)
            lines_beside.append((done1 - done0) / (time.monotonic() - t0) * 60)
            beside += run["latencies_ms"]
            errors["beside"] += run["errors"]
            await cancel_batch(base, batch_id)
        # no interactive traffic: after idle_s the batch may fill the engine's slots
        batch_id = await create_batch(base, BATCH_LINES)
        await asyncio.sleep(IDLE_S + 1.0)
        t0, done0 = time.monotonic(), await batch_done(base, batch_id)
        await asyncio.sleep(seconds)
        quiet = (await batch_done(base, batch_id) - done0) / (time.monotonic() - t0) * 60
        await cancel_batch(base, batch_id)
    finally:
        cleanup()
    a, b = figures(alone), figures(beside)
    out = {"model": {"preset": preset, "bytes": weights.stat().st_size},
           "clients": plan.batch_clients, "seconds": seconds, "rounds": ROUNDS,
           "answer_tokens": ANSWER_TOKENS, "batch_tokens": BATCH_TOKENS, "idle_s": IDLE_S,
           "alone": a, "beside": b, "errors": errors,
           "p99_ratio": round(b["p99_ms"] / a["p99_ms"], 3)
           if a["p99_ms"] and b["p99_ms"] else None,
           "p50_ratio": round(b["p50_ms"] / a["p50_ms"], 3)
           if a["p50_ms"] and b["p50_ms"] else None,
           "batch_lines_per_min_beside": round(sum(lines_beside) / len(lines_beside), 1),
           "batch_lines_per_min_quiet": round(quiet, 1)}
    print(f"bench batch: interactive p99 {a['p99_ms']} ms alone, {b['p99_ms']} ms beside a "
          f"batch ({out['p99_ratio']}x); the batch: {out['batch_lines_per_min_beside']} "
          f"lines/min beside, {out['batch_lines_per_min_quiet']} quiet", flush=True)
    return out
