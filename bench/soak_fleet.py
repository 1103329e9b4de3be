"""A soak through the balancer: bench/soak's clients (bench/soak.Clients) against HAProxy
with the shipped configuration (packaging/haproxy/haproxy.cfg, only its addresses
changed) in front of gateways, each in its own systemd container with its own real
llama-server engines (tests/fleet.py), as an operator runs a fleet.

    bench/soak --fleet 2 [--models 4] [--slots 2] [--concurrency 16] [--drop 0.25]
                         [--duration 600] [--json PATH]

A sampler asks each host's systemd once a second which engine units run: never more than
its max_engines (SLOTS). At the end each host's own metrics say what it answered, per
model: where each model lived. Passed: no errors, no host over its slots.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.soak import Clients, Requests, Spec, pct
from tests.fleet import DEADLINE_S, Host, running_fleet, status, write_models
from tests.haproxy import free_port, running_haproxy


@dataclass
class HostSamples:
    """What one host's systemd ran, sampled. A sample over the slots counts where the one
    before it was over too: the reads of one sample are not one moment (units, then their
    processes), and a swap every second can fall between them; a real excess stays."""
    samples: int = 0
    max_units: int = 0
    over_slots: int = 0
    errors: int = 0
    models_seen: Counter[str] = field(default_factory=Counter)   # samples running each
    last_over: bool = False


def sample(hosts: Sequence[Host], slots: int, interval: float, stop: threading.Event
           ) -> list[HostSamples]:
    """Each host's engine units every interval until stop (a thread of its own: the
    containers are asked through subprocesses)."""
    seen = [HostSamples() for _ in hosts]
    while not stop.wait(interval):
        for host, s in zip(hosts, seen, strict=True):
            try:
                running = host.engines()
            except Exception:   # a sample lost is counted, never the soak's end
                s.errors += 1
                continue
            s.samples += 1
            s.max_units = max(s.max_units, len(running))
            over = len(running) > slots
            s.over_slots += over and s.last_over
            s.last_over = over
            s.models_seen.update(running)
    return seen


def soak_through(url: str, hosts: Sequence[Host], spec: Spec, models: Sequence[str]
                 ) -> dict[str, Any]:
    """Spec's load at url (the balancer) for its warm-up + duration, hosts sampled; the
    result, with passed and the reasons it did not."""
    requests = Requests()
    clients = Clients(spec, url, models, requests, random.Random(spec.seed))
    stop = threading.Event()
    sampled: list[HostSamples] = []
    sampler = threading.Thread(target=lambda: sampled.extend(
        sample(hosts, spec.slots, spec.interval, stop)))
    before = [h.answered_by_model() for h in hosts]
    t0 = time.monotonic()
    sampler.start()
    try:
        asyncio.run(clients.load(spec.warmup_s() + spec.duration))
    finally:
        stop.set()
        sampler.join(DEADLINE_S)
    wall = time.monotonic() - t0
    after = [h.answered_by_model() for h in hosts]
    served = [{m: round(a.get(m, 0) - b.get(m, 0)) for m in models}
              for a, b in zip(after, before, strict=True)]
    errors = sum(requests.errors.values())
    reasons = [f"{errors} errors"] if errors else []
    if len(sampled) != len(hosts):   # the sampler never ended: nothing it saw can be told
        reasons.append("the hosts' sampler did not end")
        sampled = [HostSamples() for _ in hosts]
    reasons += [f"host {i}: no sample of its engines ({s.errors} failed)"
                for i, s in enumerate(sampled) if s.samples == 0]
    reasons += [f"host {i}: {s.over_slots} samples over {spec.slots} engines"
                for i, s in enumerate(sampled) if s.over_slots]
    lat = sorted(requests.latencies_ms)
    return {
        "spec": asdict(spec), "hosts": len(hosts), "wall_s": round(wall, 1),
        "requests": {"total": requests.ok + requests.dropped + errors, "ok": requests.ok,
                     "dropped": requests.dropped, "errors": errors,
                     "errors_by_code": dict(requests.errors.most_common()),
                     "error_examples": requests.examples,
                     "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)},
        "answered_200_by_host_and_model": served,
        "samples": [{"samples": s.samples, "max_units": s.max_units,
                     "over_slots": s.over_slots, "sample_errors": s.errors,
                     "models_seen": dict(s.models_seen)} for s in sampled],
        "passed": not reasons, "reasons": reasons,
    }


def run_fleet(spec: Spec, count: int) -> dict[str, Any]:
    """count gateways over spec.models tiny models with max_engines = spec.slots each,
    HAProxy in front, the soak through it."""
    models = [f"soak{i}" for i in range(spec.models)]
    with tempfile.TemporaryDirectory(prefix="soak-fleet-") as tmp:
        folder = write_models(Path(tmp) / "models", models)
        with running_fleet(folder, notice_s=(0,) * count, max_engines=spec.slots) as hosts:
            front = free_port()
            with running_haproxy(Path(tmp), front, [h.port for h in hosts]):
                url = f"http://127.0.0.1:{front}"
                deadline = time.monotonic() + DEADLINE_S
                while status(f"{url}/ready") != 200:
                    if time.monotonic() > deadline:
                        raise RuntimeError("haproxy never answered /ready")
                    time.sleep(0.1)
                return soak_through(url, hosts, spec, models)


def markdown(result: dict[str, Any]) -> str:
    """The result as a table, one row per figure."""
    spec, req = result["spec"], result["requests"]
    rows = [("gateways / models / slots each / clients / drop",
             f"{result['hosts']} / {spec['models']} / {spec['slots']} / "
             f"{spec['concurrency']} / {spec['drop']:.0%}"),
            ("load, wall", f"{spec['warmup']:.0f} + {spec['duration']:.0f} s, "
                           f"{result['wall_s']} s"),
            ("requests / ok / dropped", f"{req['total']} / {req['ok']} / {req['dropped']}"),
            ("**errors**", str(req["errors"]))]
    rows += [(f"  error {code}", str(n)) for code, n in req["errors_by_code"].items()]
    rows.append(("latency p50 / p99 of ok (ms)", f"{req['p50_ms']} / {req['p99_ms']}"))
    for i, (served, s) in enumerate(zip(result["answered_200_by_host_and_model"],
                                        result["samples"], strict=True)):
        rows.append((f"host {i}: answered 200 by model",
                     ", ".join(f"{m} {n}" for m, n in served.items())))
        rows.append((f"host {i}: max engine units in a sample (slots {spec['slots']}) / "
                     "over in two samples in a row",
                     f"{s['max_units']} / {s['over_slots']}"))
    rows.append(("verdict", "PASS" if result["passed"] else
                 "FAIL: " + "; ".join(result["reasons"])))
    return "\n".join(["| | fleet |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])
