"""The admin API on its own unix socket, on the real gateway in the test container: the
socket's mode and group, the CLI with no configuration, the public port's /admin/* off,
and who may use it — checked by file permissions and then by the peer's credentials
(SO_PEERCRED), with child processes that drop to other users."""

from __future__ import annotations

import grp
import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gatewayd.cli import call
from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import toml_str

pytestmark = [pytest.mark.systemd, pytest.mark.engine]
GROUP = "gwadmins"


def as_user(uid: int, groups: list[int], fn: Callable[[], Any]) -> str:
    """fn() in a child that is uid (its primary group = uid) with these groups."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # pragma: no cover (the child)
        try:
            os.close(read)
            os.setgroups(groups)
            os.setgid(uid)
            os.setuid(uid)
            try:
                out = "ok " + json.dumps(fn())
            except Exception as e:
                out = f"{type(e).__name__}: {e}"
            os.write(write, out.encode())
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return data.decode()


def test_admin_socket_for_root_and_the_admin_group_only(
        tmp_path: Path, gateway_factory: GatewayFactory) -> None:
    subprocess.run(["groupadd", "-f", GROUP], check=True)
    gid = grp.getgrnam(GROUP).gr_gid
    sock = Path(f"/run/llm-gateway-test/admin-{os.getpid()}.sock")
    gw = gateway_factory(extra=f"[admin]\nsocket = {toml_str(str(sock))}\n"
                               f'group = "{GROUP}"\npublic = false\n')
    info = sock.stat()
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660
    assert info.st_gid == gid
    assert gw.api("GET", "/admin/status")[0] == 404          # not on the public port
    assert "admin API on" in gw.journal()

    # the CLI: the config names the socket; or no readable config at all
    assert gw.cli("status").returncode == 0
    env = {**os.environ, "LLM_GATEWAY_CONFIG": str(tmp_path)}   # a directory: unreadable
    done = subprocess.run([sys.executable, "-m", "gatewayd", "--admin-socket", str(sock), "--json",
                           "status"], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["max_engines"] == 4

    def status() -> Any:
        return call(f"unix:{sock}", "GET", "/admin/status")["max_engines"]
    assert as_user(54321, [gid], status) == "ok 4"          # in the admin group
    stranger = as_user(54322, [], status)                    # not: the file says no
    assert stranger.startswith("CliError") and "permission denied" in stranger, stranger
    os.chmod(sock, 0o666)                                    # even where it may connect,
    stranger = as_user(54322, [], status)                    # its credentials say no
    assert "user 54322 may not use the admin API" in stranger, stranger

    gw.stop()
    assert not sock.exists()                                 # removed at the end
