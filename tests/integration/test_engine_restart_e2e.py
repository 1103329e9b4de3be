"""An engine restart is a wait, not an error (issue 41), with a real llama-server in a
real systemd: under a steady loop of requests, an engine killed (SIGKILL) or frozen
(SIGSTOP, until the liveness check kills it) is restarted by systemd, and every request
sent once it is dead is answered 200 by the restarted engine; only the ones that were on
the dead process may fail. The gateway's journal shows one restart per kill:
ready → restarting → loading → ready, never failed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.engine_helpers import process_ended
from tests.integration.gateway_helpers import GatewayService

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

RESTART_SEC = 1.0      # the engine units' RestartSec
MARGIN_S = 10.0        # the restarted tiny model's start and load, on a slow machine


@dataclass
class Loop:
    """Clients sending completions back to back; each answer kept with when it was sent."""

    gw: GatewayService
    model: str
    clients: int = 2
    answers: list[tuple[float, float, int, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Loop:
        for _ in range(self.clients):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _run(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "hi", "max_tokens": 2}).encode()
        while not self._stop.is_set():
            sent = time.monotonic()
            req = urllib.request.Request(self.gw.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    status, text = resp.status, ""
                    resp.read()
            except urllib.error.HTTPError as e:
                status, text = e.code, e.read().decode(errors="replace")
            self.answers.append((sent, time.monotonic(), status, text))

    def count_after(self, t: float) -> int:
        return sum(1 for sent, *_ in self.answers if sent > t)


def wait_for(what: str, condition: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def assert_one_restart(gw: GatewayService, model: str, reason: str) -> None:
    """The journal's transitions of model: one restart with its reason, never failed."""
    lines = [m.group(0) for line in gw.journal().splitlines()
             if (m := re.search(rf"{model}: \w+ -> \w+.*", line))]
    walk = [re.sub(r" after \d+ ms", "", line) for line in lines]
    assert any(f"{model}: ready -> restarting ({reason}" in line for line in walk), lines
    after = walk[next(i for i, line in enumerate(walk) if "ready -> restarting" in line):]
    assert after[1:3] == [f"{model}: restarting -> loading", f"{model}: loading -> ready"], \
        lines
    assert not any("-> failed" in line for line in lines), lines


def test_requests_sent_while_systemd_restarts_a_killed_engine_are_all_served(
        gateway: GatewayService) -> None:
    assert gateway.cli("start", "tiny-alpha").returncode == 0
    first = gateway.engines()["tiny-alpha"]
    with Loop(gateway, "tiny-alpha") as loop:
        wait_for("the loop runs", lambda: len(loop.answers) >= 10)
        os.kill(first["pid"], signal.SIGKILL)
        wait_for("the engine is dead", lambda: process_ended(first["pid"]))
        dead = time.monotonic()
        again = gateway.wait_engine("tiny-alpha", lambda e: e["state"] == "ready"
                                    and e["pid"] != first["pid"], timeout=30)
        back = time.monotonic()
        wait_for("requests after the restart", lambda: loop.count_after(back) >= 10)
    after_death = [a for a in loop.answers if a[0] > dead]
    assert after_death and all(status == 200 for _, _, status, _ in after_death), \
        [a for a in after_death if a[2] != 200][:3]
    assert max(done - sent for sent, done, _, _ in after_death) < RESTART_SEC + MARGIN_S
    assert again["restarts"] == 1
    assert_one_restart(gateway, "tiny-alpha", "killed by SIGKILL")


def test_requests_sent_while_a_frozen_engine_is_killed_and_restarted_are_all_served(
        gateway_factory: GatewayFactory) -> None:
    gw = gateway_factory(extra="[health]\ninterval_s = 0.5\ntimeout_s = 0.5\nmisses = 3\n")
    assert gw.cli("start", "tiny-alpha").returncode == 0
    frozen = gw.engines()["tiny-alpha"]
    try:
        with Loop(gw, "tiny-alpha") as loop:
            wait_for("the loop runs", lambda: len(loop.answers) >= 10)
            os.kill(frozen["pid"], signal.SIGSTOP)
            restarting = gw.wait_engine("tiny-alpha", lambda e: e["state"] == "restarting")
            killed = time.monotonic()   # from now on the gateway sends nothing to it
            gw.wait_engine("tiny-alpha", lambda e: e["state"] == "ready"
                           and e["pid"] != frozen["pid"], timeout=30)
            back = time.monotonic()
            wait_for("requests after the restart", lambda: loop.count_after(back) >= 10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen["pid"], signal.SIGCONT)
    assert "(hung)" in restarting["failure"]["reason"]
    after_kill = [a for a in loop.answers if a[0] > killed]
    assert after_kill and all(status == 200 for _, _, status, _ in after_kill), \
        [a for a in after_kill if a[2] != 200][:3]
    # the ones on the frozen process: an error each, in bounded time, never replayed
    on_frozen = [a for a in loop.answers if a[0] <= killed and a[2] != 200]
    assert all(status == 502 for _, _, status, _ in on_frozen), on_frozen
    assert_one_restart(gw, "tiny-alpha", "did not answer /health")
