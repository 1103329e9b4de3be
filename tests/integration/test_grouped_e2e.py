"""Grouped scheduling in a real systemd (issue 51): three real models over two places,
clients on all three at once (70/20/10), under `schedule = "fifo"` and the default `"grouped"`.
Every request is answered, and systemd's own journal counts the engine starts: grouped
starts far fewer units for the same traffic (each swap serves the requests that waited
for it instead of one per change of model), and no request waited past its bound."""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import GatewayService, stop_all_engine_units

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

MODELS = ("tiny-alpha", "tiny-beta", "tiny-gamma")
# a team's mix: a chat model most asked, a coder, an embedder now and then. (With a
# uniform mix over tiny models, whose loads take far longer than their answers, every
# order swaps about once per load time: all clients pile onto the missing model during
# any load. The mixed benchmark measures realistic sizes: docs/benchmarks.md.)
WEIGHTS = (70, 20, 10)
CLIENTS = 9
SECONDS = 15.0
MAX_WAIT_S = 3.0


@dataclass
class Traffic:
    answers: int = 0
    failures: list[str] = field(default_factory=list)
    longest_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


def ask(gw: GatewayService, model: str) -> tuple[int, str]:
    body = json.dumps({"model": model, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(gw.url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:300]


def drive(gw: GatewayService, seed: int) -> Traffic:
    """CLIENTS closed-loop clients, each asking a random model, for SECONDS."""
    traffic = Traffic()
    until = time.monotonic() + SECONDS

    def client(n: int) -> None:
        rng = random.Random(seed * 100 + n)
        while time.monotonic() < until:
            t0 = time.monotonic()
            status, text = ask(gw, rng.choices(MODELS, WEIGHTS)[0])
            took = time.monotonic() - t0
            with traffic.lock:
                traffic.longest_s = max(traffic.longest_s, took)
                if status == 200:
                    traffic.answers += 1
                else:
                    traffic.failures.append(f"{status} {text}")
    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=SECONDS + 180)
    return traffic


def unit_starts(since: float) -> int:
    """The engine units systemd started since then, by its own journal."""
    subprocess.run(["journalctl", "--sync"], check=False)
    out = subprocess.run(["journalctl", "_PID=1", "--since", f"@{since:.3f}", "-o", "cat",
                          "--no-pager"], capture_output=True, text=True, check=False).stdout
    return sum(1 for line in out.splitlines()
               if line.startswith("Started llm-engine-"))


def run(gateway_factory: GatewayFactory, schedule: str) -> tuple[Traffic, int]:
    gw = gateway_factory(max_engines=2, extra=f'schedule = "{schedule}"\n'
                         f"max_wait_s = {MAX_WAIT_S}\nparked_engines = 0\n")
    for model in MODELS[:2]:   # two places taken before the traffic starts
        assert ask(gw, model)[0] == 200
    since = time.time()
    traffic = drive(gw, seed=7)
    starts = unit_starts(since)
    gw.stop()
    stop_all_engine_units()
    return traffic, starts


def test_grouped_starts_far_fewer_units_than_fifo_and_answers_everyone(
        gateway_factory: GatewayFactory) -> None:
    fifo, fifo_starts = run(gateway_factory, "fifo")
    grouped, grouped_starts = run(gateway_factory, "grouped")
    said = (f"fifo: {fifo.answers} answers, {fifo_starts} unit starts, longest "
            f"{fifo.longest_s:.1f}s; grouped: {grouped.answers} answers, {grouped_starts} "
            f"unit starts, longest {grouped.longest_s:.1f}s")
    print(said)
    assert fifo.failures == [] and grouped.failures == [], said
    assert fifo_starts >= 8, f"too little swapping under fifo to compare: {said}"
    # the same traffic: grouped swaps per answer far less often
    assert grouped_starts / grouped.answers <= 0.5 * fifo_starts / fifo.answers, said
    # the bound: max_wait_s, the drain of 2-token answers and one load of a tiny model
    assert grouped.longest_s <= MAX_WAIT_S + 10.0, said
