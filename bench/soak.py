"""A soak of the scheduler under sustained load, against a real gateway in a real systemd.

`bench/soak` (the host side) boots the project's throwaway systemd container
(tests/harness), and runs this module's driver inside it as a transient service
(`systemd-container.sh run`, i.e. `systemd-run --pipe --wait`): the container has a
private network, so the clients, the sampler and the gateway all meet on its 127.0.0.1.

Inside, the driver generates N tiny models, starts the gateway socket-activated with
`max_engines = SLOTS` (mode `transient`: a `systemd-run --socket-property=ListenStream=`
socket + Type=notify service running as root, engines as transient units; mode
`template`: the .deb installed, `llm-gateway.socket` + `llm-gateway.service` running as
`llm-gateway`, engines as `llm-engine@` instances), then:

- C clients loop, each asking a random model of the N for max_tokens=4 chat completions;
  a share D of them stream and drop the connection after the first event ("dropped":
  expected, not an error). Loops stop by themselves after the warm-up + T seconds.
- a sampler asks systemd once a second which `llm-engine*` units are active or
  activating (must be <= SLOTS) and compares each unit's ActiveState with the gateway's
  own view (GET /admin/engines); a disagreement that persists for two samples in a row is
  an invariant violation (a swap in progress passes through states both sides agree on).
- a follower of GET /admin/events counts engine state changes (`starting` = a swap), and
  systemd's journal counts engine unit starts and failures.
- the gateway's RSS and open fds are read from /proc/MAINPID, once after the warm-up and
  once at the end, both after the gateway went idle for a few seconds (so the pooled
  keep-alive connections to the engines, which llama-server closes after 5 s, are gone).

Exit status 0 when there were no errors and no violations and RSS/fds stayed within
+-10 % (fds: or +-3), else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"
MODES = ("transient", "template")
TRANSIENT_PORT = 18900
TEMPLATE_PORT = 8080                      # packaging/units/llm-gateway.socket
TRANSIENT_UNIT = "soak-gw.service"
TEMPLATE_UNIT = "llm-gateway.service"
ENGINE_GLOB = "llm-engine*"
# systemd's catalog message ids (sd-messages.h): a unit finished starting, a unit failed
MSG_UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"
MSG_UNIT_FAILED = "d9b373ed55a64feb8242e02dbe79a49c"
# The gateway's engine state vs the unit's ActiveState (a unit systemd does not list is
# "inactive"; a model the gateway does not list is "absent"). AGREE: fine for any time.
# PASSING: what one side shows a moment before the other catches up (a swap in progress):
# fine up to STUCK_S seconds in a row, then it is a stuck state. Any other pair is a
# disagreement, counted when the same one is seen in two samples in a row.
AGREE: dict[str, frozenset[str]] = {
    "starting": frozenset({"activating", "active"}),
    "loading": frozenset({"activating", "active"}),
    "ready": frozenset({"active"}),
    "stopping": frozenset({"active", "deactivating"}),
    "stopped": frozenset({"inactive", "failed", "parked"}),
    "failed": frozenset({"inactive", "failed", "activating"}),   # activating: auto-restart
    "absent": frozenset({"inactive", "failed", "parked"}),
}
PASSING: dict[str, frozenset[str]] = {
    "starting": frozenset({"inactive", "failed", "parked"}),   # before the unit runs
    "loading": frozenset(),
    "ready": frozenset({"activating", "deactivating"}),    # crashed and restarting
    "stopping": frozenset({"inactive", "failed", "activating"}),
    "stopped": frozenset(),
    "failed": frozenset({"active", "deactivating"}),
    "absent": frozenset(),
}
STUCK_S = 10.0


# -- what the host hands the driver -----------------------------------------------------


@dataclass
class Spec:
    mode: str = "transient"
    models: int = 3
    slots: int = 2
    concurrency: int = 16
    drop: float = 0.25
    duration: float = 600.0
    warmup: float = -1.0            # < 0: 10 % of duration, clamped to 3..30 s
    settle: float = 6.0
    interval: float = 1.0
    max_tokens: int = 4
    request_timeout: float = 60.0
    seed: int = 0
    llama_server: str = ""
    gateway_src: str = str(REPO)    # the gatewayd tree the gateway runs (transient mode)
    python: str = sys.executable
    deb: str = ""                   # template mode
    outdir: str = ""

    def warmup_s(self) -> float:
        return self.warmup if self.warmup >= 0 else min(30.0, max(3.0, self.duration * 0.1))


# -- inside the container: the driver ---------------------------------------------------


@dataclass
class Requests:
    ok: int = 0
    dropped: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)

    def error(self, key: str, detail: str) -> None:
        self.errors[key] += 1
        seen = self.examples.setdefault(key, [])
        if len(seen) < 3:
            seen.append(detail[:300])


@dataclass
class Sampler:
    slots: int
    samples: int = 0
    sample_errors: Counter[str] = field(default_factory=Counter)
    max_active: int = 0
    max_active_units: list[str] = field(default_factory=list)
    over_slots: list[dict[str, Any]] = field(default_factory=list)
    disagreements: list[dict[str, Any]] = field(default_factory=list)
    unknown_states: set[str] = field(default_factory=set)
    interval: float = 1.0
    _streak: dict[tuple[str, str, str], int] = field(default_factory=dict)
    _reported: set[tuple[str, str, str]] = field(default_factory=set)

    def over(self, units: dict[str, str]) -> bool:
        """More engine units run than there are slots."""
        return sum(1 for s in units.values() if s in ("active", "activating")) > self.slots

    def observe(self, t: float, units: dict[str, str], engines: list[dict[str, Any]] | None,
                unit_prefix: str) -> None:
        """One sample: systemd's units (name -> ActiveState), the gateway's engines."""
        self.samples += 1
        running = sorted(u for u, s in units.items() if s in ("active", "activating"))
        if len(running) > self.max_active:
            self.max_active, self.max_active_units = len(running), running
        if len(running) > self.slots:
            self.over_slots.append({"t": round(t, 1), "units": running})
        if engines is None:
            self._streak = {}
            return
        seen: dict[str, tuple[str, str]] = {}       # model -> (gateway state, systemd state)
        for engine in engines:
            unit = str(engine.get("unit") or f"{unit_prefix}{engine['model']}.service")
            seen[engine["model"]] = (str(engine["state"]), units.get(unit, "inactive"))
        listed = {str(e.get("unit")) for e in engines}
        for unit, state in units.items():
            if unit not in listed:
                seen.setdefault(model_of(unit), ("absent", state))
        stuck_after = max(2, round(STUCK_S / self.interval))
        streak: dict[tuple[str, str, str], int] = {}
        for model, (gw, sd) in seen.items():
            if gw not in AGREE:
                self.unknown_states.add(gw)
                continue
            if sd in AGREE[gw]:
                continue
            key = (model, gw, sd)
            streak[key] = n = self._streak.get(key, 0) + 1
            limit = stuck_after if sd in PASSING[gw] else 2
            if n >= limit and key not in self._reported:
                self._reported.add(key)
                self.disagreements.append({
                    "t": round(t, 1), "model": model, "gateway": gw, "systemd": sd,
                    "samples": n, "kind": "stuck" if sd in PASSING[gw] else "disagree"})
        self._reported &= set(streak)               # a later episode counts again
        self._streak = streak


def model_of(unit: str) -> str:
    """llm-engine-<instance>.service / llm-engine@<instance>.service -> the model id."""
    name = unit.removesuffix(".service")
    for prefix in ("llm-engine-", "llm-engine@"):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    out, i = bytearray(), 0
    while i < len(name):   # systemd-escape --unescape
        if name.startswith("\\x", i) and i + 4 <= len(name):
            out.append(int(name[i + 2:i + 4], 16))
            i += 4
        else:
            out += name[i].encode()
            i += 1
    return out.decode(errors="replace")


def error_code(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return "not_json"
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("code") or err.get("type") or "no_code")
    return "no_code"


def pct(sorted_values: Sequence[float], p: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return round(sorted_values[k], 1)


async def sh(*argv: str, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {err.decode().strip()}")
    return out.decode()


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


async def engine_units() -> dict[str, str]:
    """Engine units by name -> ActiveState, or "parked" for a unit whose main process
    still waits to be woken (the gateway's parked units: no engine, no slot). The states,
    main processes and environments of all units are read in one systemctl call, their
    processes' names right after, so a swap (a stop, then a parked unit woken) rarely
    falls between two reads."""
    out = await sh("systemctl", "list-units", "--plain", "--no-legend", "--all", ENGINE_GLOB)
    names = [line.split()[0] for line in out.splitlines()
             if line.split() and line.split()[0].endswith(".service")]
    if not names:
        return {}
    shown = await sh("systemctl", "show", "-p", "Id,ActiveState,MainPID,Environment", *names,
                     check=False)
    units: dict[str, str] = {}
    for block in shown.strip().split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        unit, state = props.get("Id"), props.get("ActiveState", "inactive")
        if not unit:
            continue
        environment = props.get("Environment", "")
        # a unit being parked is "activating" until its main process runs: with the
        # engines' sandbox (their own user, a mount namespace) that is ~0.1 s, often
        # enough for a sample to land in it; it is no engine either. Nor is a parked unit
        # being discarded (deactivating, its main process still the wait): its
        # namespace's teardown makes that moment longer too
        being_parked = state == "activating" and PARKED_ENV in environment
        units[unit] = "parked" if being_parked or (
            state in ("active", "deactivating")
            and waits_parked(props.get("MainPID", "0"), environment)) else state
    return units


# the gateway's parked units wait as the engine held by its preloaded wait (named
# llm-parked) or as a shell; gatewayd.core.engine_units says why (the soak may run
# against an installed gateway: it imports none of it)
PARKED_NAMES = frozenset({"llm-parked", "sh"})
PARK_FIFO_ENV = "LLM_GATEWAY_PARK_FIFO="
PARKED_ENV = "LLM_GATEWAY_PARKED="   # set on a parked unit (the engine unit it becomes)


def waits_parked(pid: str, environment: str) -> bool:
    """As the gateway tells it: the main process waits, or its FIFO is still there (a
    preloaded engine between its exec and its wait is named after its binary)."""
    try:
        if Path(f"/proc/{int(pid)}/comm").read_text().strip() in PARKED_NAMES:
            return True
    except (OSError, ValueError):
        return False
    fifo = next((word[len(PARK_FIFO_ENV):] for word in environment.split()
                 if word.startswith(PARK_FIFO_ENV)), None)
    return fifo is not None and os.path.exists(fifo)


def proc_resources(pid: int) -> dict[str, Any]:
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kinds[target.split(":", 1)[0] if ":[" in target else "file"] += 1
    return {"pid": pid, "rss_mib": round(rss_kib / 1024, 1), "fds": sum(kinds.values()),
            "fds_by_kind": dict(kinds)}


def main_pid(unit: str) -> int:
    return int(run("systemctl", "show", "-p", "MainPID", "--value", unit).strip() or 0)


class Clients:
    """The soak's clients: spec.concurrency loops, each asking a random one of models
    (max_tokens chat completions; a share spec.drop streamed and dropped after the first
    event), at url: one gateway, or a balancer in front of several (bench/soak_fleet.py)."""

    def __init__(self, spec: Spec, url: str, models: Sequence[str], requests: Requests,
                 rng: random.Random) -> None:
        import aiohttp  # the host side runs without it too

        self.aiohttp = aiohttp
        self.spec, self.url, self.models = spec, url, list(models)
        self.requests, self.rng = requests, rng

    async def client(self, session: Any, deadline: float, n: int) -> None:
        timeout = self.aiohttp.ClientTimeout(total=self.spec.request_timeout)
        i = 0
        while time.monotonic() < deadline:
            i += 1
            model = self.rng.choice(self.models)
            stream = self.rng.random() < self.spec.drop
            body: dict[str, Any] = {"model": model, "max_tokens": self.spec.max_tokens,
                                    "messages": [{"role": "user", "content": f"hi {n}.{i}"}]}
            if stream:
                body["stream"] = True
            t0 = time.perf_counter()
            try:
                async with session.post(self.url + CHAT, json=body, timeout=timeout) as resp:
                    if resp.status != 200:
                        raw = await resp.read()
                        self.requests.error(f"{resp.status} {error_code(raw)}",
                                            f"{model}: {raw.decode(errors='replace')}")
                    elif stream:
                        await self.first_event_then_drop(resp, model)
                    else:
                        raw = await resp.read()
                        data = json.loads(raw)
                        if isinstance(data, dict) and data.get("choices"):
                            self.requests.ok += 1
                            self.requests.latencies_ms.append((time.perf_counter() - t0) * 1000)
                        else:
                            self.requests.error("200 no_choices", f"{model}: {raw[:300]!r}")
            except TimeoutError:
                self.requests.error("timeout", f"{model}: no answer in "
                                    f"{self.spec.request_timeout}s (stream={stream})")
            except (self.aiohttp.ClientError, ValueError) as e:
                self.requests.error(f"exception {type(e).__name__}", f"{model}: {e}")

    async def first_event_then_drop(self, resp: Any, model: str) -> None:
        buf = b""
        while b"\n\n" not in buf:
            chunk = await resp.content.readany()
            if not chunk:
                break
            buf += chunk
        event = buf.split(b"\n\n", 1)[0]
        resp.close()      # drop the connection mid-stream
        if b"\n\n" not in buf:
            self.requests.error("200 stream_ended_before_first_event",
                                f"{model}: {buf[:300]!r}")
        elif b'"error"' in event:
            payload = event.split(b"data:", 1)[-1].strip()
            self.requests.error(f"200 stream_error:{error_code(payload)}",
                                f"{model}: {payload[:300]!r}")
        else:
            self.requests.dropped += 1

    async def load(self, seconds: float) -> None:
        connector = self.aiohttp.TCPConnector(limit=self.spec.concurrency)
        async with self.aiohttp.ClientSession(connector=connector) as session:
            deadline = time.monotonic() + seconds
            await asyncio.gather(*(self.client(session, deadline, n)
                                   for n in range(self.spec.concurrency)))



class Driver:
    def __init__(self, spec: Spec) -> None:
        import aiohttp  # the host side runs without it too

        self.aiohttp = aiohttp
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.models = [f"soak{i}" for i in range(spec.models)]
        self.template = spec.mode == "template"
        self.port = TEMPLATE_PORT if self.template else TRANSIENT_PORT
        self.unit = TEMPLATE_UNIT if self.template else TRANSIENT_UNIT
        self.unit_prefix = "llm-engine@" if self.template else "llm-engine-"
        self.base = f"http://127.0.0.1:{self.port}"
        self.requests = Requests()
        self.clients = Clients(spec, self.base, self.models, self.requests, self.rng)
        self.sampler = Sampler(spec.slots, interval=spec.interval)
        self.events: Counter[str] = Counter()
        self.stop_reasons: Counter[str] = Counter()
        self.follower_reconnects = 0
        self.log: list[str] = []

    def say(self, text: str) -> None:
        print(f"soak[{self.spec.mode}]: {text}", file=sys.stderr, flush=True)

    # -- setting the gateway up -----------------------------------------------------

    def setup(self) -> None:
        sys.path.insert(0, str(REPO / "scripts"))
        import make_tiny_model

        if self.template:
            models = Path("/var/lib/llm-gateway/models")
            out = subprocess.run(["dpkg", "-i", self.spec.deb], capture_output=True, text=True,
                                 check=False)
            if out.returncode != 0 or "Setting up llm-gateway" not in out.stdout:
                raise RuntimeError(f"dpkg -i {self.spec.deb} failed:\n{out.stdout}{out.stderr}")
            run("install", "-m755", self.spec.llama_server, "/usr/local/bin/llama-server")
        else:
            models = Path("/var/lib/llm-soak/models")
        models.mkdir(parents=True, exist_ok=True)
        for seed, name in enumerate(self.models):
            make_tiny_model.write_model(str(models / f"{name}.gguf"), name, seed)
        if self.template:
            run("chown", "-R", "llm-gateway:llm-gateway", str(models))
            conf = Path("/etc/llm-gateway/gateway.toml")
            lines = [line for line in conf.read_text().splitlines()
                     if not line.startswith(("llama_server =", "max_engines ="))]
            # the soak reads /admin/engines and /admin/events over the port
            conf.write_text("\n".join(['llama_server = "/usr/local/bin/llama-server"',
                                       f"max_engines = {self.spec.slots}", *lines,
                                       "[admin]", "public = true"]) + "\n")
            run("systemctl", "try-restart", self.unit)
        else:
            conf = Path("/var/lib/llm-soak/gateway.toml")
            conf.write_text(
                f"models_dir = {json.dumps(str(models))}\n"
                f"llama_server = {json.dumps(self.spec.llama_server)}\n"
                f"state_dir = {json.dumps('/var/lib/llm-soak/state')}\n"
                f"max_engines = {self.spec.slots}\nload_timeout_s = 60\n"
                "[admin]\npublic = true\n")
            src = self.spec.gateway_src
            run("systemd-run", "--quiet", f"--unit={self.unit}",
                f"--socket-property=ListenStream=127.0.0.1:{self.port}",
                "-p", "Type=notify", "-p", "Restart=on-failure", "-p", f"WorkingDirectory={src}",
                "-E", f"PYTHONPATH={src}", "-E", "PYTHONUNBUFFERED=1",
                self.spec.python, "-m", "gatewayd", "--config", str(conf), "serve")

    async def activate(self, session: Any, timeout: float = 60) -> None:
        """The first connection starts the socket-activated gateway."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                async with session.get(self.base + "/health") as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (self.aiohttp.ClientError, TimeoutError) as e:
                last = repr(e)
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the gateway did not answer /health in {timeout}s ({last}):\n"
                           + self.journal(self.unit, 40))

    # -- the load ---------------------------------------------------------------------

    async def load(self, seconds: float) -> None:
        await self.clients.load(seconds)

    # -- watching -------------------------------------------------------------------

    async def sample_forever(self, t0: float) -> None:
        timeout = self.aiohttp.ClientTimeout(total=5)
        async with self.aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                tick = time.monotonic()
                try:
                    units = await engine_units()
                    if self.sampler.over(units):
                        # confirmed by a second look at once: a swap that fell between
                        # the sample's own reads (a stop, then a parked unit woken) is
                        # not more engines than slots; a real surplus stays
                        units = await engine_units()
                except RuntimeError as e:
                    self.sampler.sample_errors[f"systemctl: {e}"[:120]] += 1
                    units = None
                engines: list[dict[str, Any]] | None = None
                try:
                    async with session.get(self.base + "/admin/engines") as resp:
                        if resp.status == 200:
                            engines = (await resp.json())["engines"]
                        else:
                            self.sampler.sample_errors[f"/admin/engines HTTP {resp.status}"] += 1
                except (self.aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
                    self.sampler.sample_errors[f"/admin/engines {type(e).__name__}"] += 1
                if units is not None:
                    self.sampler.observe(tick - t0, units, engines, self.unit_prefix)
                await asyncio.sleep(max(0.0, self.spec.interval - (time.monotonic() - tick)))

    async def follow_events(self) -> None:
        timeout = self.aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with self.aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    async with session.get(self.base + "/admin/events") as resp:
                        async for line in resp.content:
                            if line.startswith(b"data:"):
                                self.on_event(json.loads(line[5:]))
                except (self.aiohttp.ClientError, ValueError):
                    pass
                self.follower_reconnects += 1
                await asyncio.sleep(0.5)

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("type") != "engine":
            return
        state = str(event.get("state"))
        self.events[state] += 1
        if state == "stopped":
            self.stop_reasons[str(event.get("reason"))] += 1

    def journal_cursor(self) -> str:
        out = run("journalctl", "-n", "0", "--show-cursor", "--no-pager")
        return out.strip().rsplit("-- cursor: ", 1)[1]

    def engine_journal_counts(self, cursor: str) -> dict[str, int]:
        subprocess.run(["journalctl", "--sync"], check=False)
        counts: Counter[str] = Counter()
        for message_id, name in ((MSG_UNIT_STARTED, "started"), (MSG_UNIT_FAILED, "failed")):
            out = run("journalctl", "-o", "json", "--no-pager", f"--after-cursor={cursor}",
                      f"MESSAGE_ID={message_id}", "_PID=1")
            for line in out.splitlines():
                unit = json.loads(line).get("UNIT", "")
                if unit.startswith(("llm-engine-", "llm-engine@")) and unit.endswith(".service"):
                    counts[name] += 1
        return {"started": counts["started"], "failed": counts["failed"]}

    def journal(self, unit: str, lines: int | None = None) -> str:
        subprocess.run(["journalctl", "--sync"], check=False)
        argv = ["journalctl", "-u", unit, "-o", "short-monotonic", "--no-pager"]
        if lines:
            argv += ["-n", str(lines)]
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

    # -- the whole run --------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        spec = self.spec
        self.say(f"{spec.models} models, {spec.slots} slots, {spec.concurrency} clients, "
                 f"drop {spec.drop:.0%}, {spec.warmup_s():.0f} s warm-up + {spec.duration:.0f} s")
        self.setup()
        cursor = self.journal_cursor()
        async with self.aiohttp.ClientSession(
                timeout=self.aiohttp.ClientTimeout(total=5)) as session:
            await self.activate(session)
        idle = proc_resources(main_pid(self.unit))
        t0 = time.monotonic()
        watchers = [asyncio.ensure_future(self.sample_forever(t0)),
                    asyncio.ensure_future(self.follow_events())]
        try:
            await self.load(spec.warmup_s())
            await asyncio.sleep(spec.settle)
            pid = main_pid(self.unit)
            start = proc_resources(pid)
            self.say(f"baseline after the warm-up: {start}; load for {spec.duration:.0f} s")
            # RSS at half time too: growth that slows is a warm-up, growth that keeps its
            # pace is a leak
            await self.load(spec.duration / 2)
            mid = proc_resources(pid) if main_pid(self.unit) == pid else None
            await self.load(spec.duration / 2)
            await asyncio.sleep(spec.settle)
            end_pid = main_pid(self.unit)
            end = proc_resources(end_pid) if end_pid else {"pid": 0, "rss_mib": 0.0, "fds": 0,
                                                           "fds_by_kind": {}}
        finally:
            for task in watchers:
                task.cancel()
            for task in watchers:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        wall = time.monotonic() - t0
        restarts = int(run("systemctl", "show", "-p", "NRestarts", "--value", self.unit)
                       .strip() or 0)
        journal = self.engine_journal_counts(cursor)
        Path(spec.outdir, f"gateway-{spec.mode}.log").write_text(self.journal(self.unit))
        return self.result(wall, idle, start, end, idle["pid"] != end_pid, restarts, journal,
                           mid)

    def result(self, wall: float, idle: dict[str, Any], start: dict[str, Any],
               end: dict[str, Any], pid_changed: bool, restarts: int,
               journal: dict[str, int], mid: dict[str, Any] | None = None) -> dict[str, Any]:
        req, smp = self.requests, self.sampler
        lat = sorted(req.latencies_ms)
        errors = sum(req.errors.values())
        rss_change = (end["rss_mib"] - start["rss_mib"]) / start["rss_mib"] if start["rss_mib"] \
            else 0.0
        fd_change = end["fds"] - start["fds"]
        rss_ok = abs(rss_change) <= 0.10
        fds_ok = abs(fd_change) <= max(3, 0.10 * start["fds"])
        violations: list[dict[str, Any]] = []
        violations += [{"kind": "units_over_slots", **v} for v in smp.over_slots]
        violations += [{**v, "kind": f"gateway_vs_systemd_{v['kind']}"}
                       for v in smp.disagreements]
        if pid_changed or restarts:
            violations.append({"kind": "gateway_restarted", "restarts": restarts,
                               "pid_changed": pid_changed})
        reasons = []
        if errors:
            reasons.append(f"{errors} errors")
        if violations:
            reasons.append(f"{len(violations)} invariant violations")
        if not rss_ok:
            reasons.append(f"RSS changed {rss_change:+.1%}")
        if not fds_ok:
            reasons.append(f"open fds changed {fd_change:+d}")
        return {
            "mode": self.spec.mode,
            "spec": asdict(self.spec),
            "wall_s": round(wall, 1),
            "requests": {"total": req.ok + req.dropped + errors, "ok": req.ok,
                         "dropped": req.dropped, "errors": errors,
                         "errors_by_code": dict(req.errors.most_common()),
                         "error_examples": req.examples,
                         "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)},
            "swaps": self.events["starting"],
            "engine_events": dict(self.events),
            "stop_reasons": dict(self.stop_reasons),
            "events_follower_reconnects": self.follower_reconnects,
            "engine_unit_starts_systemd": journal["started"],
            "engine_unit_failures_systemd": journal["failed"],
            "gateway": {"unit": self.unit, "idle": idle, "start": start, "mid": mid, "end": end,
                        "rss_change": round(rss_change, 4), "fd_change": fd_change,
                        "rss_ok": rss_ok, "fds_ok": fds_ok, "restarts": restarts},
            "samples": smp.samples,
            "sample_errors": dict(smp.sample_errors),
            "max_active_units": smp.max_active,
            "max_active_unit_names": smp.max_active_units,
            "samples_over_slots": len(smp.over_slots),
            "disagreements": len(smp.disagreements),
            "unknown_gateway_states": sorted(smp.unknown_states),
            "violations": len(violations),
            "violation_details": violations[:50],
            "passed": not reasons,
            "reasons": reasons,
        }


def inside_main(spec_path: str) -> int:
    spec = Spec(**json.loads(Path(spec_path).read_text()))
    result = asyncio.run(Driver(spec).run())
    Path(spec.outdir, f"result-{spec.mode}.json").write_text(json.dumps(result, indent=2))
    return 0


# -- on the host: containers, and the report --------------------------------------------


def find_llama_server(explicit: str | None) -> str:
    if explicit:
        return explicit
    if env := os.environ.get("LLAMA_SERVER"):
        return env
    proc = subprocess.run(["bash", str(REPO / "scripts/get_llama_server.sh")], text=True,
                          stdout=subprocess.PIPE, check=False)   # builds it once if needed
    if proc.returncode != 0:
        raise SystemExit("soak: no llama-server (scripts/get_llama_server.sh failed)")
    return proc.stdout.strip()


def build_deb(gateway_src: Path, out: Path) -> str:
    """packaging/build-deb.sh of the gateway tree under test."""
    script = gateway_src / "packaging/build-deb.sh"
    if not script.exists():
        script = REPO / "packaging/build-deb.sh"
    print(f"soak: building the package with {script}", file=sys.stderr, flush=True)
    proc = subprocess.run(["bash", str(script), str(out)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def run_mode(spec: Spec, logs: Path | None = None) -> dict[str, Any]:
    """Boot a container, run the driver inside it, return its result (raises on trouble)."""
    from tests.harness.container import SCRIPT, SystemdContainer
    from tests.harness.plugin import ENGINE_CACHE

    outdir = Path(tempfile.mkdtemp(prefix="llmgw-soak-", dir="/var/tmp"))
    try:
        spec.outdir = str(outdir)
        binds_ro = [ENGINE_CACHE] if ENGINE_CACHE.is_dir() else []
        src = Path(spec.gateway_src).resolve()
        if src != REPO and REPO not in src.parents:
            binds_ro.append(src)
        llama = Path(spec.llama_server).resolve()
        if not {ENGINE_CACHE, REPO} & set(llama.parents):
            binds_ro.append(llama.parent)
        if spec.mode == "template":
            if not spec.deb:
                spec.deb = build_deb(src, outdir / "deb")
            binds_ro.append(Path(spec.deb).resolve().parent)
        (outdir / "spec.json").write_text(json.dumps(asdict(spec)))
        box = SystemdContainer(f"soak-{os.getpid() % 100000}-{spec.mode[:5]}",
                               binds=[REPO, outdir], binds_ro=binds_ro)
        box.start()
        try:
            # the driver runs as a transient service of the container's systemd; its
            # progress lines go straight to our stderr
            argv = ["bash", str(SCRIPT), "run", box.name, "-p", f"WorkingDirectory={REPO}",
                    spec.python, "-m", "bench.soak", "--inside", str(outdir / "spec.json")]
            limit = spec.duration + spec.warmup_s() + 2 * spec.settle + 600
            try:
                progress: int | None = sys.stderr.fileno()
            except (AttributeError, OSError, ValueError):   # e.g. under pytest's capsys
                progress = None
            proc = subprocess.run(argv, env=box._env, stdin=subprocess.DEVNULL,
                                  stdout=progress, check=False, timeout=limit)
            result_file = outdir / f"result-{spec.mode}.json"
            if proc.returncode != 0 or not result_file.exists():
                raise RuntimeError(f"the soak driver inside the container exited "
                                   f"{proc.returncode} without a result")
            result: dict[str, Any] = json.loads(result_file.read_text())
        finally:
            box.stop()
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            for f in outdir.glob("gateway-*.log"):
                shutil.copy(f, logs / f.name)
        return result
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def markdown(results: Sequence[dict[str, Any]]) -> str:
    cols = [r["mode"] for r in results]
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, get: Any) -> None:
        rows.append((name, [cell(get, r) for r in results]))

    def cell(get: Any, r: dict[str, Any]) -> str:
        try:
            return str(get(r))
        except (KeyError, TypeError):   # a run that ended in an error has no figures
            return "-"

    def change(r: dict[str, Any], key: str) -> str:
        g = r["gateway"]
        a, b = g["start"][key], g["end"][key]
        ok = g["rss_ok" if key == "rss_mib" else "fds_ok"]
        return f"{a} → {b} ({'ok' if ok else 'OUT OF BOUNDS'})"

    slots = results[0]["spec"]["slots"]
    row("models / slots / clients / drop", lambda r: (
        f"{r['spec']['models']} / {r['spec']['slots']} / {r['spec']['concurrency']} / "
        f"{r['spec']['drop']:.0%}"))
    row("load (warm-up + measured), wall", lambda r: (
        f"{r['spec']['warmup']:.0f} + {r['spec']['duration']:.0f} s, {r['wall_s']} s"))
    row("requests", lambda r: r["requests"]["total"])
    row("ok", lambda r: r["requests"]["ok"])
    row("dropped (streamed, left after the first event)", lambda r: r["requests"]["dropped"])
    row("**errors**", lambda r: r["requests"]["errors"])
    codes = sorted({k for r in results for k in r.get("requests", {}).get("errors_by_code", {})})
    for code in codes:
        row(f"  error {code}", lambda r, c=code: r["requests"]["errors_by_code"].get(c, 0))
    row("latency p50 / p99 of ok (ms)", lambda r: (
        f"{r['requests']['p50_ms']} / {r['requests']['p99_ms']}"))
    row("swaps (gateway `starting` events)", lambda r: r["swaps"])
    row("engine unit starts / failures (systemd journal)", lambda r: (
        f"{r['engine_unit_starts_systemd']} / {r['engine_unit_failures_systemd']}"))
    row("engines stopped, by reason", lambda r: ", ".join(
        f"{k}: {v}" for k, v in sorted(r["stop_reasons"].items())) or "-")
    row(f"max active engine units (slots {slots})", lambda r: r["max_active_units"])
    row("samples / over slots", lambda r: f"{r['samples']} / {r['samples_over_slots']}")
    row("gateway vs systemd, disagreeing 2 samples in a row", lambda r: r["disagreements"])
    row("**invariant violations**", lambda r: r["violations"])
    row("gateway RSS MiB (after warm-up → end)", lambda r: change(r, "rss_mib"))

    def halves(r: dict[str, Any]) -> str:
        g, half_min = r["gateway"], r["spec"]["duration"] / 120
        a, m, b = g["start"]["rss_mib"], g["mid"]["rss_mib"], g["end"]["rss_mib"]
        return f"{(m - a) / half_min:+.2f} / {(b - m) / half_min:+.2f}"
    row("gateway RSS growth, MiB per minute (first half / second half)", halves)
    row("gateway open fds (after warm-up → end)", lambda r: change(r, "fds"))
    row("verdict", lambda r: "PASS" if r["passed"] else "FAIL: " + "; ".join(r["reasons"]))
    row("run error", lambda r: (r.get("error") or "-").splitlines()[0])
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    lines += [f"| {name} | " + " | ".join(vals) + " |" for name, vals in rows]
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", type=int, default=3, help="tiny models (N)")
    p.add_argument("--slots", type=int, default=2, help="max_engines (SLOTS)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent clients (C)")
    p.add_argument("--drop", type=float, default=0.25,
                   help="share of requests streamed and dropped after the first event (D)")
    p.add_argument("--duration", type=float, default=600, help="seconds of measured load (T)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of load before the RSS/fd baseline "
                        "(default: 10%% of duration, 3..30)")
    p.add_argument("--settle", type=float, default=6.0,
                   help="idle seconds before each RSS/fd reading")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="seconds a request may take before it counts as an error (timeout)")
    p.add_argument("--mode", choices=[*MODES, "both"], default="transient")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--logs", type=Path, help="copy the gateway's journal here")
    p.add_argument("--llama-server", help="default: $LLAMA_SERVER, else "
                                          "scripts/get_llama_server.sh")
    p.add_argument("--gateway-src", type=Path, default=REPO,
                   help="the source tree whose gatewayd runs (e.g. a `git archive` of "
                        "another commit); the package is built from it in template mode")
    p.add_argument("--deb", help="template mode: this .deb instead of building one")
    p.add_argument("--fleet", type=int, metavar="N",
                   help="N gateways, each in its own container, behind the shipped HAProxy: "
                        "the load through the balancer (bench/soak_fleet.py)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--inside"]:
        return inside_main(argv[1])
    args = parse_args(argv)
    from tests.harness.container import why_unavailable

    if reason := why_unavailable():
        print(f"soak: {reason}", file=sys.stderr)
        return 2
    if not (args.gateway_src / "gatewayd/__init__.py").is_file():
        print(f"soak: no gatewayd package in {args.gateway_src}", file=sys.stderr)
        return 2
    llama = str(Path(find_llama_server(args.llama_server)).resolve())
    if not os.access(llama, os.X_OK):
        print(f"soak: {llama} is not an executable llama-server", file=sys.stderr)
        return 2
    # a SIGTERM (or a timeout(1) around us) still stops the container: finally blocks run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.fleet:
        return fleet_main(args, llama)
    results = []
    for mode in (MODES if args.mode == "both" else (args.mode,)):
        spec = Spec(mode=mode, models=args.models, slots=args.slots,
                    concurrency=args.concurrency, drop=args.drop, duration=args.duration,
                    settle=args.settle, interval=args.interval, seed=args.seed,
                    request_timeout=args.request_timeout, llama_server=llama,
                    gateway_src=str(args.gateway_src.resolve()),
                    deb=str(Path(args.deb).resolve()) if args.deb else "")
        spec.warmup = spec.warmup_s() if args.warmup is None else args.warmup
        try:
            results.append(run_mode(spec, args.logs))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"soak[{mode}]: {e}", file=sys.stderr)
            results.append({"mode": mode, "spec": asdict(spec), "passed": False,
                            "reasons": [f"the run failed: {str(e).splitlines()[0]}"],
                            "error": str(e)})
    passed = all(r["passed"] for r in results)
    if args.json:
        args.json.write_text(json.dumps({"passed": passed, "runs": results}, indent=2) + "\n")
    print(markdown(results))
    return 0 if passed else 1


def fleet_main(args: argparse.Namespace, llama: str) -> int:
    """--fleet N: the soak through HAProxy in front of N gateways (bench/soak_fleet.py)."""
    from bench import soak_fleet

    os.environ.setdefault("LLAMA_SERVER", llama)   # tests/fleet.py's engine
    spec = Spec(models=args.models, slots=args.slots, concurrency=args.concurrency,
                drop=args.drop, duration=args.duration, interval=args.interval,
                seed=args.seed, request_timeout=args.request_timeout, llama_server=llama)
    spec.warmup = spec.warmup_s() if args.warmup is None else args.warmup
    try:
        result = soak_fleet.run_fleet(spec, args.fleet)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"soak[fleet]: {e}", file=sys.stderr)
        result = {"spec": asdict(spec), "passed": False, "error": str(e),
                  "reasons": [f"the run failed: {str(e).splitlines()[0]}"]}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(soak_fleet.markdown(result) if "requests" in result else result["reasons"][0])
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
