"""The engine layer for real: the gateway runs engines as units of a real systemd.

Inside the test container (marker `systemd`): the gateway is a service of the
container's PID 1, talks D-Bus to it, and runs the real llama-server and
whisper-server builds on generated models.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from gatewayd.core.engine_units import EngineLayout
from tests.integration.conftest import GatewayFactory
from tests.integration.engine_helpers import cgroup_exists, process_ended
from tests.integration.gateway_helpers import (
    GatewayService,
    journal_until,
    tcp_listeners,
    toml_str,
    unit_property,
)

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

HOSTILE_ID = '../../x $(touch /tmp/pwned) ${HOME} %n "q";`id`'


def test_two_models_two_units_private_sockets_no_tcp(gateway: GatewayService) -> None:
    before = tcp_listeners()
    for model in ("tiny-alpha", "TINY-BETA.gguf"):  # any alias works
        proc = gateway.cli("start", model)
        assert proc.returncode == 0, proc.stderr
        assert "ready" in proc.stdout
    engines = gateway.engines()
    assert set(engines) == {"tiny-alpha", "tiny-beta"}
    for model, engine in engines.items():
        layout = EngineLayout.for_model(model)
        assert engine["unit"] == layout.unit and engine["state"] == "ready"
        assert unit_property(layout.unit, "ActiveState") == "active"
        assert unit_property(layout.unit, "MainPID") == str(engine["pid"])
        assert unit_property(layout.unit, "Slice") == "llm-engines.slice"
        mode = os.stat(layout.socket).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o700  # srwx------
        assert Path(f"/proc/{engine['pid']}/exe").resolve().name == "llama-server"
    assert tcp_listeners() == before  # no engine opened a TCP port
    table = gateway.cli("engines").stdout
    assert "tiny-alpha" in table and "tiny-beta" in table and "ready" in table


def test_kill_9_systemd_restarts_and_gateway_sees_restarting_then_ready(
        gateway: GatewayService) -> None:
    assert gateway.cli("start", "tiny-alpha").returncode == 0
    first = gateway.engines()["tiny-alpha"]
    os.kill(first["pid"], signal.SIGKILL)
    again = gateway.wait_engine("tiny-alpha", lambda e: e["state"] == "ready"
                                and e["restarts"] == 1 and e["pid"] != first["pid"])
    assert again["failure"] is None
    log = gateway.journal()
    killed_at = log.index("tiny-alpha: ready -> restarting (killed by SIGKILL)")
    assert "tiny-alpha: loading -> ready" in log[killed_at:]
    assert "tiny-alpha: restarting -> failed" not in log
    assert unit_property(again["unit"], "NRestarts") == "1"


def test_a_frozen_engine_is_killed_and_restarted_and_its_request_answered(
        gateway_factory: GatewayFactory) -> None:
    """kill -STOP on the engine: its /health goes silent; after the misses the gateway
    kills the unit, systemd restarts it. The request relayed to the frozen engine was never
    read by it (stopped, its socket closes with the request unread: ECONNRESET), so it
    waits for the restarted engine and is answered, in bounded time (not read_timeout_s);
    others are served all along."""
    gw = gateway_factory(extra="[health]\ninterval_s = 0.5\ntimeout_s = 0.5\nmisses = 3\n")
    for model in ("tiny-alpha", "tiny-beta"):
        assert gw.cli("start", model).returncode == 0
    frozen = gw.engines()["tiny-alpha"]
    os.kill(frozen["pid"], signal.SIGSTOP)
    try:
        began = time.monotonic()
        status, body = gw.api("POST", "/v1/completions",
                              {"model": "tiny-alpha", "prompt": "hi", "max_tokens": 2})
        assert time.monotonic() - began < 15, body
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        status, body = gw.api("POST", "/v1/completions",
                              {"model": "tiny-beta", "prompt": "hi", "max_tokens": 2})
        assert status == 200, body
        again = gw.wait_engine("tiny-alpha", lambda e: e["state"] == "ready"
                               and e["pid"] != frozen["pid"])
        assert again["restarts"] == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen["pid"], signal.SIGCONT)
    status, body = gw.api("POST", "/v1/completions",
                          {"model": "tiny-alpha", "prompt": "hi", "max_tokens": 2})
    assert status == 200, body
    assert "tiny-alpha: no answer to /health for 1.5s: killing" in gw.journal()


def test_the_gateway_survives_a_restart_of_the_system_bus(
        gateway_factory: GatewayFactory) -> None:
    """systemctl restart dbus: the gateway reconnects (re-subscribes, re-lists), so the
    next start, an eviction and a crash are all seen as before; ready engines serve on."""
    gw = gateway_factory(max_engines=2)
    assert gw.cli("start", "tiny-alpha").returncode == 0
    subprocess.run(["systemctl", "restart", "dbus.service"], check=True, timeout=30)
    journal_until("reconnected to the system bus", "-u", gw.unit, timeout=30)
    for model in ("tiny-alpha", "tiny-beta", "tiny-gamma"):   # gamma evicts alpha
        status, body = gw.api("POST", "/v1/completions",
                              {"model": model, "prompt": "hi", "max_tokens": 2})
        assert status == 200, (model, body)
    engines = gw.wait_engine("tiny-beta", lambda e: e["state"] == "ready")
    assert "tiny-alpha" not in gw.engines(), gw.engines()
    os.kill(engines["pid"], signal.SIGKILL)                    # signals arrive again
    gw.wait_engine("tiny-beta", lambda e: e["state"] == "ready" and e["pid"] != engines["pid"])


def test_stop_kills_the_cgroup_and_removes_the_socket(
        gateway_factory: GatewayFactory) -> None:
    # not parked after the stop: its unit would be created again at once (test_parked_e2e)
    gateway = gateway_factory("parked_engines = 0\n")
    assert gateway.cli("start", "tiny-gamma").returncode == 0
    engine = gateway.engines()["tiny-gamma"]
    control_group = unit_property(engine["unit"], "ControlGroup")
    assert cgroup_exists(control_group)
    proc = gateway.cli("stop", "tiny-gamma")
    assert proc.returncode == 0 and "stopped" in proc.stdout
    assert process_ended(engine["pid"])
    deadline = time.monotonic() + 5   # cgroup and runtime directory go as the unit ends
    while cgroup_exists(control_group) or os.path.exists(engine["socket"]):
        assert time.monotonic() < deadline, "the cgroup or socket outlived the unit by 5 s"
        time.sleep(0.02)
    assert unit_property(engine["unit"], "LoadState") == "not-found"
    assert gateway.engines() == {}


def test_gateway_restart_adopts_running_engines_with_the_same_pids(
        gateway: GatewayService) -> None:
    for model in ("tiny-alpha", "tiny-beta"):
        assert gateway.cli("start", model).returncode == 0
    pids = {m: e["pid"] for m, e in gateway.engines().items()}
    gateway.stop()
    for pid in pids.values():  # the engines do not die with the gateway
        assert Path(f"/proc/{pid}").exists()
    gateway.start()
    for model, pid in pids.items():
        engine = gateway.wait_engine(model, lambda e: e["state"] == "ready")
        assert engine["pid"] == pid and engine["adopted"] and engine["restarts"] == 0
    assert "adopted tiny-alpha" in gateway.journal()


def test_logs_come_from_the_journal(gateway: GatewayService) -> None:
    assert gateway.cli("start", "tiny-beta").returncode == 0
    journal_until("listening", "-u", "llm-engine-tiny\\x2dbeta.service")
    proc = gateway.cli("logs", "tiny-beta", "-n", "200")
    assert proc.returncode == 0
    assert "listening" in proc.stdout and "llm-engine-tiny" in proc.stdout


def test_limits_give_the_documented_errors(gateway_factory: GatewayFactory) -> None:
    gw: GatewayService = gateway_factory(max_engines=2)
    for model in ("tiny-alpha", "tiny-beta"):
        assert gw.cli("start", model).returncode == 0
    status, body = gw.api("POST", "/admin/engines/start", {"model": "tiny-gamma"})
    assert status == 503 and body["error"]["code"] == "engine_limit_reached"
    assert sorted(body["error"]["running"]) == ["tiny-alpha", "tiny-beta"]
    status, body = gw.api("POST", "/admin/engines/start", {"model": "tiny-alpha"})
    assert status == 409 and body["error"]["code"] == "already_running"
    proc = gw.cli("start", "tiny-gamma")
    assert proc.returncode == 1 and "the limit (max_engines) is 2" in proc.stderr
    status, body = gw.api("POST", "/admin/engines/start", {"model": "no-such-model"})
    assert status == 404 and "tiny-alpha" in body["error"]["available_models"]


def test_engine_server_paths_relative_to_the_config_and_missing_ones_named(
        gateway_factory: GatewayFactory, llama_server: Path, tmp_path: Path) -> None:
    """One that is not there fails every start at once with the key named (never a
    wedged model) and is not put on the list restored after a reboot; a relative
    llama_server is taken from the configuration file's directory."""
    gw = gateway_factory(llama_server_setting="nowhere/llama-server")
    assert "llama_server = '" in journal_until("models that need it cannot start",
                                               "-u", gw.unit)
    for _ in range(2):
        began = time.monotonic()
        status, body = gw.api("POST", "/v1/completions",
                              {"model": "tiny-alpha", "prompt": "hi", "max_tokens": 2})
        assert status == 502 and body["error"]["code"] == "engine_failed", body
        assert "llama_server = " in body["error"]["message"]
        assert "no such file" in body["error"]["message"]
        assert time.monotonic() - began < 5
    assert gw.engines()["tiny-alpha"]["state"] == "failed"
    desired = tmp_path / "state" / "engines.json"
    assert not desired.exists() or "tiny-alpha" not in desired.read_text()
    gw.stop()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").symlink_to(llama_server)
    gw = gateway_factory(llama_server_setting="bin/llama-server")
    status, body = gw.api("POST", "/v1/completions",
                          {"model": "tiny-alpha", "prompt": "hi", "max_tokens": 2})
    assert status == 200, body


def test_vram_budget_with_a_fake_device(gateway_factory: GatewayFactory) -> None:
    gw = gateway_factory(
        env={"LLM_GATEWAY_FAKE_GPU": "24576:1000"})
    status, body = gw.api("POST", "/admin/engines/start", {"model": "tiny-alpha"})
    assert status == 503 and body["error"]["code"] == "insufficient_gpu"
    # the need: the GGUF estimate's VRAM part (weights, KV cache, compute, mmproj) + margin
    listed = gw.api("GET", "/v1/models/tiny-alpha")[1]
    assert listed["vram_estimate_source"] == "estimate", listed
    assert body["error"]["required_mib"] == listed["vram_estimate_mib"] > 1024
    assert body["error"]["free_mib"] == 1000
    status_body = gw.api("GET", "/admin/status")[1]
    assert "fake device" in status_body["gpu"]
    assert status_body["gpu_memory_mib"] == {
        "total": 24576, "free": 1000, "held_by_engines": 0, "pending_loads": 0,
        "external": 23576, "free_for_planning": 1000}
    assert gw.engines() == {}


def test_hostile_model_name_reaches_nothing_but_values(
        gateway_factory: GatewayFactory, tiny_models: dict[str, Path]) -> None:
    extra = f"[models.{toml_str(HOSTILE_ID)}]\npath = {toml_str(str(tiny_models['alpha']))}\n"
    gw: GatewayService = gateway_factory(extra=extra)
    status, body = gw.api("POST", "/admin/engines/start", {"model": HOSTILE_ID})
    assert status == 200, body
    engine = body["engine"]
    layout = EngineLayout.for_model(HOSTILE_ID)
    assert engine["unit"] == layout.unit and engine["socket"] == layout.socket
    assert os.path.dirname(layout.socket).startswith("/run/llm-engine-")
    argv = Path(f"/proc/{engine['pid']}/cmdline").read_bytes().split(b"\0")[:-1]
    assert argv[argv.index(b"--alias") + 1].decode() == HOSTILE_ID  # exactly, unexpanded
    assert not Path("/tmp/pwned").exists()
    journal_until("listening", f"LLM_GATEWAY_MODEL={HOSTILE_ID}")


def test_whisper_engine_is_reachable_only_through_its_unix_socket(
        gateway_factory: GatewayFactory, whisper_server: Path, tiny_whisper: Path,
        tmp_path: Path) -> None:
    extra = (f"whisper_server = {toml_str(str(whisper_server))}\n"
             f"[models.whisper-tiny]\npath = {toml_str(str(tiny_whisper))}\n"
             'backend = "whisper"\nthreads = 1\n')
    gw: GatewayService = gateway_factory(extra=extra)
    before = tcp_listeners()
    status, body = gw.api("POST", "/admin/engines/start", {"model": "whisper-tiny"})
    assert status == 200, body
    sock = body["engine"]["socket"]
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o700
    assert tcp_listeners() == before   # whisper listens in its own network namespace
    wav = tmp_path / "hello.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "hello world"], check=True)
    out = subprocess.run(
        ["curl", "-sS", "--unix-socket", sock, "http://engine/v1/audio/transcriptions",
         "-F", f"file=@{wav}", "-F", "temperature_inc=0", "-F", "response_format=json"],
        capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["text"].strip()
    pid = body["engine"]["pid"]
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")


def test_per_model_limits_reach_the_transient_unit(gateway_factory: GatewayFactory,
                                                   tiny_models: dict[str, Path]) -> None:
    gw = gateway_factory(extra=(
        f"[models.limited]\npath = {toml_str(str(tiny_models['beta']))}\n"
        'memory_max = "256M"\ncpu_quota = "50%"\ncuda_visible_devices = "1"\n'))
    status, body = gw.api("POST", "/admin/engines/start", {"model": "limited"})
    assert status == 200, body
    unit = body["engine"]["unit"]
    assert unit_property(unit, "MemoryMax") == str(256 << 20)
    assert unit_property(unit, "CPUQuotaPerSecUSec") == "500ms"
    assert "CUDA_VISIBLE_DEVICES=1" in unit_property(unit, "Environment")
