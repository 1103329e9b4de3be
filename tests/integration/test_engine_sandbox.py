"""A compromised engine is not the gateway (issue 33, finding 5), transient mode: the
gateway runs as root and its engines as user llm-engine in a sandbox. A process with the
engine's identity, inside the engine's own mount namespace, cannot read the call records
or a key file, connect to the admin socket, or start a unit; a model that user cannot
read is a clear error from the gateway, not an engine that fails to load.

Runs inside the test container (marker `systemd`), against real llama-server engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import COMPROMISED_ENGINE_PROBE, toml_str, unit_property

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

ENGINE = "llm-engine-tiny\\x2dalpha.service"
ADMIN_SOCKET = "/run/llm-gateway/admin.sock"

def probe(argv_prefix: list[str], records: Path, keys: Path) -> dict[str, str]:
    proc = subprocess.run([*argv_prefix, sys.executable, "-c", COMPROMISED_ENGINE_PROBE,
                           str(records), str(keys), ADMIN_SOCKET],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_a_compromised_engine_reaches_none_of_the_gateways_secrets(
        tmp_path: Path, gateway_factory: GatewayFactory) -> None:
    from gatewayd.core.auth import digest
    key = "sk-llmgw-sandbox-e2e"
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[keys.ops]\nsha256 = "{digest(key)}"\nmodels = ["*"]\n'
                    'scopes = ["admin", "inference"]\n')
    keys.chmod(0o644)   # the file's mode is no defence: the sandbox hides it
    gw = gateway_factory(extra=f"[auth]\nkeys_file = {toml_str(str(keys))}\n")
    gw.api_key = key
    status, answer = gw.api("POST", "/v1/chat/completions", {
        "model": "tiny-alpha", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    records = tmp_path / "state" / "records.db"
    gw.wait_engine("tiny-alpha", lambda e: e["state"] == "ready")
    assert records.exists() and Path(ADMIN_SOCKET).is_socket()

    # the engine: not root, not the gateway's user, the whole sandbox
    pid = int(unit_property(ENGINE, "MainPID"))
    uid = os.stat(f"/proc/{pid}").st_uid
    assert uid != 0 and uid != os.getuid()
    show = subprocess.run(["systemctl", "show", ENGINE, "-p", "User", "-p", "DynamicUser",
                           "-p", "ProtectSystem", "-p", "PrivateTmp", "-p", "NoNewPrivileges",
                           "-p", "RestrictAddressFamilies", "-p", "IPAddressDeny"],
                          capture_output=True, text=True, check=True).stdout
    for line in ("User=llm-engine", "DynamicUser=yes", "ProtectSystem=strict",
                 "PrivateTmp=yes", "NoNewPrivileges=yes", "RestrictAddressFamilies=AF_UNIX"):
        assert line in show, show
    deny = next(line for line in show.splitlines() if line.startswith("IPAddressDeny="))
    assert set(deny.split("=", 1)[1].split()) == {"0.0.0.0/0", "::/0"}, show
    security = subprocess.run(["systemd-analyze", "security", "--no-pager", ENGINE],
                              capture_output=True, text=True, check=True).stdout
    exposure = float(security.strip().splitlines()[-1].split(f"{ENGINE}:")[1].split()[0])
    assert exposure <= 2.5, security   # the gateway's own unit: 1.8 (docs/design.md)

    # the probe works: as root, outside the sandbox, it reaches everything ...
    assert set(probe([], records, keys).values()) == {"ok"}
    # ... but with the engine's identity, in the engine's own mount namespace, nothing
    inside = ["nsenter", "-t", str(pid), "-m", "setpriv", f"--reuid={uid}", f"--regid={uid}",
              "--clear-groups", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
    denied = probe(inside, records, keys)
    assert all(result != "ok" for result in denied.values()), denied
    assert all(denied[what].startswith("PermissionError: [Errno 13]")
               for what in ("records", "keys", "admin_socket")), denied


def test_a_model_the_engine_user_cannot_read_is_a_clear_error(
        tmp_path: Path, gateway_factory: GatewayFactory) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    model = tmp_path / "models" / "tiny-alpha.gguf"
    gw = gateway_factory()
    hidden = private / "tiny-alpha.gguf"
    hidden.write_bytes(model.resolve().read_bytes())
    model.unlink()
    model.symlink_to(hidden)
    status, answer = gw.api("POST", "/v1/chat/completions", {
        "model": "tiny-alpha", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    message = answer["error"]["message"]
    assert status == 502 and "not readable by the engine user llm-engine" in message, message
    assert f"{private} (mode 0700) does not let user llm-engine search" in message, message
