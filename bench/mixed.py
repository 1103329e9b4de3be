"""The mixed section of the suite: three models over two places, many clients, each asking a
random model: what the order of admission costs in swaps (issue 51).

Three names for one file (hard links: mix-a, mix-b, mix-c; the realistic model in the full
run, ~1.1 GiB, the small one in --smoke), so each is a model and an engine of its own,
`max_engines = 2` (the router: `--models-max 2`). `mixed_clients` clients (16 in the full
run) in a closed loop, each asking a model drawn at random (seeded: every system is asked the
same sequence) for a streamed `ANSWER_TOKENS`-token answer, then the next, for
`mixed_seconds`; once with a uniform mix and once skewed (70/20/10). Within each mix the
systems run one after another, each started afresh (every engine of the one before stopped),
warmed (one answer from each model), then measured:

  grouped  the gateway, `schedule = "grouped"`, `max_wait_s` (the plan's)
  fifo     the gateway, `schedule = "fifo"`: first come, first served across models
  router   llama.cpp's router, `--models-max 2`

Per system and mix: answers per minute (answered within the window), swaps per minute (engine
loads within the window: the gateway's `ready` events, each with its `load_s`, from
/admin/events/history; the router's "spawning server instance" lines in its journal, each
child's load from its own "model loaded" log stamp), p50/p99 latency (request to the last
token), the longest wait (request to the first token: waiting for the model's turn and
load, and the prompt), the bound it is judged against (max_wait_s + the longest load
measured + the drain: the longest first-to-last-token time of any answer), each model's
share of the answers (within the window) against its share of the demand (requests asked,
those unanswered at the window's end included), and the errors by kind. Requests still in
flight when the window ends are awaited (their latency and wait counted) up to
`max_wait_s + mixed_grace_s` (the plan's).

Until the gateway's configuration takes `schedule` (issue 51), the fifo run omits the key
(first come, first served is then the only order) and grouped is not run: `not_run` says
why.

Run by bench/suite.py (`--only mixed`); its units are bench-mixed-*, stopped after each run.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
import subprocess
import time
import tomllib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.suite import (
    CHAT,
    LOADED,
    PY,
    SPAWNED,
    Plan,
    chat,
    cleanup,
    pct,
    post_json,
    router_model_id,
    run_unit,
    wait_http,
)

NAMES = ("mix-a", "mix-b", "mix-c")
MIXES: dict[str, tuple[float, ...]] = {"uniform": (1 / 3, 1 / 3, 1 / 3),
                                       "skewed": (0.7, 0.2, 0.1)}
SYSTEMS = ("grouped", "fifo", "router")
ANSWER_TOKENS = 8
PLACES = 2
PORTS = {"grouped": 18670, "fifo": 18671, "router": 18672}
ROUTER_UNIT = "bench-mixed-router.service"
# after an error, a client waits this long before its next request (a system refusing at
# once would otherwise be asked in a tight loop)
ERROR_PAUSE_S = 0.1
SETTLE_S = 0.5


def link_models(source: Path, folder: Path) -> dict[str, Path]:
    """source copied into folder (engines see /srv, not the host's cache under /root), and
    hard-linked under each name: the models' files, by name."""
    folder.mkdir(parents=True, exist_ok=True)
    first = folder / f"{NAMES[0]}.gguf"
    if not first.exists() or first.stat().st_size != source.stat().st_size:
        first.unlink(missing_ok=True)
        shutil.copyfile(source, first)
    paths = {NAMES[0]: first}
    for name in NAMES[1:]:
        path = folder / f"{name}.gguf"
        path.unlink(missing_ok=True)
        path.hardlink_to(first)
        paths[name] = path
    return paths


def gateway_config(schedule: str | None, max_wait_s: float, weights: dict[str, Path],
                   llama: str, state: Path, port: int) -> str:
    """The gateway's configuration: schedule None leaves the key out (a gateway that does
    not know it); max_wait_s is said for the grouped order only."""
    top = f'llama_server = "{llama}"\nstate_dir = "{state}"\nmax_engines = {PLACES}\n'
    if schedule is not None:
        top += f'schedule = "{schedule}"\n'
        if schedule == "grouped":
            top += f"max_wait_s = {max_wait_s:g}\n"
    models = "".join(f'[models.{name}]\npath = "{path}"\n' for name, path in weights.items())
    return top + f"[listen]\nport = {port}\n[admin]\npublic = true\n" + models


def config_refused(text: str) -> str | None:
    """Why this build's gateway refuses the configuration text, or None if it takes it."""
    from gatewayd.core.config import parse_config
    from gatewayd.core.errors import ConfigError
    try:
        parse_config(tomllib.loads(text))
    except ConfigError as e:
        return str(e)
    return None


# -- the clients ------------------------------------------------------------------------


@dataclass
class Answer:
    model: str
    sent: float     # perf_counter seconds
    first: float    # the first content event
    done: float     # the last


@dataclass
class Load:
    """The clients' account of one system's run: every answer, the demand and the errors."""
    answers: list[Answer] = field(default_factory=list)
    asked: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    # still waiting at the cap: how long each had waited then (its wait is at least that)
    unanswered: list[tuple[str, float]] = field(default_factory=list)


async def ask(session: aiohttp.ClientSession, base: str, model: str) -> tuple[float, float]:
    """One streamed answer: when its first content event and its last came."""
    body = chat(model, ANSWER_TOKENS, stream=True, prompt="say something short")
    first = 0.0
    async with session.post(base + CHAT, json=body) as resp:
        if resp.status != 200:
            text = (await resp.read())[:200].decode(errors="replace")
            raise HttpError(resp.status, text)
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"content":"' in line:
                if not first:
                    first = time.perf_counter()
                last = time.perf_counter()
    if not first:
        raise RuntimeError("an answer with no content")
    return first, last


class HttpError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


async def closed_loop(base: str, ids: dict[str, str], weights: Sequence[float], mix: str,
                      clients: int, seconds: float, drain_s: float
                      ) -> tuple[Load, float, float]:
    """`clients` clients for `seconds`; ids: each model's id at this system, by name.
    The load, and the window's start and end (epoch seconds)."""
    load = Load()
    names = list(ids)
    t0_wall, t0 = time.time(), time.perf_counter()
    deadline = t0 + seconds

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        rnd = random.Random(f"{mix}-{i}")   # every system asked the same sequence
        while time.perf_counter() < deadline:
            name = rnd.choices(names, weights)[0]
            load.asked[name] += 1
            sent = time.perf_counter()
            try:
                first, done = await ask(session, base, ids[name])
            except asyncio.CancelledError:
                load.unanswered.append((name, time.perf_counter() - sent))
                raise
            except (TimeoutError, HttpError, RuntimeError, aiohttp.ClientError) as e:
                kind = f"HTTP {e.status}" if isinstance(e, HttpError) else type(e).__name__
                load.errors[kind] += 1
                await asyncio.sleep(ERROR_PAUSE_S)
                continue
            load.answers.append(Answer(name, sent, first, done))

    timeout = aiohttp.ClientTimeout(total=seconds + drain_s + 60)
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.ensure_future(client(i, session)) for i in range(clients)]
        _, pending = await asyncio.wait(tasks, timeout=seconds + drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    end = t0_wall + seconds
    # the answers on the client's clock, shifted to epoch seconds with the window
    for a in load.answers:
        a.sent, a.first, a.done = (t0_wall + (x - t0) for x in (a.sent, a.first, a.done))
    return load, t0_wall, end


# -- the loads, as each system tells them ------------------------------------------------


async def gateway_loads(base: str, since: float) -> list[tuple[float, float]]:
    """The gateway's engine loads from since: (when it was ready, load_s) each."""
    async with aiohttp.ClientSession() as s, s.get(
            base + "/admin/events/history", params={"since": f"{since:.3f}"}) as resp:
        body = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"/admin/events/history: HTTP {resp.status}: {body}")
    events = body["events"] if isinstance(body, dict) else body
    return [(float(e["ts"]), float(e["load_s"])) for e in events
            if e.get("type") == "engine" and e.get("state") == "ready"
            and e.get("load_s") is not None]


def router_loads(since: float) -> tuple[list[float], list[float]]:
    """The router's loads from since, from its journal: when each child was spawned
    (epoch seconds), and each child's load (s, from its own "model loaded" stamp)."""
    subprocess.run(["journalctl", "--sync"], check=False)
    out = subprocess.run(["journalctl", "-u", ROUTER_UNIT, "-o", "json", "--no-pager",
                          "--since", f"@{math.floor(since)}"],
                         capture_output=True, text=True, check=False).stdout
    return parse_router_journal(out.splitlines(), since)


def parse_router_journal(lines: Sequence[str], since: float
                         ) -> tuple[list[float], list[float]]:
    spawned, loads = [], []
    for line in lines:
        try:
            entry = json.loads(line)
            ts = int(entry["__REALTIME_TIMESTAMP"]) / 1e6
        except (ValueError, KeyError, TypeError):
            continue
        message = entry.get("MESSAGE")
        if not isinstance(message, str) or ts < since:
            continue
        if SPAWNED.search(message):
            spawned.append(ts)
        elif (loaded := LOADED.search(message)) and loaded.group(1) is not None:
            m, sec, ms, us = (int(g) for g in loaded.groups()[1:])
            loads.append(m * 60 + sec + ms / 1000 + us / 1e6)
    return spawned, loads


# -- one system's run, summed up ----------------------------------------------------------


def summarise(load: Load, weights: Sequence[float], names: Sequence[str], start: float,
              end: float, load_ends: Sequence[float], load_s: Sequence[float],
              max_wait_s: float | None) -> dict[str, Any]:
    """One system's figures. load_ends: when each load in the run ended (epoch s);
    load_s: how long each took. max_wait_s: the grouped order's, for its bound."""
    minutes = (end - start) / 60
    in_window = [a for a in load.answers if a.done <= end]
    latency = sorted((a.done - a.sent) * 1000 for a in load.answers)
    # a request never answered had waited at least until the cap
    waits = [a.first - a.sent for a in load.answers] + [w for _, w in load.unanswered]
    drains = [a.done - a.first for a in load.answers]
    answered = Counter(a.model for a in in_window)
    asked_total, answered_total = sum(load.asked.values()), len(in_window)
    share = {}
    for name, weight in zip(names, weights, strict=True):
        demand = load.asked[name] / asked_total if asked_total else None
        got = answered[name] / answered_total if answered_total else None
        share[name] = {"weight": round(weight, 4), "asked": load.asked[name],
                       "answered": answered[name], "demand": rounded(demand, 4),
                       "answers": rounded(got, 4),
                       "ratio": rounded(got / demand, 3) if got is not None and demand
                       else None}
    loads_in = [t for t in load_ends if start <= t <= end]
    out: dict[str, Any] = {
        "seconds": round(end - start, 1),
        "answers": answered_total, "answers_per_min": round(answered_total / minutes, 1),
        "loads": len(loads_in), "loads_per_min": round(len(loads_in) / minutes, 2),
        "loads_per_100_answers": round(100 * len(loads_in) / answered_total, 2)
        if answered_total else None,
        "p50_ms": rounded(pct(latency, 50), 1) if latency else None,
        "p99_ms": rounded(pct(latency, 99), 1) if latency else None,
        "longest_wait_s": rounded(max(waits, default=None), 3),
        "longest_load_s": rounded(max(load_s, default=None), 3),
        "longest_drain_s": rounded(max(drains, default=None), 3),
        "load_s_samples": [round(x, 3) for x in load_s],
        "answered_after_window": len(load.answers) - answered_total,
        "unanswered": len(load.unanswered),
        "errors": sum(load.errors.values()), "error_kinds": dict(load.errors),
        "share": share,
        "share_ratio_min": min((s["ratio"] for s in share.values() if s["ratio"] is not None),
                               default=None)}
    if max_wait_s is not None:
        out["max_wait_s"] = max_wait_s
        out["bound_s"] = round(max_wait_s + (out["longest_load_s"] or 0.0)
                               + (out["longest_drain_s"] or 0.0), 3)
    return out


def rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


# -- the section --------------------------------------------------------------------------


async def section(plan: Plan, work: Path, llama: str, models: dict[str, Path],
                  retried: list[dict[str, str]]) -> dict[str, Any]:
    preset = plan.mixed_preset
    if preset not in models:
        raise RuntimeError(f"no {preset} model: bench/run passes --model {preset}=PATH "
                           f"(scripts/get_model.sh {preset})")
    root = work / "mixed"
    weights = link_models(models[preset], root / f"{preset}-models")
    max_wait_s = plan.mixed_max_wait_s
    configs: dict[str, str] = {}
    not_run: dict[str, str] = {}
    for system in ("grouped", "fifo"):
        if system not in plan.mixed_systems:
            continue
        text = gateway_config(system, max_wait_s, weights, llama, root / f"state-{system}",
                              PORTS[system])
        if (why := config_refused(text)) is not None:
            if system == "fifo":   # a gateway from before the key: fifo is its only order
                text = gateway_config(None, max_wait_s, weights, llama,
                                      root / f"state-{system}", PORTS[system])
                not_run["fifo_schedule_key"] = f"omitted: {why}"
            else:
                not_run[system] = f"this build's gateway refuses its configuration: {why}"
                continue
        configs[system] = text
    for system in set(SYSTEMS) - set(plan.mixed_systems):
        not_run[system] = "left out (--mixed-systems)"
    systems = [s for s in SYSTEMS if s not in not_run]
    runs: dict[str, dict[str, Any]] = {}
    order: list[list[str]] = []
    try:
        for i, (mix, shares) in enumerate(MIXES.items()):
            k = i % len(systems)
            rotated = [*systems[k:], *systems[:k]]
            order.append(rotated)
            for system in rotated:
                runs.setdefault(mix, {})[system] = await run_one(
                    plan, root, llama, system, configs.get(system), mix, shares, weights)
    finally:
        cleanup()
    return {"model": {"preset": preset, "bytes": weights[NAMES[0]].stat().st_size},
            "clients": plan.mixed_clients, "answer_tokens": ANSWER_TOKENS, "places": PLACES,
            "seconds": plan.mixed_seconds, "max_wait_s": max_wait_s,
            "mixes": {m: list(w) for m, w in MIXES.items()}, "order": order,
            "not_run": not_run, "runs": runs}


async def run_one(plan: Plan, root: Path, llama: str, system: str, config: str | None,
                  mix: str, shares: Sequence[float], weights: dict[str, Path]
                  ) -> dict[str, Any]:
    """One system, one mix: started afresh, warmed, measured, stopped."""
    cleanup()   # the system before, and the engines it left
    port = PORTS[system]
    base = f"http://127.0.0.1:{port}"
    if system == "router":
        run_unit(ROUTER_UNIT.removesuffix(".service"),
                 [llama, "--models-dir", str(next(iter(weights.values())).parent),
                  "--models-max", str(PLACES), "--host", "127.0.0.1", "--port", str(port)])
        await wait_http(base + "/health")
        ids = {name: await router_model_id(name, base) for name in NAMES}
    else:
        assert config is not None
        state = root / f"state-{system}"
        # a state of its own each time: a previous run's desired engines would be started
        shutil.rmtree(state, ignore_errors=True)
        cfg = root / f"{system}.toml"
        cfg.write_text(config)
        run_unit(f"bench-mixed-{system}", [PY, "-m", "gatewayd", "--config", str(cfg), "serve"],
                 notify=True)
        await wait_http(base + "/health")
        ids = {name: name for name in NAMES}
    # warm: each model answers once (its file in the page cache, its load learned); the
    # last two hold the places when the window opens
    for name in NAMES:
        status, body = await post_json(base + CHAT, chat(ids[name], 1))
        if status != 200:
            raise RuntimeError(f"mixed, {system}: warming {name}: HTTP {status}: {body}")
    await asyncio.sleep(SETTLE_S)   # the router unloads asynchronously; events settle
    drain_s = plan.mixed_max_wait_s + plan.mixed_grace_s
    load, start, end = await closed_loop(base, ids, shares, mix, plan.mixed_clients,
                                          plan.mixed_seconds, drain_s)
    if system == "router":
        load_ends, load_s = router_loads(start)
    else:
        loads = await gateway_loads(base, start)
        load_ends, load_s = [t for t, _ in loads], [s for _, s in loads]
    figures = summarise(load, shares, NAMES, start, end, load_ends, load_s,
                        plan.mixed_max_wait_s if system == "grouped" else None)
    print(f"bench mixed: {mix}, {system}: {figures['answers_per_min']} answers/min, "
          f"{figures['loads_per_min']} loads/min, p99 {figures['p99_ms']} ms, "
          f"{figures['errors']} errors", flush=True)
    if not load.answers:
        # seen in smoke runs on a busy 2-core box, on this session's code and on the
        # build before it alike (issue 51's note): a system answering nothing for the
        # smoke's few seconds; a full run's windows are minutes, where it fails the run
        why = f"mixed, {system}, {mix}: no answer at all (errors: {dict(load.errors)})"
        if plan.mixed_strict:
            raise RuntimeError(why)
        print(f"bench mixed: {why}; the smoke goes on", flush=True)
        figures["no_answer"] = True
    return figures

