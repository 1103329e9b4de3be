"""The crowd section of the suite: many streams on one engine, many clients on one proxy.

1. slots: one llama-server with 4 parallel slots on the small model (SmolLM2-135M's shape),
   16 streams at once, aggregate tokens/s (all tokens of a round over its wall time),
   through the engine's own socket (direct: 16 connections), the gateway (which learns the
   4 slots from /props and opens at most 5 connections, queuing the rest itself) and
   llama.cpp's router (--parallel 4, which it passes to its child), interleaved by round.
   Each engine's connections are counted while a round runs (the engine's side of them,
   from /proc/<engine>/net/unix or /net/tcp).
2. many_clients: against the instant fake engine (so what is measured is the proxy's own
   cost), `crowd_idle` keep-alive connections opened (one small completion each) and
   held idle while `crowd_active` streams run at once, through the gateway and through the
   bare aiohttp proxy: each proxy's RSS (before, with the idle connections, peak), its CPU
   per event the streams received, its descriptors, and the errors: a stream failed or cut
   short, an idle connection that could not be opened or no longer answers at the end.

Run by bench/suite.py (`--only crowd`); its units are bench-crowd-*, stopped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import resource
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.suite import (
    CHAT,
    PY,
    REPO,
    Plan,
    Target,
    chat,
    children,
    cpu_seconds,
    interleave,
    main_pid,
    once_more,
    pct,
    post_json,
    rss_mib,
    run_unit,
    stream_once,
    wait_http,
    write_config,
)

SLOT_PARALLEL = 4
SLOT_STREAMS = 16
# tokens per stream: a round (16 x 64 tokens on 4 slots) takes a few seconds on 2 cores
SLOT_TOKENS = 64
# the many clients' streams: 40 events 100 ms apart (~4 s), as the suite's footprint; the
# client reads 256 x 10 events/s with room to spare on the cores the proxy shares
CROWD_TOKENS = 40
CROWD_PROMPT = "slow 100"
# how many idle connections are opened (and checked at the end) at once
IDLE_OPENING = 64

GATEWAY_PORT = 18640
ROUTER_PORT = 18641
FAKE_GATEWAY_PORT = 18642
BARE_PORT = 18643
UNITS = "bench-crowd-*"


async def section(plan: Plan, work: Path, llama: str, models: dict[str, Path],
                  retried: list[dict[str, str]]) -> dict[str, Any]:
    raise_fd_limit()   # the client holds crowd_idle + crowd_active connections
    base = work / "crowd"
    base.mkdir(parents=True, exist_ok=True)
    engine_units: list[str] = []
    try:
        slots = await parallel_slots(plan, base, llama, models["small"], retried, engine_units)
    finally:
        stop_units(engine_units)
    engine_units.clear()
    try:
        many = await many_clients(plan, base, retried, engine_units)
    finally:
        stop_units(engine_units)
    return {"slots": slots, "many_clients": many}


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def stop_units(engine_units: list[str], units: str = UNITS) -> None:
    """This section's units (units: their pattern): its proxies and router, then the
    engines its gateways ran (left running by a stopped gateway, for the next one to
    adopt)."""
    listed = subprocess.run(["systemctl", "list-units", "--plain", "--no-legend", "--all",
                             units], capture_output=True, text=True, check=False).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    if names:
        subprocess.run(["systemctl", "stop", *names], check=False)
    if engine_units:
        subprocess.run(["systemctl", "stop", *engine_units], check=False)


async def start_engine(gateway: str, model: str, engine_units: list[str]) -> dict[str, Any]:
    status, body = await post_json(gateway + "/admin/engines/start", {"model": model})
    if status != 200:
        raise RuntimeError(f"the gateway did not start {model}: HTTP {status}: {body}")
    engine: dict[str, Any] = body["engine"]
    if engine.get("unit"):
        engine_units.append(engine["unit"])
    return engine


# -- 1. parallel slots -------------------------------------------------------------------


def unix_connections(pid: int, path: str) -> int:
    """Connections accepted on the unix socket at path by process pid (an accepted socket
    carries its listener's path; St 03: connected), read in pid's network namespace."""
    count = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 8 and cols[5] == "03" and cols[7] == path:
                count += 1
    return count


def tcp_connections(pid: int, port: int) -> int:
    """Established connections to the local TCP port, in pid's network namespace."""
    count = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "01" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


@dataclass
class RouterChild:
    pid: int
    port: int
    argv: list[str]


def router_child(router_pid: int) -> RouterChild:
    for pid, argv in children(router_pid):
        if "--port" in argv:
            return RouterChild(pid, int(argv[argv.index("--port") + 1]), [a for a in argv if a])
    raise RuntimeError(f"the router ({router_pid}) has no child serving yet")


async def get_json(target: Target, path: str) -> Any:
    async with target.session() as s, s.get(target.base + path) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{target.name}: GET {path}: HTTP {resp.status}")
        return await resp.json(content_type=None)


@dataclass
class Counted:
    """The most connections an engine held at once while a round ran, sampled."""
    count: Callable[[], int]
    peak: int = 0
    _task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.count())
            await asyncio.sleep(0.05)

    def __enter__(self) -> Counted:
        self._task = asyncio.ensure_future(self._sample())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


@dataclass
class SlotRound:
    tokens_per_s: float
    wall_s: float
    connections_max: int
    first_token_ms: list[float]


async def slot_round(target: Target, model: str, count: Callable[[], int]) -> SlotRound:
    """SLOT_STREAMS streams at once, each on its own connection; every one must run to
    SLOT_TOKENS tokens (the generated model never ends an answer early)."""
    bodies = [chat(model, SLOT_TOKENS, stream=True, prompt=f"stream {i}: tell a story")
              for i in range(SLOT_STREAMS)]
    with Counted(count) as counted:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(stream_once(target, b) for b in bodies))
        wall = time.perf_counter() - t0
    short = [r.events for r in runs if r.events != SLOT_TOKENS]
    if short:
        raise RuntimeError(f"{target.name}: {len(short)} of {SLOT_STREAMS} streams did not "
                           f"bring {SLOT_TOKENS} tokens: {short}")
    return SlotRound(tokens_per_s=sum(r.events for r in runs) / wall, wall_s=wall,
                     connections_max=counted.peak,
                     first_token_ms=[r.first_token_ms for r in runs])


async def parallel_slots(plan: Plan, base: Path, llama: str, small: Path,
                         retried: list[dict[str, str]], engine_units: list[str]
                         ) -> dict[str, Any]:
    empty = base / "models"   # the gateway's model is configured, not found
    empty.mkdir(exist_ok=True)
    router_models = base / "router-models"
    router_models.mkdir(exist_ok=True)
    link = router_models / "small.gguf"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(small)
    parallel = ["--parallel", str(SLOT_PARALLEL)]
    cfg = write_config(base / "gw.toml", empty, llama, base / "gw-state", GATEWAY_PORT,
                       extra=f'[models.small]\npath = "{small}"\nargs = {json.dumps(parallel)}\n'
                             "kv_cache_save = false\n")
    run_unit("bench-crowd-gateway", [PY, "-m", "gatewayd", "--config", str(cfg), "serve"],
             notify=True)
    run_unit("bench-crowd-router", [llama, "--models-dir", str(router_models),
                                    "--models-max", "1", *parallel,
                                    "--host", "127.0.0.1", "--port", str(ROUTER_PORT)])
    gateway = Target("gateway", f"http://127.0.0.1:{GATEWAY_PORT}")
    router = Target("router", f"http://127.0.0.1:{ROUTER_PORT}")
    await wait_http(router.base + "/health")
    engine = await start_engine(gateway.base, "small", engine_units)
    direct = Target("direct", "http://engine", engine["socket"])
    models = await get_json(router, "/v1/models")
    router_id = next(str(m["id"]) for m in models["data"] if "small" in m["id"])
    model_for = {"direct": "small", "gateway": "small", "router": router_id}
    targets = [direct, gateway, router]
    for t in targets:   # warm every path (the router starts its child here)
        await stream_once(t, chat(model_for[t.name], 8, stream=True))
    for t in targets:   # and every slot, once on each path: the first round is not charged
        await slot_round(t, model_for[t.name], lambda: 0)   # the first use of their memory
    child = router_child(main_pid("bench-crowd-router.service"))
    child_target = Target("router_child", f"http://127.0.0.1:{child.port}")
    slots = {"gateway_engine": (await get_json(direct, "/props")).get("total_slots"),
             "router_child": (await get_json(child_target, "/props")).get("total_slots")}
    if slots != {"gateway_engine": SLOT_PARALLEL, "router_child": SLOT_PARALLEL}:
        raise RuntimeError(f"parallel slots: {slots}, not {SLOT_PARALLEL} each "
                           f"(the router's child: {' '.join(child.argv)})")
    engine_pid = int(engine["pid"])
    counters: dict[str, Callable[[], int]] = {
        "direct": lambda: unix_connections(engine_pid, direct.socket or ""),
        "gateway": lambda: unix_connections(engine_pid, direct.socket or ""),
        "router": lambda: tcp_connections(child.pid, child.port)}
    rounds: dict[str, list[SlotRound]] = {t.name: [] for t in targets}
    for rnd in range(plan.slot_rounds):
        for t in interleave(targets, rnd):
            rounds[t.name].append(await once_more(
                retried, f"crowd slots: {t.name}, round {rnd + 1}",
                functools.partial(slot_round, t, model_for[t.name], counters[t.name])))
    rate = {name: round(statistics.median(r.tokens_per_s for r in rs), 1)
            for name, rs in rounds.items()}
    first = {name: sorted(ms for r in rs for ms in r.first_token_ms)
             for name, rs in rounds.items()}
    conns = {name: max(r.connections_max for r in rs) for name, rs in rounds.items()}
    return {
        "parallel": SLOT_PARALLEL, "streams": SLOT_STREAMS, "tokens_per_stream": SLOT_TOKENS,
        "rounds": plan.slot_rounds,
        "tokens_per_s": rate,
        "tokens_per_s_rounds": {name: [round(r.tokens_per_s, 1) for r in rs]
                                for name, rs in rounds.items()},
        "gateway_over_direct": round(rate["gateway"] / rate["direct"], 3),
        "gateway_over_router": round(rate["gateway"] / rate["router"], 3),
        "round_wall_s": {name: round(statistics.median(r.wall_s for r in rs), 2)
                         for name, rs in rounds.items()},
        # the first token of each stream: the later ones wait for a slot, on every path
        "first_token_ms_p50": {name: round(pct(v, 50), 1) for name, v in first.items()},
        "first_token_ms_max": {name: round(v[-1], 1) for name, v in first.items()},
        # on the engine's side: direct opens one per stream, the gateway at most slots + 1;
        # both counts may hold the gateway's own /health probe (one, every 5 s)
        "engine_connections_max": conns,
        "gateway_engine_connections_max": conns["gateway"],
        "total_slots": slots,
        "router_child_args": " ".join(child.argv[1:]),
    }


# -- 2. many clients ---------------------------------------------------------------------


class IdleConnection:
    """A keep-alive connection of its own, spoken to in raw HTTP/1.1: one small completion
    to open it, then left idle (aiohttp's pool would close it after 15 s idle)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, request: bytes) -> IdleConnection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conn = cls(reader, writer)
        try:
            await conn.ask(request)
        except BaseException:
            writer.close()
            raise
        return conn

    async def ask(self, request: bytes) -> None:
        """Send request and read its whole answer; anything but a 200 raises."""
        self.writer.write(request)
        async with asyncio.timeout(30):
            head = await self.reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)}
            body = b""
            if b"content-length" in headers:
                body = await self.reader.readexactly(int(headers[b"content-length"]))
            elif headers.get(b"transfer-encoding") == b"chunked":
                while size := int((await self.reader.readuntil(b"\r\n")).strip(), 16):
                    body += (await self.reader.readexactly(size + 2))[:-2]
                await self.reader.readuntil(b"\r\n")
            else:
                raise RuntimeError("an answer with no length on a keep-alive connection")
            if status != 200 or headers.get(b"connection", b"").lower() == b"close":
                raise RuntimeError(f"HTTP {status}, connection: {headers.get(b'connection')!r}"
                                   f": {body[:200]!r}")

    def close(self) -> None:
        self.writer.close()


def completion_request(port: int) -> bytes:
    body = json.dumps(chat("fake", 1)).encode()
    return (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


async def bounded(n: int, each: Callable[[int], Awaitable[Any]]) -> list[Any]:
    """each(i) for i < n, IDLE_OPENING at a time; results and exceptions, in order."""
    gate = asyncio.Semaphore(IDLE_OPENING)

    async def one(i: int) -> Any:
        async with gate:
            return await each(i)
    return await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)


@dataclass
class Peaks:
    """A process's peak RSS and descriptors, sampled every 0.1 s."""
    pid: int
    rss_mib: float = 0.0
    fds: int = 0
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    def sample(self) -> None:
        self.rss_mib = max(self.rss_mib, rss_mib(self.pid))
        with contextlib.suppress(OSError):
            self.fds = max(self.fds, len(os.listdir(f"/proc/{self.pid}/fd")))

    async def _follow(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(0.1)

    def __enter__(self) -> Peaks:
        self._task = asyncio.ensure_future(self._follow())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sample()


@dataclass
class CrowdRound:
    rss_idle_mib: float        # before this round's connections
    rss_with_idle_mib: float   # with the idle connections held, before the streams
    rss_peak_mib: float
    rss_after_mib: float       # a second after the round's connections closed
    fds_peak: int
    events: int
    cpu_us_per_event: float
    streams_wall_s: float
    errors: dict[str, int]


async def crowd_round(target: Target, port: int, pid: int, plan: Plan) -> CrowdRound:
    request = completion_request(port)
    rss_idle = rss_mib(pid)
    with Peaks(pid) as peaks:
        opened = await bounded(plan.crowd_idle,
                               lambda _: IdleConnection.open(port, request))
        idle = [c for c in opened if isinstance(c, IdleConnection)]
        first_error = next((c for c in opened if isinstance(c, BaseException)), None)
        try:
            rss_with_idle = rss_mib(pid)
            body = chat("fake", CROWD_TOKENS, stream=True, prompt=CROWD_PROMPT)
            async with target.session(limit=0) as session:
                async def stream() -> int:
                    async with session.post(target.base + CHAT, json=body) as resp:
                        data = await resp.read()
                    if resp.status != 200 or b"data: [DONE]" not in data:
                        raise RuntimeError(f"HTTP {resp.status}: {data[-200:]!r}")
                    return data.count(b"data: ")
                cpu0 = cpu_seconds(pid)
                t0 = time.perf_counter()
                streams = await asyncio.gather(*(stream() for _ in range(plan.crowd_active)),
                                               return_exceptions=True)
                wall = time.perf_counter() - t0
                cpu = cpu_seconds(pid) - cpu0
            # the idle connections, held all along, must still answer
            again = await bounded(len(idle), lambda i: idle[i].ask(request))
        finally:
            for conn in idle:
                conn.close()
    await asyncio.sleep(1)
    rss_after = rss_mib(pid)
    events = sum(s for s in streams if isinstance(s, int))
    # a stream cut short (fewer events than the others) counts as failed too
    expected = max((s for s in streams if isinstance(s, int)), default=0)
    errors = {"streams": sum(1 for s in streams if not isinstance(s, int) or s < expected),
              "idle_not_opened": len(opened) - len(idle),
              "idle_lost": sum(1 for a in again if isinstance(a, BaseException))}
    if first_error is None:
        first_error = next((s for s in [*streams, *again] if isinstance(s, BaseException)),
                           None)
    if first_error is not None:
        print(f"bench: crowd, {target.name}: {errors}; the first: "
              f"{type(first_error).__name__}: {first_error}", flush=True)
    return CrowdRound(rss_idle_mib=rss_idle, rss_with_idle_mib=rss_with_idle,
                      rss_peak_mib=peaks.rss_mib, rss_after_mib=rss_after,
                      fds_peak=peaks.fds, events=events,
                      cpu_us_per_event=cpu / max(1, events) * 1e6, streams_wall_s=wall,
                      errors=errors)


async def many_clients(plan: Plan, base: Path, retried: list[dict[str, str]],
                       engine_units: list[str]) -> dict[str, Any]:
    fake_models = base / "fake-models"   # empty: the fake is configured, with its slots
    fake_models.mkdir(exist_ok=True)
    fake_file = base / "fake.gguf"
    fake_file.write_bytes(b"GGUF")
    # the fake says it takes every stream at once (its /props): neither proxy queues any
    cfg = write_config(base / "fake.toml", fake_models, str(REPO / "bench/fake-llama-server"),
                       base / "fake-state", FAKE_GATEWAY_PORT,
                       extra=f'[models.fake]\npath = "{fake_file}"\n'
                             f'args = ["--parallel", "{plan.crowd_active}"]\n'
                             "kv_cache_save = false\n")
    run_unit("bench-crowd-gateway-fake", [PY, "-m", "gatewayd", "--config", str(cfg), "serve"],
             notify=True)
    gateway = Target("gateway", f"http://127.0.0.1:{FAKE_GATEWAY_PORT}")
    engine = await start_engine(gateway.base, "fake", engine_units)
    # the gateway raises its own descriptor limit (gatewayd/app.py); the bare proxy is given
    # as many by its unit
    run_unit("bench-crowd-bare", [PY, "-m", "bench.bare_proxy", "--socket", engine["socket"],
                                  "--port", str(BARE_PORT)],
             properties=["LimitNOFILE=524288"])
    bare = Target("bare", f"http://127.0.0.1:{BARE_PORT}")
    await wait_http(bare.base + "/health")
    ports = {"gateway": FAKE_GATEWAY_PORT, "bare": BARE_PORT}
    pids = {"gateway": main_pid("bench-crowd-gateway-fake.service"),
            "bare": main_pid("bench-crowd-bare.service")}
    for t in (gateway, bare):   # warm both paths
        async with t.session() as s:
            for stream in (False, True):
                async with s.post(t.base + CHAT, json=chat("fake", 4, stream=stream)) as r:
                    await r.read()
    # rounds: each opens crowd_idle connections and runs crowd_active streams, ~10 s
    rounds: dict[str, list[CrowdRound]] = {"gateway": [], "bare": []}
    for rnd in range(min(plan.rounds, 3)):
        for t in interleave([gateway, bare], rnd):
            rounds[t.name].append(await once_more(
                retried, f"crowd many clients: {t.name}, round {rnd + 1}",
                functools.partial(crowd_round, t, ports[t.name], pids[t.name], plan)))
    return {
        "active_streams": plan.crowd_active, "idle_connections": plan.crowd_idle,
        "events_per_stream": CROWD_TOKENS + 3,   # the role, the tokens, the end, [DONE]
        "rounds": len(rounds["gateway"]),
        "rss_mib": {name: round(max(r.rss_peak_mib for r in rs), 1)
                    for name, rs in rounds.items()},
        "rss_idle_mib": {name: round(rs[0].rss_idle_mib, 1) for name, rs in rounds.items()},
        "rss_with_idle_connections_mib": {name: round(max(r.rss_with_idle_mib for r in rs), 1)
                                          for name, rs in rounds.items()},
        # what holding one idle connection took, in the first round (later rounds reuse
        # what the first one's left: its memory is not given back when they close)
        "rss_kib_per_idle_connection": {
            name: round((rs[0].rss_with_idle_mib - rs[0].rss_idle_mib) * 1024
                        / plan.crowd_idle, 1) for name, rs in rounds.items()},
        # per round: before it, with the idle connections, peak, after they closed
        "rss_rounds_mib": {name: [[round(x, 1) for x in (r.rss_idle_mib, r.rss_with_idle_mib,
                                                         r.rss_peak_mib, r.rss_after_mib)]
                                  for r in rs] for name, rs in rounds.items()},
        "cpu_us_per_event": {name: round(statistics.median(r.cpu_us_per_event for r in rs), 1)
                             for name, rs in rounds.items()},
        "cpu_us_per_event_rounds": {name: [round(r.cpu_us_per_event, 1) for r in rs]
                                    for name, rs in rounds.items()},
        "events": {name: [r.events for r in rs] for name, rs in rounds.items()},
        "streams_wall_s": {name: round(statistics.median(r.streams_wall_s for r in rs), 2)
                           for name, rs in rounds.items()},
        "fds_peak": {name: max(r.fds_peak for r in rs) for name, rs in rounds.items()},
        "errors": {name: sum(sum(r.errors.values()) for r in rs)
                   for name, rs in rounds.items()},
        "errors_by_kind": {name: {k: sum(r.errors[k] for r in rs) for k in rs[0].errors}
                           for name, rs in rounds.items()},
    }
