"""Debian's HAProxy for the fleet tests, with the configuration the project ships
(packaging/haproxy/haproxy.cfg): only its addresses changed, its log to a file beside the
test's (each request, each server going down or up: what a failure is read with). Run as
the test's own process and ended by its PID."""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.harness.plugin import REPO, unavailable

SHIPPED = REPO / "packaging" / "haproxy" / "haproxy.cfg"


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy")
                                        .exists() else None)
    if found is None:
        unavailable("haproxy is not installed (scripts/setup installs Debian's)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_for(front: int, ports: list[int], request_timeout_s: int | None = None) -> str:
    """The shipped file, its addresses the test's, its log on stdout (no syslog here);
    request_timeout_s: its `timeout http-request` shortened (a test of a slow upload)."""
    text = re.sub(r"\n\s*log /dev/log.*", "", SHIPPED.read_text())
    if request_timeout_s is not None:
        assert "    timeout http-request 30s\n" in text
        text = text.replace("    timeout http-request 30s\n",
                            f"    timeout http-request {request_timeout_s}s\n")
    text = text.replace("global\n", "global\n    log stdout format raw local0\n", 1)
    text = text.replace("bind 127.0.0.1:8000", f"bind 127.0.0.1:{front}")
    servers = "".join(f"    server gw{i} 127.0.0.1:{port}\n" for i, port in enumerate(ports))
    text = re.sub(r"(    server .*\n)+", servers, text)
    assert text.count("    server ") == len(ports)
    return text


@contextlib.contextmanager
def running_haproxy(folder: Path, front: int, ports: list[int],
                    request_timeout_s: int | None = None) -> Iterator[Path]:
    """HAProxy on 127.0.0.1:front in front of ports; yields its log file."""
    binary = haproxy_binary()
    cfg, log_path = folder / "haproxy.cfg", folder / "haproxy.log"
    cfg.write_text(config_for(front, ports, request_timeout_s))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([binary, "-f", str(cfg), "-db"], stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        yield log_path
    finally:   # ours, by its PID
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
