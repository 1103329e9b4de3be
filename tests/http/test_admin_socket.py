"""The admin API on its unix socket: bound 0660, a leftover replaced, a live one left
alone; the CLI talks to it with no configuration; the socket serves the admin API only;
the public port's /admin/* can be turned off; the peer rule (SO_PEERCRED)."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gatewayd.adapters import admin_socket
from gatewayd.adapters.admin_socket import Peer, may_administer, peer_of
from gatewayd.cli import CliError, call
from gatewayd.core.config import GatewayConfig
from gatewayd.http.auth import ACCESS
from tests.http.test_front_door import Gateway, _gateway, chat


@pytest.fixture
def sock_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="as", dir="/tmp") as d:   # sun_path: 108 bytes
        yield Path(d) / "run" / "admin.sock"


@pytest.fixture
async def gw(tmp_path: Path, sock_path: Path) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("a",), admin_public=False):
        sock = admin_socket.bind(sock_path, None)
        runner = g.client.server.runner
        assert runner is not None
        await web.SockSite(runner, sock).start()
        g.client.app[ACCESS].admin_socket = str(sock_path)
        yield g


def test_bound_0660_a_leftover_replaced_a_live_one_kept(sock_path: Path) -> None:
    first = admin_socket.bind(sock_path, None)
    assert stat.S_IMODE(sock_path.stat().st_mode) == 0o660
    with pytest.raises(admin_socket.AdminSocketInUse):
        admin_socket.bind(sock_path, None)          # someone answers there: not stolen
    first.close()                                   # gone, its file left behind
    admin_socket.bind(sock_path, None).close()      # the leftover is replaced
    with pytest.raises(KeyError):
        admin_socket.bind(sock_path.with_name("other.sock"), "no-such-group-here")
    assert not sock_path.with_name("other.sock").exists()


def test_the_peer_is_known_by_the_kernels_word() -> None:
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        peer = peer_of(left)
    assert peer is not None and peer.pid == os.getpid() and peer.uid == os.getuid()
    assert may_administer(Peer(1, 0, 0, frozenset()), own_uid=998, admin_gid=None)   # root
    assert may_administer(Peer(1, 998, 5, frozenset()), own_uid=998, admin_gid=None)  # self
    assert may_administer(Peer(1, 1000, 1000, frozenset({27})), own_uid=998, admin_gid=27)
    assert may_administer(Peer(1, 1000, 27, frozenset()), own_uid=998, admin_gid=27)
    assert not may_administer(Peer(1, 1000, 1000, frozenset({4})), own_uid=998, admin_gid=27)
    assert not may_administer(Peer(1, 1000, 1000, frozenset()), own_uid=998, admin_gid=None)
    assert not may_administer(None, own_uid=998, admin_gid=None)


async def test_the_cli_reaches_the_admin_api_on_the_socket_only(gw: Gateway,
                                                                sock_path: Path) -> None:
    status = await asyncio.to_thread(call, f"unix:{sock_path}", "GET", "/admin/status")
    assert status["max_engines"] == 4 and status["engines"] == {"ready": 1}
    assert (await gw.client.get("/admin/status")).status == 404     # [admin] public = false
    resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
    assert resp.status == 200                                        # inference as ever
    with pytest.raises(CliError, match="Not Found"):   # no inference on the admin socket
        await asyncio.to_thread(call, f"unix:{sock_path}", "GET", "/v1/models")


async def test_off_the_public_port_by_default_with_a_clear_answer_and_metrics_by_choice(
        tmp_path: Path) -> None:
    assert GatewayConfig().admin_public is False and not GatewayConfig().admin_public_metrics
    async for g in _gateway(tmp_path, ("a",), admin_public=False):
        resp = await g.client.get("/admin/status")
        body = await resp.json()
        assert resp.status == 404 and body["error"]["code"] == "admin_not_public"
        assert "admin socket" in body["error"]["message"]
        assert (await g.client.get("/admin/metrics")).status == 404
        # the CLI pointed at the public port says where to go instead
        url = str(g.client.make_url("")).rstrip("/")
        with pytest.raises(CliError, match="not served on this port") as e:
            await asyncio.to_thread(call, url, "GET", "/admin/status")
        assert "--admin-socket" in (e.value.hint or "")
    async for g in _gateway(tmp_path, ("a",), admin_public=False, admin_public_metrics=True):
        resp = await g.client.get("/admin/metrics")
        assert resp.status == 200 and "llm_gateway_requests_total" in await resp.text()
        assert (await g.client.post("/admin/metrics")).status == 405   # GET only
        assert (await g.client.get("/admin/status")).status == 404


async def test_a_peer_that_is_not_root_the_gateways_user_or_in_its_group_is_refused(
        gw: Gateway, sock_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate asks the kernel who is on the socket (peer_of) and refuses anyone else
    (403 admin_not_allowed), before any handler runs. The tests run as root or as the
    gateway's own user, both allowed: the kernel's word is replaced by a stranger's."""
    connector = aiohttp.UnixConnector(path=str(sock_path))
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get("http://localhost/admin/status") as resp:
            assert resp.status == 200
        stranger = Peer(os.getpid(), os.getuid() + 4242, os.getgid() + 4242, frozenset())
        monkeypatch.setattr("gatewayd.http.auth.peer_of", lambda sock: stranger)
        async with session.get("http://localhost/admin/status") as resp:
            body = await resp.json()
            assert resp.status == 403 and body["error"]["code"] == "admin_not_allowed"
