"""Faults injected into a real systemd: every one ends in a clear answer in bounded time,
no model is left wedged, and the gateway serves the other models throughout.

The engine binary is a wrapper around the real llama-server that misbehaves for some
models: tiny-gamma exits at once (crash loop), tiny-beta never becomes ready, tiny-alpha
is the real thing (slow to start while a flag file exists). Also: an engine killed while it
loads, a crash loop that ends at systemd's start limit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import GatewayService, journal_until

pytestmark = [pytest.mark.systemd, pytest.mark.engine]


@pytest.fixture
def wrapper(tmp_path: Path, llama_server: Path) -> tuple[str, Path]:
    slow = tmp_path / "alpha-is-slow"
    script = tmp_path / "engine.sh"
    script.write_text(f"""#!/bin/sh
case "$*" in
  *tiny-gamma.gguf*) echo "engine: cannot load the model (injected)" >&2; exit 3 ;;
  *tiny-beta.gguf*) exec sleep 3600 ;;
  *tiny-alpha.gguf*) [ -e {slow} ] && sleep 3 ;;
esac
exec {llama_server} "$@"
""")
    script.chmod(0o755)
    return str(script), slow


def complete(gw: GatewayService, model: str) -> tuple[int, Any, float]:
    began = time.monotonic()
    status, body = gw.api("POST", "/v1/completions",
                          {"model": model, "prompt": "hi", "max_tokens": 2})
    return status, body, time.monotonic() - began


def test_engines_that_exit_at_once_or_never_load_end_in_clear_answers(
        gateway_factory: GatewayFactory, wrapper: tuple[str, Path]) -> None:
    gw = gateway_factory(llama_server_setting=wrapper[0], load_timeout_s=4)
    # exits at once: systemd restarts it (the request waits, as for any restart) until
    # its start limit (5 starts: ~5 s at RestartSec=1); then the answer says both
    status, body, took = complete(gw, "tiny-gamma")
    assert status == 502 and body["error"]["code"] == "engine_failed", body
    assert ("exited with status 3; systemd gave up restarting it after 5 restart(s)"
            in body["error"]["message"]) and took < 15, (took, body)
    # the journal's lines are the admin's (the API, the CLI), never an inference caller's
    assert "log_tail" not in body["error"]["failure"]
    # journald may write the engine's last line after systemd reports the exit: the
    # gateway reads the tail again, so it shows up within a few seconds
    gw.wait_engine("tiny-gamma", lambda e: e["failure"] is not None and any(
        "cannot load the model (injected)" in line for line in e["failure"]["log_tail"]))
    assert complete(gw, "tiny-alpha")[0] == 200                # the others are served
    status, body, took = complete(gw, "tiny-beta")             # never ready
    assert status == 502 and "not ready after 4s" in body["error"]["message"], body
    assert took < 15
    # failed first (LoadTimedOut), then its unit is stopped: wait for both, bounded
    beta = gw.wait_engine("tiny-beta", lambda e: e["state"] == "failed"
                          and e["pid"] in (0, None))
    assert beta["failure"] is not None
    for model in ("tiny-gamma", "tiny-beta"):                  # asked again: answered again
        status, body, took = complete(gw, model)   # (within its backoff, or tried again)
        assert status == 502 and body["error"]["code"] == "engine_failed" and took < 15, body
    assert complete(gw, "tiny-alpha")[0] == 200
    assert all(e["state"] != "starting" for e in gw.engines().values()), gw.engines()
    # failed for good at the start limit, its unit gone; the next request starts it
    # afresh (after the backoff) and is answered the same way
    gamma = gw.wait_engine("tiny-gamma", lambda e: e["state"] == "failed", timeout=30)
    assert gamma["pid"] in (0, None)
    status, body, took = complete(gw, "tiny-gamma")
    assert status == 502 and body["error"]["code"] == "engine_failed" and took < 15, body


def test_an_engine_killed_while_it_loads_is_restarted_and_its_request_answered(
        gateway_factory: GatewayFactory, wrapper: tuple[str, Path]) -> None:
    gw = gateway_factory(llama_server_setting=wrapper[0])
    wrapper[1].touch()                                         # alpha takes 3 s to start
    answers: list[tuple[int, Any, float]] = []
    client = threading.Thread(target=lambda: answers.append(complete(gw, "tiny-alpha")))
    client.start()
    loading = gw.wait_engine("tiny-alpha", lambda e: e["state"] in ("starting", "loading")
                             and e["pid"])
    os.kill(loading["pid"], signal.SIGKILL)                    # mid-load
    client.join(60)
    (status, body, took), = answers
    # it was waiting in the gateway, not on the engine: it waits for systemd's restart
    # (RestartSec, then the slow start again) and is answered by the restarted engine
    assert status == 200 and took < 30, (body, gw.journal())
    again = gw.wait_engine("tiny-alpha", lambda e: e["state"] == "ready", timeout=30)
    assert again["pid"] != loading["pid"] and again["restarts"] == 1
    assert complete(gw, "tiny-alpha")[0] == 200


def test_a_gateway_killed_during_an_engine_start_adopts_the_engine_when_back(
        gateway_factory: GatewayFactory, wrapper: tuple[str, Path]) -> None:
    gw = gateway_factory(llama_server_setting=wrapper[0])
    wrapper[1].touch()                                         # alpha takes 3 s to start
    client = subprocess.Popen(["curl", "-s", "-o", "/dev/null", "-X", "POST",
                               "-H", "Content-Type: application/json",
                               f"{gw.url}/admin/engines/start", "-d",
                               '{"model": "tiny-alpha"}'])
    try:
        gw.wait_engine("tiny-alpha", lambda e: e["state"] in ("starting", "loading"))
        subprocess.run(["systemctl", "kill", "-s", "KILL", gw.unit], check=True)
    finally:
        client.wait(timeout=30)
    deadline = time.monotonic() + 10
    while subprocess.run(["systemctl", "is-active", "--quiet", gw.unit]).returncode == 0:
        assert time.monotonic() < deadline, "the gateway did not die"
        time.sleep(0.05)
    gw.start()                                                 # back: the unit is adopted
    alpha = gw.wait_engine("tiny-alpha", lambda e: e["state"] == "ready", timeout=30)
    assert alpha["restarts"] == 0
    units = subprocess.run(["systemctl", "list-units", "--plain", "--no-legend",
                            "llm-engine-tiny*"], capture_output=True, text=True).stdout
    assert len(units.strip().splitlines()) == 1, units
    assert complete(gw, "tiny-alpha")[0] == 200


def test_daemon_reload_and_reexec_change_nothing(gateway: GatewayService) -> None:
    assert gateway.cli("start", "tiny-alpha").returncode == 0
    subprocess.run(["systemctl", "daemon-reload"], check=True, timeout=60)
    assert complete(gateway, "tiny-alpha")[0] == 200
    assert complete(gateway, "tiny-beta")[0] == 200            # a start after the reload
    subprocess.run(["systemctl", "daemon-reexec"], check=True, timeout=60)
    assert complete(gateway, "tiny-gamma")[0] == 200           # a start after the reexec
    alpha = gateway.engines()["tiny-alpha"]
    os.kill(alpha["pid"], signal.SIGKILL)                      # signals arrive as before
    gateway.wait_engine("tiny-alpha", lambda e: e["state"] == "ready"
                        and e["pid"] != alpha["pid"])
    assert complete(gateway, "tiny-alpha")[0] == 200


def test_a_full_or_read_only_state_directory_never_stops_serving(
        gateway_factory: GatewayFactory, tmp_path: Path) -> None:
    """The records database on a 128 KiB tmpfs that fills up, and a state directory that
    turns read-only: requests are served throughout, the loss is counted and logged."""
    records_dir = tmp_path / "records"
    records_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(records_dir)],
                   check=True)
    try:
        gw = gateway_factory(extra=f'[records]\npath = "{records_dir}/records.db"\n'
                                   "store_text = true\ntext_max_bytes = 65536\n")
        prompt = "x" * 1500                        # ~3 KB of text per record: full soon
        for _ in range(120):
            status, body = gw.api("POST", "/v1/completions",
                                  {"model": "tiny-alpha", "prompt": prompt, "max_tokens": 1})
            assert status == 200, body
        deadline = time.monotonic() + 20
        while gw.api("GET", "/admin/status")[1]["records_dropped"] == 0:
            assert time.monotonic() < deadline, "no record was ever dropped: not full?"
            time.sleep(0.2)
        assert "dropped" in gw.journal() and "full" in gw.journal()
        state = tmp_path / "state"                 # now the state directory turns read-only
        subprocess.run(["mount", "--bind", "-o", "ro", str(state), str(state)], check=True)
        try:
            status, body = gw.api("POST", "/v1/completions",
                                  {"model": "tiny-beta", "prompt": "hi", "max_tokens": 1})
            assert status == 200, body             # started all the same
            # written in the background, a moment after the start
            journal_until("could not update the desired engine list", "-u", gw.unit)
        finally:
            subprocess.run(["umount", str(state)], check=False)
    finally:
        subprocess.run(["umount", "--lazy", str(records_dir)], check=False)
