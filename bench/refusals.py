"""The refusals section of the suite: what turning a request away costs the gateway.

A flood of requests the gateway must refuse should cost it little, and should not slow the
requests it serves meanwhile (issue 50: 10 000 concurrent `GET
/admin/engines/logs?follow=1` were capped correctly, yet `/v1/models` took seconds
meanwhile). Against the instant fake engine, keys on:

1. rates: refusals per second the gateway sustains for each of 401 (no key), 403 (a
   cross-site Origin), 415 (a JSON route sent text/plain), 421 (a foreign Host) and 429
   (a journal follow past the cap: the cap's follows held open meanwhile), beside the bare
   aiohttp proxy's own 404 (bench/bare_proxy.py's /bare/refused) in the same rounds; the
   CPU each proxy spent per refusal, and what the load generator took.
2. inference: a max_tokens=1 chat's latency (c=1, a kept-alive connection) idle and during
   a flood of all five refusals at once, rounds alternating; and /v1/models on a new
   connection each time, idle and during the flood (the issue's second figure). The same
   through the bare proxy, idle and during a flood of its 404s: what any aiohttp server
   sharing its event loop with a flood gives.

The load generator (bench/flood.py) is a process of its own: raw sockets, `FLOOD_DEPTH`
requests pipelined on each of `FLOOD_CONNECTIONS` kept-alive connections, so that what it
spends per answer is small beside the gateway's; it says what it took.

Run by bench/suite.py (`--only refusals`); its units are bench-refusals-*, stopped at
the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.suite import (
    CHAT,
    PY,
    REPO,
    Plan,
    chat,
    cpu_seconds,
    main_pid,
    pct,
    run_unit,
    wait_http,
    write_config,
)

GATEWAY_PORT = 18650
BARE_PORT = 18651
UNITS = "bench-refusals-*"
USER_KEY, ADMIN_KEY = "sk-llmgw-bench-user", "sk-llmgw-bench-admin"
# each kind: what the gateway must answer to it
KINDS = ("401", "403", "415", "421", "429")
BARE = "bare_404"
FLOOD_CONNECTIONS = 32
FLOOD_DEPTH = 32


def http_request(method: str, path: str, host: str, headers: Sequence[str] = (),
                 body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *headers]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def refusal_requests(gateway_port: int, bare_port: int, model: str) -> dict[str, bytes]:
    """Each kind's request; all but the one reason to refuse are in order (a key, the
    gateway's own Host, a JSON body) so that the refusal is the one named."""
    host = f"127.0.0.1:{gateway_port}"
    body = json.dumps(chat(model)).encode()
    as_json, key = "Content-Type: application/json", f"Authorization: Bearer {USER_KEY}"
    return {
        "401": http_request("POST", CHAT, host, [as_json], body),
        "403": http_request("POST", CHAT, host, [as_json, key, "Origin: https://evil.example"],
                            body),
        "415": http_request("POST", CHAT, host, ["Content-Type: text/plain", key], body),
        "421": http_request("POST", CHAT, "evil.example", [as_json, key], body),
        "429": http_request("GET", f"/admin/engines/logs?model={model}&follow=1", host,
                            [f"Authorization: Bearer {ADMIN_KEY}"]),
        BARE: http_request("GET", "/bare/refused", f"127.0.0.1:{bare_port}"),
    }


def keys_file(path: Path) -> Path:
    from gatewayd.core.auth import digest
    path.write_text(f'[keys.user]\nsha256 = "{digest(USER_KEY)}"\n'
                    f'[keys.ops]\nsha256 = "{digest(ADMIN_KEY)}"\nscopes = ["admin"]\n')
    return path


async def section(plan: Plan, work: Path, retried: list[dict[str, str]]) -> dict[str, Any]:
    base = work / "refusals"
    # a state of its own each time: a previous run's gateway left its engine on the
    # desired list, which the next one would start by itself (a start asked then: 409)
    shutil.rmtree(base / "state", ignore_errors=True)
    base.mkdir(parents=True, exist_ok=True)
    engine_units: list[str] = []
    try:
        return await measure(plan, base, engine_units)
    finally:
        stop_units(engine_units)


def stop_units(engine_units: list[str]) -> None:
    from bench.crowd import stop_units as stop
    stop(engine_units, UNITS)


async def post_admin(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(
            url, json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
        return resp.status, await resp.json(content_type=None)


async def measure(plan: Plan, base: Path, engine_units: list[str]) -> dict[str, Any]:
    models = base / "models"
    models.mkdir(exist_ok=True)
    (models / "fake.gguf").write_bytes(b"GGUF")
    cfg = write_config(base / "gw.toml", models, str(REPO / "bench/fake-llama-server"),
                       base / "state", GATEWAY_PORT,
                       extra=f'[auth]\nkeys_file = "{keys_file(base / "keys.toml")}"\n')
    gateway = f"http://127.0.0.1:{GATEWAY_PORT}"
    run_unit("bench-refusals-gateway", [PY, "-m", "gatewayd", "--config", str(cfg), "serve"],
             notify=True)
    status, body = await post_admin(gateway + "/admin/engines/start", {"model": "fake"})
    if status != 200:
        raise RuntimeError(f"the gateway did not start fake: HTTP {status}: {body}")
    engine = body["engine"]
    if engine.get("unit"):
        engine_units.append(engine["unit"])
    run_unit("bench-refusals-bare", [PY, "-m", "bench.bare_proxy", "--socket",
                                     engine["socket"], "--port", str(BARE_PORT)])
    await wait_http(f"http://127.0.0.1:{BARE_PORT}/bare/retries")
    pids = {"gateway": main_pid("bench-refusals-gateway.service"),
            "bare": main_pid("bench-refusals-bare.service")}
    requests = refusal_requests(GATEWAY_PORT, BARE_PORT, "fake")
    files = {}
    for kind, raw in requests.items():
        files[kind] = base / f"{kind}.http"
        files[kind].write_bytes(raw)
    async with Follows(gateway, "fake") as follows:
        held = await follows.fill()
        # 1. each refusal's rate, the bare proxy's 404 beside them, rounds interleaved
        kinds = [*KINDS, BARE]
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for rnd in range(plan.refusal_rounds):
            k = rnd % len(kinds)
            for kind in [*kinds[k:], *kinds[:k]]:
                port = BARE_PORT if kind == BARE else GATEWAY_PORT
                pid = pids["bare" if kind == BARE else "gateway"]
                runs[kind].append(await flood_for(port, [files[kind]], plan.refusal_seconds,
                                                  pid))
        # 2. inference, idle and during a flood of every refusal at once
        # (and the bare proxy's, idle and during its 404 flood: the floor of any aiohttp
        # server sharing its loop with a flood)
        bare = f"http://127.0.0.1:{BARE_PORT}"
        probes: dict[str, dict[str, list[float]]] = {
            p: {"chat": [], "new_connection": []}
            for p in ("idle", "flood", "bare_idle", "bare_flood")}
        floods: list[dict[str, Any]] = []
        for rnd in range(plan.refusal_rounds):
            order = ["idle", "flood", "bare_idle", "bare_flood"]
            for phase in order[rnd % 4:] + order[:rnd % 4]:
                url = bare if phase.startswith("bare") else gateway
                listing = "/bare/retries" if url == bare else "/v1/models"
                if not phase.endswith("flood"):
                    await probe(url, plan.refusal_seconds, probes[phase], listing)
                    continue
                flooding = ([files[BARE]], pids["bare"]) if url == bare else (
                    [files[k] for k in KINDS], pids["gateway"])
                async with Flood(BARE_PORT if url == bare else GATEWAY_PORT,
                                 *flooding) as flood:
                    await probe(url, plan.refusal_seconds, probes[phase], listing)
                assert flood.result is not None
                if url == gateway:
                    floods.append(flood.result)
        still_held = follows.open()
    return summarise(runs, probes, floods, held, still_held)


def summarise(runs: dict[str, list[dict[str, Any]]], probes: dict[str, dict[str, list[float]]],
              floods: list[dict[str, Any]], held: int, still_held: int) -> dict[str, Any]:
    def med(values: list[float], digits: int = 1) -> float:
        return round(statistics.median(values), digits) if values else float("nan")

    rates = {}
    for kind, kind_runs in runs.items():
        want = "404" if kind == BARE else kind
        per_s = [r["answers"] / r["seconds"] for r in kind_runs]
        rates[kind] = {
            "per_s": med(per_s),
            "spread": [round(min(per_s), 1), round(max(per_s), 1)] if per_s else [],
            "cpu_us_per_refusal": med([r["server_cpu_s"] / max(1, r["answers"]) * 1e6
                                       for r in kind_runs]),
            # answers of another status than the kind's (none expected)
            "other_statuses": sum(n for r in kind_runs for s, n in r["statuses"].items()
                                  if s != want),
            "reopened": sum(r["reopened"] for r in kind_runs)}
    every = [r for kind_runs in runs.values() for r in kind_runs] + floods
    chat_ms = {p: sorted(v["chat"]) for p, v in probes.items()}
    fresh_ms = {p: sorted(v["new_connection"]) for p, v in probes.items()}
    flood_statuses: dict[str, int] = {}
    for f in floods:
        for s, n in f["statuses"].items():
            flood_statuses[s] = flood_statuses.get(s, 0) + n
    return {
        "connections": FLOOD_CONNECTIONS, "depth": FLOOD_DEPTH,
        "follows_held": held, "follows_held_at_end": still_held,
        "rates": rates,
        "ratio_to_bare": {k: round(rates[k]["per_s"] / rates[BARE]["per_s"], 3)
                          for k in KINDS if rates[BARE]["per_s"]},
        # what the load generator took of the machine (cores: its CPU seconds per second)
        "generator": {"cores": med([r["cpu_s"] / r["seconds"] for r in every], 3),
                      "cpu_us_per_answer": med([r["cpu_s"] / max(1, r["answers"]) * 1e6
                                                for r in every])},
        "inference_ms": {p: {"n": len(v), "p50": round(pct(v, 50), 3),
                             "p99": round(pct(v, 99), 3), "max": round(max(v, default=0), 3)}
                         for p, v in chat_ms.items()},
        "new_connection_ms": {p: {"n": len(v), "p50": round(pct(v, 50), 3),
                                  "p99": round(pct(v, 99), 3),
                                  "max": round(max(v, default=0), 3)}
                              for p, v in fresh_ms.items()},
        "flood_during_inference": {
            "per_s": med([f["answers"] / f["seconds"] for f in floods]),
            "statuses": flood_statuses}}


# -- the flood, a process of its own ----------------------------------------------------


class Flood:
    """bench/flood.py until the block ends; the gateway's CPU over it (server_cpu_s)."""

    def __init__(self, port: int, requests: Sequence[Path], pid: int) -> None:
        self._argv = [PY, "-m", "bench.flood", "--port", str(port),
                      "--connections", str(FLOOD_CONNECTIONS), "--depth", str(FLOOD_DEPTH),
                      *(a for r in requests for a in ("--request", str(r)))]
        self._pid = pid
        self.result: dict[str, Any] | None = None

    async def __aenter__(self) -> Flood:
        self._proc = await asyncio.create_subprocess_exec(
            *self._argv, "--until-stdin-closes", cwd=REPO, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)
        await self._started()
        return self

    async def _started(self) -> None:
        assert self._proc.stdout is not None
        line = await asyncio.wait_for(self._proc.stdout.readline(), 30)
        if line.strip() != b"go":
            raise RuntimeError(f"bench.flood did not start: {line!r}")
        self._cpu0 = cpu_seconds(self._pid)

    async def __aexit__(self, *exc: object) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.close()
        line = await asyncio.wait_for(self._proc.stdout.readline(), 30)
        cpu = cpu_seconds(self._pid) - self._cpu0
        await self._proc.wait()
        if exc[0] is None:
            self.result = {**json.loads(line), "server_cpu_s": cpu}


async def flood_for(port: int, requests: Sequence[Path], seconds: float,
                    pid: int) -> dict[str, Any]:
    async with Flood(port, requests, pid) as flood:
        await asyncio.sleep(seconds)
    assert flood.result is not None
    return flood.result


# -- what the gateway serves meanwhile ----------------------------------------------------


async def probe(gateway: str, seconds: float, out: dict[str, list[float]],
                listing: str = "/v1/models") -> None:
    """For `seconds`: chats one after another on a kept-alive connection, and `listing` (an
    answer the proxy gives itself: the gateway's /v1/models, the bare proxy's
    /bare/retries) on a new connection each time, side by side."""
    deadline = time.perf_counter() + seconds
    auth = {"Authorization": f"Bearer {USER_KEY}"}
    payload = json.dumps(chat("fake")).encode()
    timeout = aiohttp.ClientTimeout(total=60)

    async def chats() -> None:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                async with session.post(gateway + CHAT, data=payload, headers={
                        **auth, "Content-Type": "application/json"}) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"chat during the refusals: HTTP {resp.status}")
                out["chat"].append((time.perf_counter() - t0) * 1000)

    async def models() -> None:
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                async with session.get(gateway + listing, headers=auth) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{listing} during the refusals: HTTP "
                                           f"{resp.status}")
                out["new_connection"].append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(0.01)   # a client now and then, not a second flood

    await asyncio.gather(chats(), models())


class Follows:
    """The journal follows the gateway allows (its cap), held open while the 429s are
    measured; each read and its lines dropped."""

    def __init__(self, gateway: str, model: str) -> None:
        self._url = f"{gateway}/admin/engines/logs?model={model}&follow=1"
        self._headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        self._responses: list[aiohttp.ClientResponse] = []
        self._readers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Follows:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self

    async def fill(self, most: int = 64) -> int:
        """Follows opened until the gateway says 429; how many it let open."""
        for _ in range(most):
            resp = await self._session.get(self._url, headers=self._headers)
            if resp.status == 429:
                resp.release()
                return len(self._responses)
            if resp.status != 200:
                raise RuntimeError(f"a journal follow: HTTP {resp.status}: "
                                   f"{(await resp.read())[:300]!r}")
            self._responses.append(resp)
            self._readers.append(asyncio.ensure_future(self._drain(resp)))
        raise RuntimeError(f"{most} journal follows and no 429")

    async def _drain(self, resp: aiohttp.ClientResponse) -> None:
        with contextlib.suppress(aiohttp.ClientError, asyncio.CancelledError):
            async for _ in resp.content.iter_any():
                pass

    def open(self) -> int:
        return sum(1 for t in self._readers if not t.done())

    async def __aexit__(self, *exc: object) -> None:
        for task in self._readers:
            task.cancel()
        for resp in self._responses:
            resp.close()
        await self._session.close()

