"""An agent's loop across models, where every turn is a swap: 3 models over 2 places
(gateway max_engines = 2, router --models-max 2), each turn a long shared prefix (a
system prompt of N tokens: tools, a document) and a short question, the models asked in
rotation so each turn evicts the model asked two turns before. The gateway saves an
engine's KV cache when it stops it and restores it before the engine is ready, so a turn
re-reads the prefix from disk; the router keeps none, so every turn prefills it again.

Each path's turn latency (the whole answer, max_tokens 8) at the issue's prefix (4k tokens,
plan.agent_prefixes' last) and at shorter ones, for the crossover: the shortest prefix at
which a restore beats a prefill. The model: scripts/get_model.sh small (SmolLM2-135M's
shape; a model of 1.1B prefills 4k tokens in tens of seconds on 2 cores, too long for a
run of three paths and five prefixes)."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from bench.suite import PY, Plan, cleanup, pct, router_model_id, run_unit, wait_http

NAMES = ("agent-a", "agent-b", "agent-c")
GATEWAY = "http://127.0.0.1:18670"
ROUTER = "http://127.0.0.1:18671"
ANSWER_TOKENS = 8
# each model sees the prefix once before turns are counted
WARMUP_TURNS = len(NAMES)
DOCUMENT_WORDS = ("the tool returns a list of files and each file has a name size owner and "
                  "time when the agent reads it the answer must cite the line number")


def link_models(source: Path, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    first = folder / f"{NAMES[0]}.gguf"
    if not first.exists() or first.stat().st_size != source.stat().st_size:
        first.unlink(missing_ok=True)
        shutil.copyfile(source, first)   # engines see /srv, not the host's cache
    for name in NAMES[1:]:
        (folder / f"{name}.gguf").unlink(missing_ok=True)
        os.link(first, folder / f"{name}.gguf")


def document(words: int) -> str:
    """A deterministic system prompt: words of the tiny vocabulary, in sentences."""
    vocab = DOCUMENT_WORDS.split()
    out = []
    for i in range(words):
        out.append(vocab[(i * 7 + i // 13) % len(vocab)])
        if i % 17 == 16:
            out.append(".")
    return " ".join(out)


class Turns:
    def __init__(self, session: aiohttp.ClientSession, base: str, ids: dict[str, str]):
        self._session, self._base, self._ids = session, base, ids

    async def turn(self, model: str, system: str, question: str) -> tuple[float, int]:
        """One turn: its latency (ms) and the prompt's token count."""
        body = {"model": self._ids[model], "max_tokens": ANSWER_TOKENS,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}]}
        t0 = time.perf_counter()
        async with self._session.post(self._base + "/v1/chat/completions", json=body) as resp:
            answer = await resp.json(content_type=None)
            took = (time.perf_counter() - t0) * 1000
        if resp.status != 200:
            raise RuntimeError(f"{self._base}: HTTP {resp.status}: {str(answer)[:300]}")
        return took, int(answer["usage"]["prompt_tokens"])


async def section(plan: Plan, work: Path, llama: str, models: dict[str, Path],
                  retried: list[dict[str, str]]) -> dict[str, Any]:
    from bench.suite import once_more
    if "small" not in models:
        raise RuntimeError("no small model: bench/run passes --model small=PATH "
                           "(scripts/get_model.sh small)")
    root = work / "agent"
    link_models(models["small"], root / "models")
    cfg = root / "gw.toml"
    cfg.write_text(f'models_dir = "{root / "models"}"\nllama_server = "{llama}"\n'
                   f'state_dir = "{root / "state"}"\nmax_engines = 2\n'
                   '[listen]\nport = 18670\n[admin]\npublic = true\n')
    run_unit("bench-agent-gw", [PY, "-m", "gatewayd", "--config", str(cfg), "serve"],
             notify=True)
    run_unit("bench-agent-router", [llama, "--models-dir", str(root / "models"),
                                    "--models-max", "2", "--host", "127.0.0.1",
                                    "--port", "18671"])
    await wait_http(ROUTER + "/health")
    await wait_http(GATEWAY + "/health")
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        paths = {"gateway": Turns(session, GATEWAY, {n: n for n in NAMES}),
                 "router": Turns(session, ROUTER, {n: await router_model_id(n, ROUTER)
                                                   for n in NAMES})}
        # words per token of this vocabulary, from one answer's usage
        words = 400
        _, tokens = await once_more(retried, "agent-loop calibration", lambda: paths[
            "gateway"].turn(NAMES[0], document(words), "hi"))
        per_token = words / tokens
        by_prefix: dict[int, dict[str, list[float]]] = {}
        prompt_tokens: dict[int, int] = {}
        turn_no = 0
        for prefix in plan.agent_prefixes:
            system = document(int(prefix * per_token))
            counted = plan.agent_turns if prefix == plan.agent_prefixes[-1] \
                else max(3, plan.agent_turns // 3)
            times = by_prefix.setdefault(prefix, {"gateway": [], "router": []})
            for k in range(WARMUP_TURNS + counted):
                model = NAMES[turn_no % len(NAMES)]
                turn_no += 1
                question = f"step {k}: which file has the line number {k * 37 % 1000}?"
                # the router keeps no cache: its warm-up turns would be measured turns
                # thrown away (a 4k prefill is ~30 s on 2 cores), so it has none
                names = ("gateway",) if k < WARMUP_TURNS else \
                    (("gateway", "router") if k % 2 == 0 else ("router", "gateway"))
                for name in names:
                    took, n = await once_more(
                        retried, f"agent-loop turn, prefix {prefix}, {name}",
                        partial(paths[name].turn, model, system, question))
                    prompt_tokens[prefix] = n
                    if k >= WARMUP_TURNS:
                        times[name].append(took)
    cleanup()   # the gateway, the router, and the engines, which outlive their gateway

    def p50(v: list[float]) -> float:
        return round(statistics.median(v), 1)

    full = plan.agent_prefixes[-1]
    prefixes = list(plan.agent_prefixes)
    gw50 = [p50(by_prefix[p]["gateway"]) for p in prefixes]
    ro50 = [p50(by_prefix[p]["router"]) for p in prefixes]
    # the shortest prefix from which on the restore wins at every longer one measured
    crossover = None
    for i in range(len(prefixes) - 1, -1, -1):
        if gw50[i] < ro50[i]:
            crossover = prefixes[i]
        else:
            break
    return {
        "prefix_tokens": full,
        "prompt_tokens": prompt_tokens,
        "turn_ms": {name: {"p50": p50(v), "p95": round(pct(sorted(v), 95), 1), "n": len(v)}
                    for name, v in by_prefix[full].items()},
        "turn_samples_ms": {name: [round(x, 1) for x in v]
                            for name, v in by_prefix[full].items()},
        "crossover": {"prefix_tokens": prefixes, "gateway_p50_ms": gw50, "router_p50_ms": ro50,
                      "crossover_tokens": crossover},
    }
