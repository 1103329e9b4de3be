"""A second real llm-gateway as the remote upstream: the gateway under test (system
manager, real llama-server engines) routes a model only the peer serves, spills a local
model over to it, records both sides, and answers fast and clearly once the peer is gone.

The peer runs in root's own user manager (user@0.service): its engines are units of that
manager, so neither gateway sees, adopts or evicts the other's engines, as on two boxes.
(Its down / slow / 500 / broken-stream cases are tests/http/test_upstreams.py's, on a fake
upstream.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import GatewayService, toml_str
from tests.integration.test_front_door_e2e import records

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

PEER_PORT = 18490
PEER_UNIT = "llm-gateway-peer.service"
USER_ENV = {"XDG_RUNTIME_DIR": "/run/user/0",
            "DBUS_SESSION_BUS_ADDRESS": "unix:path=/run/user/0/bus"}


def user_systemctl(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemctl", "--user", *args], env={**os.environ, **USER_ENV},
                          capture_output=True, text=True, check=check)


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def wait_for(check: Any, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.05)
    return result


@pytest.fixture
def peer(tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> Iterator[str]:
    """The peer gateway's base URL: it serves far-gamma (only it) and tiny-beta (both)."""
    subprocess.run(["loginctl", "enable-linger", "root"], check=True)
    wait_for(lambda: Path("/run/user/0/bus").is_socket(), "root's user manager")
    models = tmp_path / "peer-models"
    models.mkdir()
    (models / "far-gamma.gguf").symlink_to(tiny_models["gamma"])
    (models / "tiny-beta.gguf").symlink_to(tiny_models["beta"])
    config = tmp_path / "peer.toml"
    config.write_text(f"""
models_dir = {toml_str(str(models))}
llama_server = {toml_str(str(llama_server))}
state_dir = {toml_str(str(tmp_path / "peer-state"))}
bus = "user"
[listen]
port = {PEER_PORT}
[admin]
public = true
""")
    subprocess.run(["systemd-run", "--user", "--quiet", f"--unit={PEER_UNIT}",
                    "-p", f"WorkingDirectory={os.getcwd()}",
                    sys.executable, "-m", "gatewayd", "--config", str(config), "serve"],
                   env={**os.environ, **USER_ENV}, check=True)
    url = f"http://127.0.0.1:{PEER_PORT}"

    def answers() -> bool:
        try:
            return bool(get(url + "/health"))
        except OSError:
            return False
    try:
        wait_for(answers, "the peer gateway")
        yield url
    finally:
        user_systemctl("stop", PEER_UNIT)
        user_systemctl("stop", "llm-engine-*")
        user_systemctl("reset-failed")
        subprocess.run(["loginctl", "disable-linger", "root"], check=False)


def client(gw: GatewayService) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_second_gateway_serves_remote_and_spilled_models_and_its_loss_is_clear(
        gateway_factory: GatewayFactory, peer: str, tiny_models: dict[str, Path]) -> None:
    gw = gateway_factory(extra=f"""
[upstreams.peer]
url = {toml_str(peer + "/v1")}
health_interval_s = 1
connect_timeout_s = 2

[models.tiny-beta]
path = {toml_str(str(tiny_models["beta"]))}
spill_over = true
""")
    def listed() -> dict[str, Any]:
        rows = {m["id"]: m for m in gw.api("GET", "/v1/models")[1]["data"]}
        return rows if "far-gamma" in rows else {}
    rows = wait_for(listed, "far-gamma discovered from the peer")
    assert rows["far-gamma"]["upstream"] == "peer" and rows["far-gamma"]["state"] == "remote"
    assert rows["tiny-beta"]["spill_over"] == ["peer"]

    sdk = client(gw)
    # only the peer has it: its engine starts there, under its own manager
    answer = sdk.chat.completions.create(model="far-gamma", max_tokens=3,
                                         messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    chunks = list(sdk.chat.completions.create(
        model="far-gamma", max_tokens=4, stream=True,
        messages=[{"role": "user", "content": "hi"}]))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    assert "llm-engine-far" in user_systemctl("list-units", "--plain", "--no-legend",
                                              "llm-engine-*").stdout
    assert "far" not in subprocess.run(["systemctl", "list-units", "--plain", "--no-legend",
                                        "llm-engine-*"], capture_output=True,
                                       text=True).stdout
    # tiny-beta is local and stopped here, warm on the peer (asked there directly): told
    # not to load a model (?autoload=false, which the peer is told too), it spills over to
    # the peer; asked plainly, it starts here and answers here
    warm = openai.OpenAI(base_url=peer + "/v1", api_key="unused", max_retries=0)
    assert warm.chat.completions.create(model="tiny-beta", max_tokens=1, messages=[
        {"role": "user", "content": "hi"}]).usage is not None
    spilled = sdk.chat.completions.create(
        model="tiny-beta", max_tokens=2, extra_query={"autoload": "false"},
        messages=[{"role": "user", "content": "hi"}])
    assert spilled.usage is not None and spilled.usage.completion_tokens == 2
    local = sdk.chat.completions.create(model="tiny-beta", max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
    assert local.usage is not None
    rows_ = records(gw, 4)
    route = sorted((r["model"], r["upstream"] or r["engine"], r["stream"], r["completion_tokens"])
                   for r in rows_)
    assert route == [("far-gamma", "peer", 0, 3), ("far-gamma", "peer", 1, 4),
                     ("tiny-beta", "llm-engine-tiny\\x2dbeta.service", 0, 2),
                     ("tiny-beta", "peer", 0, 2)], route
    # the peer kept its own records of what it answered for us
    theirs = wait_for(lambda: len(rows := get(peer + "/admin/records?limit=10")["records"])
                      >= 4 and rows, "the peer's records")
    assert sorted(r["model"] for r in theirs) == ["far-gamma", "far-gamma", "tiny-beta",
                                                  "tiny-beta"]

    # the peer dies: a clear, fast answer naming it, then "unreachable" until it is back
    user_systemctl("kill", "--signal=SIGKILL", PEER_UNIT, check=True)
    wait_for(lambda: user_systemctl("is-active", PEER_UNIT).stdout.strip() != "active",
             "the peer gone")
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        sdk.chat.completions.create(model="far-gamma", max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 5
    assert e.value.status_code in (502, 503) and "'peer'" in str(e.value)
    status = wait_for(lambda: "upstream peer" in (out := gw.cli("status").stdout) and
                      "down" in out and out, "the peer shown down")
    assert f"127.0.0.1:{PEER_PORT}" in status
    # the local model is untouched by it
    assert sdk.chat.completions.create(model="tiny-beta", max_tokens=1, messages=[
        {"role": "user", "content": "hi"}]).usage is not None
