"""The TCP engines' launcher (gatewayd.engine_launch) in the host's network namespace, as it
runs where systemd cannot make a private one (PID 1 without CAP_NET_ADMIN: a container
sharing the host's network, as scripts/demo boots): run here directly, not under systemd,
so the namespace is the host's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gatewayd import engine_launch

pytestmark = pytest.mark.slow

# listens on a port of its own choosing, whatever it is told
WRONG_PORT = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print("fake server: listening on", s.getsockname()[1], "told", sys.argv[1], flush=True)
time.sleep(120)
"""


def test_a_server_on_the_wrong_port_is_said_at_once_without_a_private_network(
        tmp_path: Path) -> None:
    """docs/engines.md: a {port} server that listens on another port is said at once and not
    restarted (exit 78). Without a private namespace the launcher waited for it up to 600 s,
    and the gateway said only "not ready after 30s" at its load timeout."""
    assert not engine_launch.has_private_network()   # (the host's: the test's premise)
    sock = tmp_path / "llm-engine-x" / "engine.sock"
    sock.parent.mkdir()
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gatewayd.engine_launch", "--socket", str(sock), "--",
         sys.executable, "-c", WRONG_PORT, "{port}"],
        capture_output=True, text=True, timeout=engine_launch.WRONG_PORT_GRACE_S + 15,
        check=False)
    said = done.stdout + done.stderr
    assert done.returncode == engine_launch.EX_CONFIG, said
    assert "of the host's network, where any local user can reach the server" in said
    assert "not on 39" in said and "the port its command's {port} says" in said, said
    assert time.monotonic() - t0 < engine_launch.WRONG_PORT_GRACE_S + 10
    assert not sock.exists()
