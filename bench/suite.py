"""The benchmark suite. Runs inside the systemd test container (bench/run boots it).

Paths measured side by side, interleaved round by round (A B C D, B C D A, ...) so
drift of a noisy machine falls on every path alike:
  direct   - the engine's own unix socket
  gateway  - llm-gateway (a systemd service, engines as units)
  router   - llama.cpp's router (llama-server --models-dir, no -m)
  bare     - bench/bare_proxy.py, the floor of any aiohttp gateway
Same llama-server binary, same generated tiny models. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import make_tiny_model  # noqa: E402

PY = sys.executable
T = TypeVar("T")
CHAT = "/v1/chat/completions"


@dataclass
class Target:
    name: str
    base: str
    socket: str | None = None

    def session(self, limit: int = 100, fresh: bool = False) -> aiohttp.ClientSession:
        """fresh: a new connection for every request."""
        connector: aiohttp.BaseConnector = (
            aiohttp.UnixConnector(path=self.socket, limit=limit, force_close=fresh)
            if self.socket else aiohttp.TCPConnector(limit=limit, force_close=fresh))
        return aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=300))


@dataclass
class Samples:
    latencies_ms: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    cpu_us_per_req: list[float] = field(default_factory=list)
    retries: int = 0

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        out: dict[str, Any] = {"n": len(lat)}
        if lat:
            out.update(p50_ms=round(pct(lat, 50), 3), p99_ms=round(pct(lat, 99), 3))
        if self.rates:
            out["req_per_s"] = round(statistics.median(self.rates), 1)
            out["req_per_s_spread"] = [round(min(self.rates), 1), round(max(self.rates), 1)]
        if self.cpu_us_per_req:
            out["cpu_us_per_req"] = round(statistics.median(self.cpu_us_per_req), 1)
        out["client_retries"] = self.retries
        return out


def pct(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def chat(model: str, max_tokens: int = 1, stream: bool = False, prompt: str = "hi"
         ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": prompt}]}
    if stream:
        body["stream"] = True
    return body


async def load(target: Target, body: dict[str, Any], n: int, concurrency: int,
               samples: Samples, cpu_pid: int | None = None) -> None:
    """n requests, `concurrency` at a time; latency of each, throughput of the whole."""
    async with target.session(limit=concurrency) as session, \
            target.session(limit=concurrency, fresh=True) as fresh:
        payload = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        per_worker = [n // concurrency + (1 if i < n % concurrency else 0)
                      for i in range(concurrency)]

        async def worker(count: int) -> None:
            for _ in range(count):
                t0 = time.perf_counter()
                for attempt in (1, 2):
                    try:
                        async with (session if attempt == 1 else fresh).post(
                                target.base + CHAT, data=payload, headers=headers) as resp:
                            answer = await resp.read()
                        break
                    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
                        # llama-server closes keep-alive connections (after 100 requests,
                        # or idle ones at high concurrency): like any client, try again,
                        # on a new connection, not another pooled one (counted)
                        samples.retries += 1
                        if attempt == 2:
                            raise RuntimeError(f"{target.name}: failed twice, the second "
                                               f"time on a new connection: {e}") from e
                if resp.status != 200:   # which path, and what it said
                    raise RuntimeError(f"{target.name}: HTTP {resp.status}: "
                                       f"{answer[:300].decode(errors='replace')}")
                samples.latencies_ms.append((time.perf_counter() - t0) * 1000)
        cpu0 = cpu_seconds(cpu_pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in per_worker))
        wall = time.perf_counter() - t0
        samples.rates.append(n / wall)
        if cpu_pid is not None:
            samples.cpu_us_per_req.append((cpu_seconds(cpu_pid) - cpu0) / n * 1e6)


@dataclass
class StreamRun:
    """One streamed answer, as the client read it."""
    rate_s: float          # seconds from the first content read to the last
    first_token_ms: float  # from the request to the first content read
    answer_s: float        # from the request to the last content read
    gaps: list[float]      # ms between reads
    reads: int
    events: int            # content events in all
    first_read_events: int

    @property
    def tokens_per_s(self) -> float:
        # the first read's tokens arrived at its time: the rate is over the ones after it
        return (self.events - self.first_read_events) / self.rate_s

    @property
    def answer_tokens_per_s(self) -> float:
        return self.events / self.answer_s


# A first read holding this many tokens or more means the client was not scheduled while
# they came (2 cores: engine, proxy and client share them), not anything the path did; timed
# from that read, the few tokens left would give a rate of 100k+ tokens/s. Such a stream is
# run again (twice at most, counted per path).
STALLED_START = 8


async def stream_once(target: Target, body: dict[str, Any]) -> StreamRun:
    """One streamed answer, read as it comes.

    The rate is timed from the first content event, not from the answer's head: a proxy that
    sends its head with the first event (aiohttp does) would otherwise be spared the prompt's
    processing that a path sending its head at once (llama-server) is charged."""
    async with target.session() as session:
        t_request = time.perf_counter()
        async with session.post(target.base + CHAT, json=body) as resp:
            gaps, reads, events = [], 0, 0
            first = last = 0.0
            first_events = 0
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                count = chunk.count(b'"content":"')
                if not count and not events:
                    continue              # the role-only first chunk: no token yet
                if not events:
                    first, first_events = now, count
                else:
                    gaps.append((now - last) * 1000)
                last = now
                reads += 1
                events += count
    return StreamRun(rate_s=max(last - first, 1e-9), first_token_ms=(first - t_request) * 1000,
                     answer_s=max(last - t_request, 1e-9), gaps=gaps, reads=reads,
                     events=events, first_read_events=first_events)


def cpu_seconds(pid: int | None) -> float:
    """The process's CPU time so far, all its threads, from schedstat: nanoseconds (/proc's
    stat counts 10 ms ticks: a 256-token stream is one or two of them)."""
    if pid is None:
        return 0.0
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):   # a thread ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main_pid(unit: str) -> int:
    return int(sh("systemctl", "show", "-p", "MainPID", "--value", unit))


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


def run_unit(unit: str, argv: Sequence[str], *, notify: bool = False,
             env: dict[str, str] | None = None, properties: Sequence[str] = ()) -> None:
    """properties: more unit settings ("LimitNOFILE=65536")."""
    cmd = ["systemd-run", "--quiet", f"--unit={unit}", "--collect",
           "-p", f"WorkingDirectory={REPO}"]
    if notify:
        cmd += ["-p", "Type=notify"]
    for prop in properties:
        cmd += ["-p", prop]
    for k, v in (env or {}).items():
        cmd += ["-E", f"{k}={v}"]
    subprocess.run([*cmd, *argv], check=True)


async def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} not up after {timeout}s")


async def post_json(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def interleave(items: Sequence[Target], rnd: int) -> list[Target]:
    k = rnd % len(items)
    return [*items[k:], *items[:k]]


# -- the suite -------------------------------------------------------------------------


@dataclass
class Plan:
    rounds: int
    n_seq: int
    n_c8: int
    n_c64: int
    n_ceiling: int
    streams: int       # rounds of the 256-token stream
    starts: int        # cold starts (and KV restores) per path
    cycles: int
    open_streams: int
    activations: int   # socket-activated starts (one process start each: noisy)
    real_starts: int   # cold starts per path and per page-cache state, realistic model
    real_cycles: int   # swap cycles over 3 realistic models, 2 places
    real_streams: int  # rounds of streams on the realistic model (one alone, 4 at once)
    agent_turns: int   # agent-loop turns per path at the full prefix
    agent_prefixes: tuple[int, ...]   # prefix lengths (tokens) for the crossover
    slot_rounds: int   # rounds of 16 concurrent streams on a 4-slot engine
    crowd_active: int  # streams open at once beside the idle connections
    crowd_idle: int    # idle keep-alive connections
    refusal_rounds: int      # rounds of each refusal's flood (and of inference idle/flooded)
    refusal_seconds: float   # each flood's length
    mixed_seconds: float     # each system's window per mix, mixed traffic (--mixed-seconds)
    mixed_clients: int       # clients in a closed loop there
    mixed_max_wait_s: float  # the grouped order's max_wait_s there
    mixed_grace_s: float     # past max_wait_s, how long the window's last requests are awaited
    mixed_preset: str        # the model (scripts/get_model.sh PRESET) under three names
    mixed_systems: tuple[str, ...] = ("grouped", "fifo", "router")   # (--mixed-systems)
    # a system of the mixed section that answered nothing fails the run (the smoke: it is
    # said, and the run goes on; see bench/mixed.run_one)
    mixed_strict: bool = True
    batch_seconds: float = 60.0   # each interactive window, alone and beside a batch
    batch_clients: int = 2        # interactive clients in a closed loop there
    batch_preset: str = "realistic"   # the model (scripts/get_model.sh PRESET)


# A single stream's rate moves by 2x between streams here (2 cores shared by the engine,
# the proxy and the client): its median takes many rounds, which cost ~0.1 s each
PLANS = {"full": Plan(rounds=5, n_seq=200, n_c8=400, n_c64=640, n_ceiling=3000, streams=30,
                      starts=12, cycles=4, open_streams=1000, activations=7,
                      real_starts=5, real_cycles=3, real_streams=6, agent_turns=9,
                      agent_prefixes=(256, 512, 1024, 2048, 4096), slot_rounds=5,
                      crowd_active=256, crowd_idle=2000, refusal_rounds=3,
                      refusal_seconds=3.0, mixed_seconds=180.0, mixed_clients=16,
                      mixed_max_wait_s=20.0, mixed_grace_s=120.0, mixed_preset="realistic"),
         "smoke": Plan(rounds=1, n_seq=20, n_c8=40, n_c64=64, n_ceiling=200, streams=1,
                       starts=1, cycles=1, open_streams=100, activations=2,
                       real_starts=1, real_cycles=1, real_streams=1, agent_turns=2,
                       agent_prefixes=(512,),
                       slot_rounds=1, crowd_active=32, crowd_idle=100, refusal_rounds=1,
                       refusal_seconds=1.0, mixed_seconds=6.0, mixed_clients=4,
                       mixed_max_wait_s=2.0, mixed_grace_s=6.0, mixed_preset="small",
                       mixed_strict=False, batch_seconds=2.0, batch_clients=1,
                       batch_preset="small")}


def tiny_models(work: Path) -> tuple[Path, Path]:
    """The generated models: tiny-alpha, -beta and -gamma in the first folder (the router's
    models dir too), and tiny-cold in the second: tiny-beta's weights, for a model
    configured with no KV cache kept."""
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(("alpha", "beta", "gamma")):
        make_tiny_model.write_model(str(models / f"tiny-{name}.gguf"), f"tiny-{name}", seed)
    cold = work / "cold-models"
    cold.mkdir(exist_ok=True)
    make_tiny_model.write_model(str(cold / "tiny-cold.gguf"), "tiny-cold", 1)
    return models, cold


def cold_model(cold: Path, args: Sequence[str] = ()) -> str:
    """tiny-cold's section of the gateway's configuration."""
    return (f'[models.tiny-cold]\npath = "{cold / "tiny-cold.gguf"}"\nkv_cache_save = false\n'
            + (f"args = {json.dumps(list(args))}\n" if args else ""))


# The sections a run can be limited to (--only): "tiny" is sections 1-6 on the tiny models;
# the others set up their own units and stop them when done
SECTIONS = ("tiny", "realistic", "agent", "crowd", "refusals", "mixed", "batch")


async def once_more(retried: list[dict[str, str]], what: str,
                    measure: Callable[[], Awaitable[T]]) -> T:
    """measure, and once more if it fails: a noisy machine's transient error (a connection
    reset, an engine slow to start) costs one attempt, named in results.json's "retried";
    a second failure ends the run, named."""
    try:
        return await measure()
    except Exception as e:
        print(f"bench: {what} failed ({type(e).__name__}: {e}); once more", file=sys.stderr)
        retried.append({"what": what, "error": f"{type(e).__name__}: {e}"[:300]})
    try:
        return await measure()
    except Exception as e:
        raise RuntimeError(f"{what} failed twice: {type(e).__name__}: {e}") from e


async def suite(plan: Plan, work: Path, llama: str, sections: Sequence[str] = SECTIONS,
                models: dict[str, Path] | None = None) -> dict[str, Any]:
    """models: the generated models of realistic size by preset ("small", "realistic":
    scripts/get_model.sh), for the sections after "tiny"."""
    models = models or {}
    results: dict[str, Any] = {"plan": plan.__dict__, "machine": machine(), "retried": []}
    if "tiny" in sections:
        await tiny_sections(plan, work, llama, results)
    if "realistic" in sections:
        from bench import realistic
        results["realistic"] = await realistic.section(plan, work, llama, models,
                                                       results["retried"])
    if "agent" in sections:
        from bench import agent_loop
        results["agent_loop"] = await agent_loop.section(plan, work, llama, models,
                                                        results["retried"])
    if "crowd" in sections:
        from bench import crowd
        results.update(await crowd.section(plan, work, llama, models, results["retried"]))
    if "refusals" in sections:
        from bench import refusals
        results["refusals"] = await refusals.section(plan, work, results["retried"])
    if "mixed" in sections:
        from bench import mixed
        results["mixed"] = await mixed.section(plan, work, llama, models, results["retried"])
    if "batch" in sections:
        from bench import batch
        results["batch"] = await batch.section(plan, work, llama, models, results["retried"])
    return results


async def tiny_sections(plan: Plan, work: Path, llama: str, results: dict[str, Any]) -> None:
    """Sections 1-6, on the tiny models: warm overhead, the proxy ceiling, streams, cold
    start and swap, footprint and socket activation, the KV cache kept across a stop."""
    models, cold = tiny_models(work)   # tiny-cold: no KV cache kept (section 6)
    fake_models = work / "fake-models"
    fake_models.mkdir(exist_ok=True)
    (fake_models / "fake.gguf").write_bytes(b"GGUF")
    gw_cfg = write_config(work / "gw.toml", models, llama, work / "gw-state", 18600,
                          extra=cold_model(cold))
    fake_cfg = write_config(work / "fake.toml", fake_models, str(REPO / "bench/fake-llama-server"),
                            work / "fake-state", 18610)
    run_unit("bench-gateway", [PY, "-m", "gatewayd", "--config", str(gw_cfg), "serve"],
             notify=True)
    run_unit("bench-gateway-fake", [PY, "-m", "gatewayd", "--config", str(fake_cfg), "serve"],
             notify=True)
    run_unit("bench-router", [llama, "--models-dir", str(models), "--models-max", "2",
                              "--host", "127.0.0.1", "--port", "18601"])
    await wait_http("http://127.0.0.1:18601/health")
    status, body = await post_json("http://127.0.0.1:18600/admin/engines/start",
                                   {"model": "tiny-alpha"})
    assert status == 200, body
    socket = body["engine"]["socket"]
    status, body = await post_json("http://127.0.0.1:18610/admin/engines/start",
                                   {"model": "fake"})
    assert status == 200, body
    fake_socket = body["engine"]["socket"]
    run_unit("bench-bare", [PY, "-m", "bench.bare_proxy", "--socket", socket, "--port", "18602"])
    run_unit("bench-bare-fake", [PY, "-m", "bench.bare_proxy", "--socket", fake_socket,
                                 "--port", "18612"])
    await wait_http("http://127.0.0.1:18602/health")
    await wait_http("http://127.0.0.1:18612/health")
    router_id = await router_model_id("tiny-alpha")
    targets = [Target("direct", "http://engine", socket),
               Target("gateway", "http://127.0.0.1:18600"),
               Target("router", "http://127.0.0.1:18601"),
               Target("bare", "http://127.0.0.1:18602")]
    model_for = {"router": router_id}
    for t in targets:   # warm every path (router loads its child here)
        await load(t, chat(model_for.get(t.name, "tiny-alpha")), 5, 1, Samples())

    # 1. warm request overhead
    warm: dict[str, dict[str, Samples]] = {}
    for c, n in ((1, plan.n_seq), (8, plan.n_c8), (64, plan.n_c64)):
        per = warm.setdefault(f"c{c}", {t.name: Samples() for t in targets})
        for rnd in range(plan.rounds):
            for t in interleave(targets, rnd):
                await load(t, chat(model_for.get(t.name, "tiny-alpha")), n, c, per[t.name])
    results["warm"] = {c: {name: s.summary() for name, s in per.items()}
                       for c, per in warm.items()}
    results["warm_raw_c1"] = {name: s.latencies_ms for name, s in warm["c1"].items()}

    # 2. proxy ceiling against an instant engine
    fake_targets = [Target("direct", "http://engine", fake_socket),
                    Target("gateway", "http://127.0.0.1:18610"),
                    Target("bare", "http://127.0.0.1:18612")]
    pids = {"gateway": main_pid("bench-gateway-fake.service"),
            "bare": main_pid("bench-bare-fake.service")}
    ceiling = {t.name: Samples() for t in fake_targets}
    for rnd in range(plan.rounds):
        for t in interleave(fake_targets, rnd):
            await load(t, chat("fake"), plan.n_ceiling, 64, ceiling[t.name],
                       cpu_pid=pids.get(t.name))
    results["ceiling"] = {name: s.summary() for name, s in ceiling.items()}

    # 3. streaming, 256 tokens. The router's child is its own llama-server process: it is
    # measured directly too (router_engine), so the router's hop can be told from its engine.
    stream_targets = [*targets, Target("router_engine", await router_child_base(router_id))]
    model_for["router_engine"] = router_id
    stream_pids = {"gateway": main_pid("bench-gateway.service"),
                   "router": main_pid("bench-router.service"),
                   "bare": main_pid("bench-bare.service")}
    streaming: dict[str, dict[str, list[float]]] = {
        t.name: {"tok_s": [], "answer_tok_s": [], "ttft": [], "gaps": [], "one_event_reads": [],
                 "cpu_us_per_event": [], "stalled_starts": []} for t in stream_targets}
    for rnd in range(plan.streams):
        for t in interleave(stream_targets, rnd):
            v = streaming[t.name]
            for attempt in range(3):
                pid = stream_pids.get(t.name)
                cpu0 = cpu_seconds(pid)
                run = await stream_once(
                    t, chat(model_for.get(t.name, "tiny-alpha"), 256, stream=True))
                if pid is not None:
                    v["cpu_us_per_event"].append(
                        (cpu_seconds(pid) - cpu0) / max(1, run.events) * 1e6)
                if run.first_read_events < STALLED_START or attempt == 2:
                    break
                v["stalled_starts"].append(1)
            v["tok_s"].append(run.tokens_per_s)
            v["answer_tok_s"].append(run.answer_tokens_per_s)
            v["ttft"].append(run.first_token_ms)
            v["gaps"].extend(run.gaps)
            v["one_event_reads"].append(min(1.0, (run.events + 1) / max(1, run.reads)))
    results["streaming"] = {name: {
        "tokens_per_s": round(statistics.median(v["tok_s"]), 1),
        "answer_tokens_per_s": round(statistics.median(v["answer_tok_s"]), 1),
        "first_token_ms": round(statistics.median(v["ttft"]), 3),
        "gap_p50_ms": round(pct(sorted(v["gaps"]), 50), 3),
        "gap_p99_ms": round(pct(sorted(v["gaps"]), 99), 3),
        "events_per_read": round(statistics.median(v["one_event_reads"]), 3),
        **({"cpu_us_per_event": round(statistics.median(v["cpu_us_per_event"]), 1)}
           if v["cpu_us_per_event"] else {}),
        "stalled_starts_rerun": len(v["stalled_starts"])}
        for name, v in streaming.items()}
    results["streaming_gaps"] = {name: v["gaps"] for name, v in streaming.items()}
    rate = {name: v["tokens_per_s"] for name, v in results["streaming"].items()}
    # each proxy's tokens/s over its own engine's, read directly (the router's child is
    # another llama-server process than the gateway's engine)
    results["streaming_hop"] = {"gateway": round(rate["gateway"] / rate["direct"], 3),
                                "router": round(rate["router"] / rate["router_engine"], 3),
                                "bare": round(rate["bare"] / rate["direct"], 3)}

    # 4. cold start and swap (gateway: max_engines=2; router: --models-max 2)
    results["cold_swap"] = await cold_and_swap(plan)

    # 5. footprint
    results["footprint"] = await footprint(plan, fake_cfg, fake_socket)

    # 6. a long prompt again after its engine was stopped: KV cache restored, or cold
    results["kv_restore"] = await kv_restore(plan)
    cleanup()   # the sections after this one start their own units


LONG_PROMPT = " ".join(f"word{i % 97} and more" for i in range(300))


async def kv_restore(plan: Plan) -> dict[str, Any]:
    """Per model: stop (the gateway saves its KV cache, or not), start (restores it, or
    not), then the same long prompt; the start and the first byte are timed apart."""
    gw = Target("gateway", "http://127.0.0.1:18600")
    figures: dict[str, dict[str, list[float]]] = {}
    for label, model in (("restored", "tiny-beta"), ("cold", "tiny-cold")):
        times = figures.setdefault(label, {"start_ms": [], "first_byte_ms": []})
        await first_byte_ms(gw, model, prompt=LONG_PROMPT)   # the prompt is in its cache
        for _ in range(plan.starts):
            status, body = await post_json(gw.base + "/admin/engines/stop", {"model": model})
            assert status == 200, body
            t0 = time.perf_counter()
            status, body = await post_json(gw.base + "/admin/engines/start", {"model": model})
            assert status == 200, body
            times["start_ms"].append((time.perf_counter() - t0) * 1000)
            times["first_byte_ms"].append(await first_byte_ms(gw, model, prompt=LONG_PROMPT))
        await post_json(gw.base + "/admin/engines/stop", {"model": model})
    return {label: {key: round(statistics.median(v), 2) for key, v in times.items()}
            for label, times in figures.items()}


async def router_model_id(stem: str, base: str = "http://127.0.0.1:18601") -> str:
    """The id the router (at base) lists for the model file named stem."""
    async with aiohttp.ClientSession() as s, s.get(base + "/v1/models") as r:
        data = await r.json()
    for m in data.get("data", []):
        if stem in m["id"]:
            return str(m["id"])
    raise RuntimeError(f"router does not list {stem}: {data}")


def children(parent: int) -> list[tuple[int, list[str]]]:
    """parent's child processes: (pid, argv) each, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent:
            found.append((int(entry.name), argv))
    return found


async def router_child_base(model_id: str) -> str:
    """The address of the router's child serving model_id (a llama-server on a loopback
    port the router chose), read off the child's command line."""
    for _, argv in children(main_pid("bench-router.service")):
        if "--port" in argv and model_id in argv:
            return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    raise RuntimeError(f"no child of the router serves {model_id}")


async def first_byte_ms(target: Target, model: str, prompt: str = "hi") -> float:
    async with target.session() as session:
        t0 = time.perf_counter()
        async with session.post(target.base + CHAT, json=chat(model, prompt=prompt)) as resp:
            await resp.content.readany()
            took = (time.perf_counter() - t0) * 1000
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{target.name}: HTTP {resp.status}")
            return took


class EngineEvents:
    """The gateway's /admin/events, followed: each engine state change with its stamp."""

    def __init__(self, base: str) -> None:
        self._base = base
        self.seen: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._following = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._follow())
        await asyncio.wait_for(self._following.wait(), 10)

    async def _follow(self) -> None:
        async with aiohttp.ClientSession() as session, \
                session.get(self._base + "/admin/events") as resp:
            async for line in resp.content:
                if line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if event.get("type") == "snapshot":
                        self._following.set()
                    elif event.get("type") == "engine":
                        self.seen.append(event)

    async def start_phases(self, model: str, since: float) -> tuple[float, float] | None:
        """When model's engine went loading and then ready, after since (the events
        come a moment after the answer's head: wait a little for them)."""
        for _ in range(100):
            loading = [e["ts"] for e in self.seen if e["model"] == model
                       and e["state"] == "loading" and e["ts"] >= since]
            ready = [e["ts"] for e in self.seen if e["model"] == model
                     and e["state"] == "ready" and e["ts"] >= since]
            if loading and ready:
                return loading[0], ready[0]
            await asyncio.sleep(0.01)
        return None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def cold_and_swap(plan: Plan) -> dict[str, Any]:
    gw = Target("gateway", "http://127.0.0.1:18600")
    router = Target("router", "http://127.0.0.1:18601")
    ids = {stem: await router_model_id(stem) for stem in ("tiny-alpha", "tiny-beta",
                                                          "tiny-gamma")}
    cold: dict[str, list[float]] = {"gateway": [], "router": []}
    # the same weights with no KV cache kept (the router keeps none): what the start costs
    # without the restore of the KV cache the previous engine saved
    no_kv: list[float] = []
    for _ in range(plan.starts):
        await post_json(gw.base + "/admin/engines/stop", {"model": "tiny-cold"})
        await asyncio.sleep(0.2)
        no_kv.append(await first_byte_ms(gw, "tiny-cold"))
    for _ in range(plan.starts):
        # both idle 0.2 s after the stop: the router's unload is asynchronous, and the
        # gateway parks the stopped engine's unit meanwhile (its next start is a wake)
        await post_json(gw.base + "/admin/engines/stop", {"model": "tiny-beta"})
        await asyncio.sleep(0.2)
        cold["gateway"].append(await first_byte_ms(gw, "tiny-beta"))
        await post_json(router.base + "/models/unload", {"model": ids["tiny-beta"]})
        await asyncio.sleep(0.2)
        cold["router"].append(await first_byte_ms(router, ids["tiny-beta"]))
    # the gateway's own account of each start (its engine events, stamped as they
    # happen): the request to the wake, the wake to ready, ready to the first byte. Starts
    # of their own: a follower of the events costs the gateway CPU at every start (the
    # events written to it, on the cores the loading engine needs), which the router's
    # starts above are not charged
    events = EngineEvents(gw.base)
    await events.start()
    phases: dict[str, list[float]] = {"to_loading": [], "loading_to_ready": [],
                                      "ready_to_first_byte": []}
    for _ in range(plan.starts):
        await post_json(gw.base + "/admin/engines/stop", {"model": "tiny-beta"})
        await asyncio.sleep(0.2)
        sent = time.time()
        took = await first_byte_ms(gw, "tiny-beta")
        if (at := await events.start_phases("tiny-beta", sent)) is not None:
            loading, ready = at
            phases["to_loading"].append((loading - sent) * 1000)
            phases["loading_to_ready"].append((ready - loading) * 1000)
            phases["ready_to_first_byte"].append(took - (ready - sent) * 1000)
    # each engine's own load (its log's "model loaded", from its process start): what
    # of a cold start is the engine's, and what the proxy adds. The gateway's of the
    # measured starts, not of the followed ones after them
    loads = {"gateway": engine_loads_ms("llm-engine-tiny\\x2dbeta.service",
                                        "tiny-beta")[-2 * plan.starts:-plan.starts],
             "router": engine_loads_ms("bench-router.service", "tiny-beta")[-plan.starts:]}
    await events.stop()
    swap: dict[str, list[float]] = {"gateway": [], "router": []}
    order = ["tiny-gamma", "tiny-alpha", "tiny-beta"]   # with 2 places, each evicts one
    for _ in range(plan.cycles):
        for stem in order:
            swap["gateway"].append(await first_byte_ms(gw, stem))
            swap["router"].append(await first_byte_ms(router, ids[stem]))
    return {"cold_first_byte_ms": {k: round(statistics.median(v), 2) for k, v in cold.items()},
            "cold_no_kv_cache_first_byte_ms": round(statistics.median(no_kv), 2),
            "cold_engine_load_ms": {k: round(statistics.median(v), 2)
                                    for k, v in loads.items() if v},
            "cold_gateway_phases_ms": {k: round(statistics.median(v), 2)
                                       for k, v in phases.items() if v},
            "swap_first_byte_ms": {k: round(statistics.median(v), 2) for k, v in swap.items()},
            "swap_p99_ms": {k: round(pct(sorted(v), 99), 2) for k, v in swap.items()}}


LOADED = re.compile(r"^(?:\[(\d+)\] )?(\d+)\.(\d+)\.(\d+)\.(\d+) I srv +llama_server: model loaded")
SPAWNED = re.compile(r"spawning server instance with name=(\S+) on port (\d+)")


def engine_loads_ms(unit: str, model: str) -> list[float]:
    """The load times of model's engines in unit's journal, from llama-server's own log
    stamps (minutes.seconds.ms.us since its process started). The router's children's
    lines come prefixed with their port, named by the router's "spawning" line."""
    subprocess.run(["journalctl", "--sync"], check=False)
    lines = subprocess.run(["journalctl", "-u", unit, "-o", "cat", "--no-pager"],
                           capture_output=True, text=True, check=False).stdout.splitlines()
    port_model: dict[str, str] = {}
    loads = []
    for line in lines:
        if spawned := SPAWNED.search(line):
            port_model[spawned.group(2)] = spawned.group(1)
        elif (loaded := LOADED.search(line)) and (
                loaded.group(1) is None or port_model.get(loaded.group(1)) == model):
            m, sec, ms, us = (int(g) for g in loaded.groups()[1:])
            loads.append(m * 60_000 + sec * 1000 + ms + us / 1000)
    return loads


async def footprint(plan: Plan, fake_cfg: Path, fake_socket: str) -> dict[str, Any]:
    pid = main_pid("bench-gateway-fake.service")
    idle = rss_mib(pid)
    peak = idle
    target = Target("gateway", "http://127.0.0.1:18610")
    body = chat("fake", max_tokens=40, stream=True, prompt="slow 100")   # ~4 s each
    async with target.session(limit=0) as session:
        async def one() -> None:
            async with session.post(target.base + CHAT, json=body) as resp:
                await resp.read()
        tasks = [asyncio.ensure_future(one()) for _ in range(plan.open_streams)]
        while not all(t.done() for t in tasks):
            peak = max(peak, rss_mib(pid))
            await asyncio.sleep(0.2)
        errors = sum(1 for t in tasks if t.exception() is not None)
    # socket activation to the first answer: the gateway's, and a bare aiohttp proxy's
    # (Python, aiohttp and uvloop imported, an app built: the floor on this machine),
    # alternating
    activation: dict[str, list[float]] = {"gateway": [], "bare": []}
    paths = {"gateway": ([PY, "-m", "gatewayd", "--config", str(fake_cfg), "serve"],
                         "Type=notify", "/health"),
             "bare": ([PY, "-m", "bench.bare_proxy", "--socket", fake_socket],
                      "Type=simple", "/bare/retries")}
    for i in range(plan.activations):
        for j, name in enumerate(("gateway", "bare") if i % 2 == 0 else ("bare", "gateway")):
            argv, service_type, path = paths[name]
            unit, port = f"bench-sa{i}-{name}", 18620 + 2 * i + j
            Path(f"/run/systemd/system/{unit}.socket").write_text(
                f"[Socket]\nListenStream=127.0.0.1:{port}\n")
            Path(f"/run/systemd/system/{unit}.service").write_text(
                f"[Unit]\nRequires={unit}.socket\n[Service]\n{service_type}\n"
                f"WorkingDirectory={REPO}\nExecStart={' '.join(argv)}\n")
            sh("systemctl", "daemon-reload")
            sh("systemctl", "start", f"{unit}.socket")
            t0 = time.perf_counter()
            async with aiohttp.ClientSession() as s, \
                    s.get(f"http://127.0.0.1:{port}{path}") as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{name}'s socket activation: HTTP {resp.status}")
            activation[name].append((time.perf_counter() - t0) * 1000)
            sh("systemctl", "stop", f"{unit}.socket", f"{unit}.service")
    return {"rss_idle_mib": round(idle, 1), "rss_peak_open_streams_mib": round(peak, 1),
            "open_streams": plan.open_streams, "open_stream_errors": errors,
            "socket_activation_to_first_answer_ms": round(
                statistics.median(activation["gateway"]), 1),
            "socket_activation_samples_ms": [round(a, 1) for a in activation["gateway"]],
            "bare_socket_activation_to_first_answer_ms": round(
                statistics.median(activation["bare"]), 1),
            "bare_socket_activation_samples_ms": [round(a, 1) for a in activation["bare"]]}


def write_config(path: Path, models: Path, llama: str, state: Path, port: int,
                 extra: str = "") -> Path:
    path.write_text(f'models_dir = "{models}"\nllama_server = "{llama}"\n'
                    f'state_dir = "{state}"\nmax_engines = 2\n[listen]\nport = {port}\n'
                    '[admin]\npublic = true\n' + extra)
    return path


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0]}


def cleanup() -> None:
    units = sh("systemctl", "list-units", "--plain", "--no-legend", "--all", "bench-*",
               "llm-engine-*").splitlines()
    names = [u.split()[0] for u in units if u.strip()]
    if names:
        subprocess.run(["systemctl", "stop", *names], check=False)


def say_why_it_failed() -> None:
    """A failed run says which path and why: the last lines of each benchmarked
    service's journal (a proxy's 500 is a traceback there), before cleanup removes them."""
    subprocess.run(["journalctl", "--sync"], check=False)
    for unit in ("bench-bare", "bench-gateway", "bench-router", "bench-bare-fake",
                 "bench-gateway-fake"):
        out = subprocess.run(["journalctl", "-u", unit, "-n", "40", "-o", "cat", "--no-pager"],
                             capture_output=True, text=True, check=False).stdout
        if out.strip():
            print(f"--- journalctl -u {unit} (last 40 lines) ---\n{out}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.suite")
    ap.add_argument("--mode", choices=sorted(PLANS), default="full")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--work", type=Path, default=Path("/srv/llm-gateway-bench"),
                    help="models and state; not under /tmp or /var/tmp, which engines "
                         "see privately")
    ap.add_argument("--model", action="append", default=[], metavar="PRESET=PATH",
                    help="a generated model of realistic size (scripts/get_model.sh PRESET)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run, of {', '.join(SECTIONS)}")
    ap.add_argument("--mixed-seconds", type=float, metavar="S",
                    help="each system's window per mix in the mixed section (full: "
                         f"{PLANS['full'].mixed_seconds:g}, smoke: "
                         f"{PLANS['smoke'].mixed_seconds:g})")
    ap.add_argument("--mixed-systems", metavar="S,S",
                    help="the systems the mixed section runs, of grouped, fifo, router "
                         "(default: all three)")
    ap.add_argument("--batch-seconds", type=float, metavar="S",
                    help="each interactive window in the batch section (full: "
                         f"{PLANS['full'].batch_seconds:g}, smoke: "
                         f"{PLANS['smoke'].batch_seconds:g})")
    a = ap.parse_args(argv)
    plan = PLANS[a.mode]
    if a.batch_seconds is not None:
        if not a.batch_seconds > 0:
            ap.error("--batch-seconds: a number of seconds above 0")
        plan = dataclasses.replace(plan, batch_seconds=a.batch_seconds)
    if a.mixed_systems is not None:
        systems = tuple(x for x in a.mixed_systems.split(",") if x)
        if not systems or set(systems) - set(plan.mixed_systems):
            ap.error(f"--mixed-systems: of {', '.join(plan.mixed_systems)}")
        plan = dataclasses.replace(plan, mixed_systems=systems)
    if a.mixed_seconds is not None:
        if not a.mixed_seconds > 0:
            ap.error("--mixed-seconds: a number of seconds above 0")
        plan = dataclasses.replace(plan, mixed_seconds=a.mixed_seconds)
    sections = [x for x in a.only.split(",") if x]
    if unknown := set(sections) - set(SECTIONS):
        ap.error(f"--only: no section {', '.join(sorted(unknown))}; sections: {SECTIONS}")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        models = {k: Path(v) for k, _, v in (m.partition("=") for m in a.model)}
        results = asyncio.run(suite(plan, a.work, a.llama_server, sections, models))
    except Exception:
        say_why_it_failed()
        raise
    finally:
        # the gateways' own account of the run (their engines' transitions), for digging
        for unit, name in (("bench-gateway", "gateway-journal.txt"),
                           ("bench-mixed-*", "mixed-journal.txt")):
            with contextlib.suppress(OSError):
                (a.out / name).write_text(subprocess.run(
                    ["journalctl", "-u", unit, "-o", "short-monotonic", "--no-pager"],
                    capture_output=True, text=True, check=False).stdout)
        cleanup()
    results["seconds"] = round(time.monotonic() - t0, 1)
    from bench.report import verdicts, write_report
    results["verdicts"] = verdicts(results)   # each goal, met or not (null: not run)
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, a.out)
    print((a.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
