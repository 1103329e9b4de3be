"""Who may call what, at the HTTP edge (the key rules are core/auth.py's).

`check_access` runs first in the error middleware (so a refusal is rendered in
the caller's dialect), before routing:
- a request on the admin unix socket: `/admin/*` (and `/health`) only, for a peer
  the kernel says is root, the gateway's user or in the admin group
  (adapters/admin_socket.py); no key needed;
- on the public port: `/admin/*` only while `[admin] public` (404 admin_not_public
  otherwise; `/admin/metrics` alone, keyless, while `[admin] public_metrics`); with
  keys on, a key with the path's scope (admin or inference). With keys off, it costs a
  few attribute reads.
The key found is kept on the request (`request[API_KEY]`) for the handler's model
check and the call record. What is in force lives in `app[ACCESS]`, replaced by a
configuration reload.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from aiohttp import web

from gatewayd.adapters.admin_socket import may_administer, peer_of
from gatewayd.core.auth import ADMIN, INFERENCE, ApiKey, KeyRing, presented_key
from gatewayd.core.errors import AdminNotAllowed, AdminNotPublic

API_KEY = web.RequestKey("api_key", ApiKey)
OPEN_PATHS = frozenset({"/health", "/favicon.ico"})   # liveness checks carry no key
CREDENTIAL_HEADERS = ("Authorization", "X-Api-Key")
METRICS_PATH = "/admin/metrics"
STATUS_PAGE_PATHS = frozenset({"/admin", "/admin/"})


@dataclass
class Access:
    """Who may reach what: the key ring and which admin routes are public."""
    keys: KeyRing | None = None
    admin_public: bool = False
    metrics_public: bool = False       # /admin/metrics on the public port, keyless
    admin_socket: str | None = None    # the admin socket's path, once bound
    admin_gid: int | None = None
    own_uid: int = field(default_factory=os.getuid)


ACCESS = web.AppKey("access", Access)


def check_access(request: web.Request) -> None:
    """Raises MissingApiKey / InvalidApiKey (401), ScopeNotAllowed / AdminNotAllowed (403),
    or HTTPNotFound (the admin API is not on this socket)."""
    access = request.app.get(ACCESS)   # (an app built without it: admin API tests)
    if access is None:
        return
    path = request.path
    admin = path == "/admin" or path.startswith("/admin/")
    if access.admin_socket is not None and request.transport is not None and \
            request.transport.get_extra_info("sockname") == access.admin_socket:
        if not admin and path not in OPEN_PATHS:
            raise web.HTTPNotFound()   # the admin socket serves the admin API only
        peer = peer_of(request.transport.get_extra_info("socket"))
        if not may_administer(peer, access.own_uid, access.admin_gid):
            raise AdminNotAllowed(
                f"user {peer.uid if peer else '?'} may not use the admin API: it is for "
                "root, the gateway's user and the admin group ([admin] group)")
        return
    if admin and not access.admin_public:
        if access.metrics_public and path == METRICS_PATH and request.method == "GET":
            return     # read-only figures for a scraper ([admin] public_metrics)
        raise AdminNotPublic(
            f"{path} is not served on this port: the admin API is on the gateway's admin "
            "socket (the llm-gateway CLI finds it; set [admin] public = true to serve it "
            "here too)")
    keys = access.keys
    if keys is None or path in OPEN_PATHS or (path in STATUS_PAGE_PATHS
                                              and request.method == "GET"):
        return   # the status page holds no data: it asks for a key, then calls the API
    headers = request.headers
    request[API_KEY] = keys.identify(
        presented_key(headers.get("Authorization"), headers.get("X-Api-Key")),
        ADMIN if admin else INFERENCE)


def request_key(request: web.Request) -> ApiKey | None:
    return request.get(API_KEY)
