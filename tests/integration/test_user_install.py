"""The user-mode install (scripts/install-user): the gateway under a user's own
systemctl --user manager, engines as transient units of that manager, no root, no polkit."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import make_tiny_model
import pytest

from tests.harness.container import SystemdContainer, why_unavailable
from tests.harness.plugin import ENGINE_CACHE, REPO, engine_binary, unavailable

pytestmark = [pytest.mark.container, pytest.mark.engine]


@pytest.fixture
def models() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="llmgw-umodels-", dir="/var/tmp"))
    make_tiny_model.write_model(str(path / "tiny-alpha.gguf"), "tiny-alpha", 0)
    path.chmod(0o755)   # readable by the container's unprivileged user
    (path / "tiny-alpha.gguf").chmod(0o644)
    yield path
    shutil.rmtree(path)


def test_user_install_runs_engines_under_the_users_manager(models: Path) -> None:
    if reason := why_unavailable():
        unavailable(reason)
    llama = engine_binary("LLAMA_SERVER")
    ro = [models] + ([ENGINE_CACHE] if ENGINE_CACHE.is_dir() else [])
    box = SystemdContainer(f"user-{os.getpid() % 100000}", binds=[REPO], binds_ro=ro)
    box.start()
    try:
        # On this VM the venv's interpreter lives under /root (pyenv); make it reachable
        # for other users inside the container only, like a system-wide Python would be.
        box.shell("chmod o+x /root")
        box.shell(f"useradd -m alice && install -m755 {llama} /usr/local/bin/llama-server && "
                  "loginctl enable-linger alice")
        uid = box.shell("id -u alice").strip()
        deadline = time.monotonic() + 30
        while box.exec("test", "-S", f"/run/user/{uid}/bus", check=False).returncode:
            assert time.monotonic() < deadline, "alice's user manager did not start"
            time.sleep(0.1)
        env = ["env", f"XDG_RUNTIME_DIR=/run/user/{uid}",
               f"DBUS_SESSION_BUS_ADDRESS=unix:path=/run/user/{uid}/bus"]

        def as_alice(script: str) -> str:
            return box.exec("runuser", "-u", "alice", "--", *env, "bash", "-c",
                            script).stdout

        out = as_alice(f"{REPO}/scripts/install-user 18700")
        assert "listens on http://127.0.0.1:18700" in out
        as_alice(f"cp {models}/tiny-alpha.gguf ~/.local/share/llm-gateway/models/ && "
                 "sed -i 's|^llama_server = .*|llama_server = \"/usr/local/bin/llama-server\"|'"
                 " ~/.config/llm-gateway/gateway.toml")
        answer = json.loads(as_alice(
            "curl -sf http://127.0.0.1:18700/v1/chat/completions "
            "-H 'Content-Type: application/json' -d "
            "'{\"model\":\"tiny-alpha\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
            "\"max_tokens\":2}'"))
        assert answer["usage"]["completion_tokens"] == 2
        units = as_alice("systemctl --user list-units --no-legend --plain 'llm-*'")
        assert "llm-gateway.service" in units and "llm-engine-tiny\\x2dalpha.service" in units
        # the CLI finds the user gateway's admin socket by itself (the admin API is not
        # on the port by default)
        status = json.loads(as_alice(str(REPO / ".venv/bin/llm-gateway") + " --json status"))
        assert "admin_not_public" in as_alice("curl -s http://127.0.0.1:18700/admin/status")
        assert status["unit_mode"] == "transient" and status["systemd_manager"] == "user"
        pid = as_alice("systemctl --user show -p MainPID --value "
                       "'llm-engine-tiny\\x2dalpha.service'").strip()
        assert box.shell(f"ps -o user= -p {pid}").strip() == "alice"
        sock = f"/run/user/{uid}/llm-engine-tiny\\x2dalpha/engine.sock"
        assert box.shell(f"stat -c '%U %a' '{sock}'").split() == ["alice", "700"]
        # the state went to the user's StateDirectory= (~/.config before systemd 254,
        # ~/.local/state after), not /var/lib
        state = as_alice("ls ~/.local/state/llm-gateway ~/.config/llm-gateway 2>/dev/null; "
                         "true")
        assert "records.db" in state and "engines.json" in state
    finally:
        box.stop()
