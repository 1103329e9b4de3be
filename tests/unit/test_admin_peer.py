"""The admin socket's peer check: the peer's groups are the kernel's record from connect()
(SO_PEERGROUPS), never /proc/<pid>/status read at request time (PID reuse)."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatewayd.adapters import admin_socket
from gatewayd.adapters.admin_socket import may_administer, peer_of


@pytest.fixture
def sock_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="as", dir="/tmp") as d:   # sun_path: 108 bytes
        yield Path(d) / "admin.sock"


@pytest.mark.skipif(os.geteuid() != 0, reason="setgroups() needs root")
def test_the_peers_groups_are_those_it_connected_with_not_its_pids_later(
        sock_path: Path) -> None:
    """A peer that connected in the admin group and then exited (its pid free for reuse)
    or dropped the group is judged by the groups it connected with: SO_PEERGROUPS, not
    /proc/<pid>/status read at request time (which may be another process's by then)."""
    listener = admin_socket.bind(sock_path, None)
    listener.setblocking(True)
    admin_gid = 4242
    child = os.fork()
    if child == 0:   # pragma: no cover (the child)
        try:
            os.setgroups([admin_gid])
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(str(sock_path))
                os.setgroups([])                  # now no longer in the group...
                client.send(b"d")
                client.recv(1)                    # ...and gone once the server has looked
        finally:
            os._exit(0)
    with listener, listener.accept()[0] as conn:
        assert conn.recv(1) == b"d"               # the child has dropped the group
        with open(f"/proc/{child}/status") as f:  # the pid's groups now: none
            assert next(line for line in f if line.startswith("Groups:")).split() == ["Groups:"]
        peer = peer_of(conn)
        conn.send(b"x")
        os.waitpid(child, 0)
        later = peer_of(conn)                     # the pid is gone: the kernel still knows
    assert peer is not None and later is not None
    assert peer.pid == child and peer.groups == later.groups == frozenset({admin_gid})
    assert may_administer(later, own_uid=998, admin_gid=admin_gid)
