"""The gate: who may call what, at the HTTP edge, deny by default.

`check_access` runs first in the error middleware (so a refusal is rendered in the
caller's dialect), before any handler, in this order:

1. On the admin unix socket: the route table's PUBLIC and ADMIN routes only (an
   inference path is a 404 there), for a peer the kernel says is root, the gateway's
   user or in the admin group (adapters/admin_socket.py); no key needed.
2. On the public port: the Host must name this gateway and an Origin, where one is
   sent, must be its own or an allowed one (core/origins.py): a web page the user has
   open gets nothing, keys or no keys.
3. The route table (core/routes.py), as the router matched it (http/router.py): a path
   not in it is a 404, a method not listed a 405. Nothing else runs for them.
4. A request another site's page sent without an allowed Origin (Sec-Fetch-Site) is a
   403, unless it is a navigation to the status page's shell or /health.
5. ADMIN routes on the public port only while `[admin] public` (404 admin_not_public
   otherwise; `GET /admin/metrics` alone, keyless, while `[admin] public_metrics`).
6. With keys on, a key with the route's scope (admin or inference); PUBLIC routes and
   the status page's shell need none.
7. The gateway's own admin routes: their query parameters, typed by core/query.py (400
   for any other or a bad value).
8. A JSON route refuses a body of another content type (415), a multipart route one
   that is not multipart.

The route found, the key and the typed parameters are kept on the request
(`request[ROUTE]`, `request[API_KEY]`, `request[QUERY]`) for the handlers. What is in
force lives in `app[ACCESS]`, replaced by a configuration reload.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from gatewayd.adapters.admin_socket import may_administer, peer_of
from gatewayd.adapters.host_names import own_host_names
from gatewayd.core.auth import ADMIN, INFERENCE, ApiKey, KeyRing, presented_key
from gatewayd.core.errors import (
    ERROR_SOURCE_HEADER,
    AdminNotAllowed,
    AdminNotPublic,
    BadFraming,
    CrossSiteRequest,
    HeadersTooLarge,
    HostNotAllowed,
    OriginNotAllowed,
    RouteNotFound,
    UnsupportedMediaType,
)
from gatewayd.core.origins import BrowserPolicy
from gatewayd.core.query import parse_query
from gatewayd.core.routes import TABLE, Body, Caller, Matched
from gatewayd.http.router import TableMatch

API_KEY = web.RequestKey("api_key", ApiKey)
ROUTE = web.RequestKey("route", Matched)
QUERY = web.RequestKey("query", dict[str, Any])   # core/query's typed parameters
CORS_ORIGIN = web.RequestKey("cors_origin", str)   # an allowed page of another origin
METRICS_PATH = "/admin/metrics"
MODEL_PATH, MODEL_PREFIX = "/v1/models/{id}", "/v1/models/"
# what a page of an allowed origin may send and read (CORS)
CORS_REQUEST_HEADERS = ("Authorization, X-Api-Key, Content-Type, Accept, OpenAI-Beta, "
                        "Anthropic-Version, Anthropic-Beta, X-Stainless-Retry-Count, "
                        "X-Stainless-Timeout, X-Stainless-Lang, X-Stainless-Package-Version, "
                        "X-Stainless-OS, X-Stainless-Arch, X-Stainless-Runtime, "
                        "X-Stainless-Runtime-Version, Anthropic-Dangerous-Direct-Browser-Access, "
                        "LLM-Gateway-Priority, LLM-Gateway-Progress")
CORS_MAX_AGE_S = 600
CORS_EXPOSED_HEADERS = f"Retry-After, {ERROR_SOURCE_HEADER}"   # what a page may read
CROSS_SITE = frozenset({"cross-site", "same-site"})   # Sec-Fetch-Site: another site's page
# The request head the gateway takes: a field or request line of 8 KiB (aiohttp's own
# default), 32 KiB in all. aiohttp's parser is given more room (PARSER_LIMITS, up to
# 64 KiB) so that a head between the two is answered here, a 431 in the caller's JSON
# dialect, rather than by the parser's plain-text 400 and a traceback in the log.
MAX_FIELD_BYTES = 8190
MAX_HEAD_BYTES = 32 * 1024
PARSER_LIMITS: dict[str, Any] = {"max_line_size": 65536, "max_field_size": 65536}


@dataclass
class Access:
    """Who may reach what: the key ring, which admin routes are public, and which Host
    names and web origins name this gateway."""
    keys: KeyRing | None = None
    admin_public: bool = False
    metrics_public: bool = False       # /admin/metrics on the public port, keyless
    admin_socket: str | None = None    # the admin socket's path, once bound
    admin_gid: int | None = None
    own_uid: int = field(default_factory=os.getuid)
    browser: BrowserPolicy = field(default_factory=lambda: BrowserPolicy.of(
        (), (), own_host_names()))


ACCESS = web.AppKey("access", Access)


def check_access(request: web.Request) -> Matched | None:
    """The request's route, once it may go on; raises the error to answer otherwise:
    HostNotAllowed (421), OriginNotAllowed (403), RouteNotFound (404),
    MethodNotAllowed (405), AdminNotPublic (404), MissingApiKey / InvalidApiKey (401),
    ScopeNotAllowed / AdminNotAllowed (403), UnsupportedMediaType (415).
    None: an app built without access rules (the admin API's own tests)."""
    access = request.app.get(ACCESS)
    if access is None:
        return None
    _check_framing(request)
    _check_head_size(request)
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if access.admin_socket is not None and sockname == access.admin_socket:
        matched = _admin_socket_route(request)
        assert transport is not None   # it had a sockname
        peer = peer_of(transport.get_extra_info("socket"))
        if not may_administer(peer, access.own_uid, access.admin_gid):
            raise AdminNotAllowed(
                f"user {peer.uid if peer else '?'} may not use the admin API: it is for "
                "root, the gateway's user and the admin group ([admin] group)")
        request[ROUTE] = matched
        _check_query(request, matched)
        return matched
    headers = request.headers
    host = headers.get("Host")
    # (a unix socket of systemd's: no browser reaches it but through a proxy of its own)
    if isinstance(sockname, tuple) and not access.browser.host_allowed(host, sockname[0]):
        raise HostNotAllowed(
            "this gateway does not answer for that Host name; a name it should answer "
            "for goes in [listen] allowed_hosts")
    origin = headers.get("Origin")
    if origin is not None:
        allowed, cross = access.browser.origin_allowed(origin, host)
        if not allowed:
            raise OriginNotAllowed(
                "web pages of other origins may not call this gateway; an origin that "
                "should goes in [listen] allowed_origins")
        if cross:
            request[CORS_ORIGIN] = origin
    matched = table_entry(request)
    _as_written(request, matched)
    request[ROUTE] = matched
    _check_fetch_site(request, matched)
    if request.method == "OPTIONS":
        return matched     # a CORS preflight: answered from the table, no key in it
    route = matched.route
    if route.access is Caller.PUBLIC:
        return matched
    admin = route.access is Caller.ADMIN
    if admin and not access.admin_public:
        if access.metrics_public and route.path == METRICS_PATH:
            return matched     # read-only figures for a scraper ([admin] public_metrics)
        raise AdminNotPublic(
            f"{route.path} is not served on this port: the admin API is on the gateway's "
            "admin socket (the llm-gateway CLI finds it; set [admin] public = true to "
            "serve it here too, behind admin keys)")
    if access.keys is not None and not route.keyless:
        request[API_KEY] = access.keys.identify(
            presented_key(headers.get("Authorization"), headers.get("X-Api-Key")),
            ADMIN if admin else INFERENCE)
    _check_query(request, matched)
    if route.body is not Body.NONE and request.body_exists:
        _check_content_type(request, route.body)
    return matched


def table_entry(request: web.Request) -> Matched:
    """The request's line of the route table, as the router found it (http/router);
    raises RouteNotFound (404) or MethodNotAllowed (405) where the table has none. An app
    whose routes were added by hand is looked up here the same way."""
    info = request.match_info
    if isinstance(info, TableMatch):
        return info.entry()
    return TABLE.match(request.method, request.path,
                       preflight_for=request.headers.get("Access-Control-Request-Method"))


def _check_fetch_site(request: web.Request, matched: Matched) -> None:
    """A browser says where a request comes from (Sec-Fetch-Site) even where it sends no
    Origin: a GET from an <img>, <script> or <iframe> of any page carries none, and one
    held open (a journal follow, the event feed) costs the gateway a bounded resource. A
    request from another site is let through only with an allowed Origin (CORS, checked
    above) or as a top-level navigation to a page anyone may open (the status page's
    shell, /health); the rest is a 403 before any key check or handler. curl and the SDKs
    send no Sec-Fetch-Site and are not concerned."""
    headers = request.headers
    if headers.get("Sec-Fetch-Site") not in CROSS_SITE or CORS_ORIGIN in request:
        return
    route = matched.route
    if request.method in ("GET", "HEAD") and headers.get("Sec-Fetch-Mode") == "navigate" \
            and headers.get("Sec-Fetch-Dest", "document") == "document" \
            and (route.access is Caller.PUBLIC or route.keyless):
        return
    raise CrossSiteRequest(
        "a page of another site may not call this gateway (Sec-Fetch-Site: "
        f"{headers.get('Sec-Fetch-Site')}); an origin that should goes in [listen] "
        "allowed_origins")


def _check_query(request: web.Request, matched: Matched) -> None:
    """The gateway's own admin routes take the parameters core/query lists, typed, and no
    others (400, once the caller may call the route at all)."""
    route = matched.route
    if route.typed_query:
        request[QUERY] = parse_query(route.path, request.query.items())


def query_of(request: web.Request) -> dict[str, Any]:
    """The request's parameters as core/query typed them (parsed here where the gate did
    not run: an app built without access rules)."""
    found = request.get(QUERY)
    if found is None:
        found = request[QUERY] = parse_query(request.path, request.query.items())
    return found


def _check_framing(request: web.Request) -> None:
    """Before anything else, Host included: a body whose length cannot be known. aiohttp's
    parser refuses a Transfer-Encoding that does not end in chunked, except an empty one,
    which it takes as no body at all, where RFC 9112 6.3 says 400 and close."""
    fields = request.headers.getall("Transfer-Encoding", ())
    if not fields:
        return
    codings = [c.strip(" \t").lower() for field in fields for c in field.split(",")
               if c.strip(" \t")]
    if not codings or codings[-1] != "chunked":
        raise BadFraming("Transfer-Encoding must end with chunked: the body's length cannot "
                         "be known otherwise (RFC 9112 6.3)")


def _check_head_size(request: web.Request) -> None:
    raw_path = request.raw_path
    if len(raw_path) > MAX_FIELD_BYTES:
        raise HeadersTooLarge(f"the request line is over {MAX_FIELD_BYTES} bytes")
    total = len(raw_path)
    for name, value in request.raw_headers:
        size = len(name) + len(value)
        if size > MAX_FIELD_BYTES:
            raise HeadersTooLarge(f"the header {name[:64].decode('latin-1')!r} is {size} "
                                  f"bytes: at most {MAX_FIELD_BYTES} are taken")
        total += size + 4
    if total > MAX_HEAD_BYTES:
        raise HeadersTooLarge(f"the request line and headers are {total} bytes: at most "
                              f"{MAX_HEAD_BYTES} in all are taken")


def _as_written(request: web.Request, matched: Matched) -> None:
    """The path must be the table's as the client wrote it: one that only decodes or
    normalises to a table path (`/%73lots`, `/v1/chat%2Fcompletions`, `/v1/x/../../slots`)
    is a 404, whatever the next hop would have made of it. A model's name in
    /v1/models/{id} may be percent-encoded (names hold '/' and ':'). Of an absolute-form
    target (`http://host/path`, which a server must take: RFC 9112 3.2.2) the path is what
    follows the authority."""
    raw = request.raw_path.partition("?")[0]
    if not raw.startswith("/") and "://" in raw:
        raw = "/" + raw.partition("://")[2].partition("/")[2]
    if raw == request.path or (matched.route.path == MODEL_PATH
                               and raw.startswith(MODEL_PREFIX) and "/." not in raw
                               and "%2e" not in raw.lower()):
        return
    raise RouteNotFound(f"{request.path} is not a path this gateway serves as written "
                        "(percent-encoded or dot segments)")


def _admin_socket_route(request: web.Request) -> Matched:
    """The admin socket serves the admin API (and /health) only."""
    try:
        matched = table_entry(request)
        _as_written(request, matched)
    except RouteNotFound:
        raise web.HTTPNotFound() from None
    if matched.route.access is Caller.INFERENCE:
        raise web.HTTPNotFound()
    return matched


def _check_content_type(request: web.Request, body: Body) -> None:
    kind = request.content_type     # aiohttp: application/octet-stream when none is sent
    if body is Body.JSON:
        if kind == "application/json" or (kind.startswith("application/")
                                           and kind.endswith("+json")):
            return
        raise UnsupportedMediaType(
            f"{request.path} takes a JSON body: send it as 'Content-Type: application/json' "
            f"(not {kind}); with curl: -H 'Content-Type: application/json'")
    if kind != "multipart/form-data":
        example = "-F purpose=batch -F file=@requests.jsonl" if request.path == "/v1/files" \
            else "-F file=@audio.wav -F model=NAME"
        raise UnsupportedMediaType(
            f"{request.path} takes a multipart/form-data upload (not {kind}); with curl: "
            f"{example}")


def preflight(request: web.Request, matched: Matched) -> web.Response:
    """A CORS preflight (OPTIONS) for a route: the origin was already let through by
    check_access; the methods are the route's."""
    methods = ", ".join(sorted(TABLE.methods(request.path)))
    headers = CIMultiDict({"Allow": methods})
    if (origin := request.get(CORS_ORIGIN)) is not None:
        headers.update({"Access-Control-Allow-Origin": origin,
                        "Access-Control-Allow-Methods": methods,
                        "Access-Control-Allow-Headers": CORS_REQUEST_HEADERS,
                        "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
                        "Vary": "Origin"})
    return web.Response(status=204, headers=headers)


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: an allowed page of another origin may read the answer, and
    the headers a client acts on (when to retry, whose an error is), which a browser
    hides from a page unless they are exposed."""
    origin = request.get(CORS_ORIGIN)
    if origin is not None and "Access-Control-Allow-Origin" not in response.headers:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSED_HEADERS
        response.headers["Vary"] = "Origin"


def request_key(request: web.Request) -> ApiKey | None:
    return request.get(API_KEY)


def request_route(request: web.Request) -> Matched | None:
    return request.get(ROUTE)
