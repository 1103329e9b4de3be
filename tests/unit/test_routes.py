"""The route table (core/routes.py) and the Host/Origin policy (core/origins.py): pure."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from gatewayd.core.config import GatewayConfig
from gatewayd.core.errors import MethodNotAllowed, RouteNotFound
from gatewayd.core.origins import BrowserPolicy, host_name
from gatewayd.core.routes import ROUTES, TABLE, Answerer, Caller, _r

ROUTE_DOC = Path(__file__).parents[2] / "docs" / "security.md"   # "Routes: deny by default"


def test_the_documented_route_table_is_the_route_table() -> None:
    text = ROUTE_DOC.read_text()
    block = text[text.index("<!-- routes: begin -->"):text.index("<!-- routes: end -->")]
    rows = re.findall(r"^\| `([A-Z ]+)` \| `([^`]+)` \| ([^|]+?) \| ([^|]+?) \|", block, re.M)
    who = {"anyone, no key": Caller.PUBLIC, "inference": Caller.INFERENCE,
           "admin": Caller.ADMIN}
    documented = {(frozenset(m.split()), path, who[caller], answerer)
                  for m, path, caller, answerer in rows}
    actual = {(frozenset(r.methods - {"HEAD"}), r.path, r.access, r.answerer.value)
              for r in ROUTES}
    assert documented == actual


def test_the_app_is_routed_by_the_table_alone() -> None:
    """aiohttp's router is the table: one resource, each line's handler the function the
    line names (the engine routes: the relay), nothing registered beside it."""
    from gatewayd.app import build_app
    from gatewayd.http import openai_api
    from gatewayd.http.router import TableResource, handler_of
    app = build_app(GatewayConfig(), engines_ctx=_no_engines)
    resources = list(app.router.resources())
    assert len(resources) == 1 and isinstance(resources[0], TableResource)
    assert {route.handler for route in resources[0]} == {handler_of(r) for r in ROUTES}
    for route in ROUTES:
        assert (handler_of(route) is openai_api.proxy_request) is route.engine, route.path


def test_a_line_names_a_handler_that_exists_or_the_build_stops() -> None:
    from gatewayd.http.router import handler_of
    with pytest.raises(LookupError, match=r"no handler 'admin_api\.nothing'"):
        handler_of(dataclasses.replace(ROUTES[0], handler="admin_api.nothing"))
    with pytest.raises(ValueError, match="name their handler"):
        _r("GET", "/x", Caller.PUBLIC, Answerer.GATEWAY)          # the gateway's: named
    with pytest.raises(ValueError, match="name their handler"):
        _r("GET", "/x", Caller.INFERENCE, Answerer.ENGINE, handler="admin_api.status")


@pytest.mark.parametrize(("method", "path", "handler", "parts"), [
    ("GET", "/health", "openai_api.health", {}),
    ("HEAD", "/health", "openai_api.health", {}),
    ("POST", "/v1/embeddings", "openai_api.proxy_request", {}),
    ("GET", "/v1/models/org/model:q4", "openai_api.retrieve_model", {"id": "org/model:q4"}),
    ("POST", "/slots/007", "openai_api.proxy_request", {"n": "7"}),
    ("GET", "/admin/series", "console_api.call_series", {}),
    ("POST", "/admin/models/pull", "pull_api.pull", {}),
])
async def test_the_router_hands_each_request_the_handler_its_line_names(
        method: str, path: str, handler: str, parts: dict[str, str]) -> None:
    from aiohttp.test_utils import make_mocked_request

    from gatewayd.http.router import TableMatch, TableResource, handler_of
    resource = TableResource(TABLE, {r: handler_of(r) for r in ROUTES})
    info, _ = await resource.resolve(make_mocked_request(method, path))
    assert isinstance(info, TableMatch) and info.entry().route.handler == handler
    assert info.handler is handler_of(info.entry().route) and dict(info) == parts


@pytest.mark.parametrize(("method", "path", "refusal"), [
    ("GET", "/load", RouteNotFound), ("GET", "/v1/fine_tuning/jobs", RouteNotFound),
    ("DELETE", "/v1/chat/completions", MethodNotAllowed), ("GET", "/admin/reload",
                                                           MethodNotAllowed)])
async def test_what_the_table_lacks_resolves_to_its_refusal(method: str, path: str,
                                                            refusal: type) -> None:
    from aiohttp.test_utils import make_mocked_request

    from gatewayd.http.router import TableMatch, TableResource, handler_of
    resource = TableResource(TABLE, {r: handler_of(r) for r in ROUTES})
    info, _ = await resource.resolve(make_mocked_request(method, path))
    assert isinstance(info, TableMatch) and isinstance(info.refusal, refusal)
    request = make_mocked_request(method, path)
    request._match_info = info     # what aiohttp sets once resolved
    with pytest.raises(refusal):
        await info.handler(request)


async def _no_engines(app: web.Application) -> AsyncIterator[None]:   # never entered
    yield


@pytest.mark.parametrize(("method", "path", "target", "access"), [
    ("GET", "/health", "/health", Caller.PUBLIC),
    ("POST", "/v1/chat/completions", "/v1/chat/completions", Caller.INFERENCE),
    ("GET", "/props", "/props", Caller.INFERENCE),
    ("POST", "/props", "/props", Caller.ADMIN),
    ("POST", "/slots/007", "/slots/7", Caller.ADMIN),
    ("GET", "/v1/models/org/model:q4", "/v1/models/org/model:q4", Caller.INFERENCE),
    ("OPTIONS", "/v1/chat/completions", "/v1/chat/completions", Caller.INFERENCE),
])
def test_a_listed_route_is_matched_with_its_own_spelling(method: str, path: str, target: str,
                                                        access: Caller) -> None:
    matched = TABLE.match(method, path)
    assert matched.target == target and matched.route.access is access


@pytest.mark.parametrize("path", [
    "/load", "/slots/-1", "/slots/1/2", "/slots/", "/slots/1234567", "/v1/models/",
    "/v1/models/../../slots", "/v1/models/a/./b", "/ADMIN", "/v1/fine_tuning/jobs", "//v1/models",
    "/v1/chat/completions/", "/admin/unknown", "/slots/٣", "/slots/1a", "/slots/x"])
def test_anything_else_is_not_found(path: str) -> None:
    with pytest.raises(RouteNotFound):
        TABLE.match("GET", path)


def test_a_method_not_listed_is_405_naming_the_allowed() -> None:
    with pytest.raises(MethodNotAllowed) as e:
        TABLE.match("DELETE", "/props")
    assert e.value.status == 405 and e.value.headers["Allow"] == "GET, HEAD, POST"
    with pytest.raises(MethodNotAllowed):
        TABLE.match("POST", "/health")


@pytest.mark.parametrize(("header", "name"), [
    ("LocalHost:8080", "localhost"), ("[::1]:80", "[::1]"), ("example.org.", "example.org"),
    ("10.0.0.5", "10.0.0.5"), ("[fe80::1", "[fe80::1")])
def test_host_names_are_read_without_their_port(header: str, name: str) -> None:
    assert host_name(header) == name


def test_the_host_must_name_this_gateway() -> None:
    policy = BrowserPolicy.of(["gpu-box"], [], ["workstation"])
    for host in ("localhost", "LOCALHOST:1", "x.localhost", "127.0.0.1:8080", "127.9.9.9",
                 "[::1]:8080", "gpu-box:8080", "workstation", "192.168.1.5:8080", None):
        assert policy.host_allowed(host, "192.168.1.5"), host
    for host in ("attacker.example", "localhost.attacker.example", "127.0.0.1.nip.io",
                 "gpu-box.attacker.example", "192.168.1.6", "x.localhost.attacker.example",
                 "notlocalhost"):
        assert not policy.host_allowed(host, "192.168.1.5"), host
    assert BrowserPolicy.of(["*"], []).host_allowed("anything", None)


def test_an_origin_is_the_gateways_own_or_listed() -> None:
    policy = BrowserPolicy.of([], ["https://app.example"])
    assert policy.origin_allowed("http://127.0.0.1:8080", "127.0.0.1:8080") == (True, False)
    assert policy.origin_allowed("https://APP.example/", "127.0.0.1:8080") == (True, True)
    assert policy.origin_allowed("http://attacker.example", "127.0.0.1:8080")[0] is False
    assert policy.origin_allowed("null", "127.0.0.1:8080")[0] is False
    assert policy.origin_allowed("http://127.0.0.1:9999", "127.0.0.1:8080")[0] is False
    assert BrowserPolicy.of([], ["*"]).origin_allowed("http://x.example", "h") == (True, True)


def test_allowed_hosts_and_origins_are_checked_when_read() -> None:
    from gatewayd.core.config import parse_config
    from gatewayd.core.errors import ConfigError
    config = parse_config({"listen": {"allowed_hosts": ["GPU-Box.", "[fe80::1]"],
                                      "allowed_origins": ["https://App.example"]}})
    assert config.allowed_hosts == ("gpu-box", "[fe80::1]")
    assert config.allowed_origins == ("https://app.example",)
    for listen in ({"allowed_hosts": ["http://gpu-box"]}, {"allowed_hosts": "gpu-box"},
                   {"allowed_origins": ["app.example"]},
                   {"allowed_origins": ["https://app.example/path"]},
                   {"allowed_hosts": [""]}):
        with pytest.raises(ConfigError, match=r"listen\.allowed"):
            parse_config({"listen": listen})



def test_a_route_added_by_hand_beside_the_table_gets_a_resource_of_its_own() -> None:
    """aiohttp reuses an unnamed resource that matches a new route's path: the table's
    must not be taken for one (it has no routes to add to; adding failed with an
    AttributeError). Such a route is still behind the gate, which looks the table up."""
    from gatewayd.http import router

    async def extra(request: web.Request) -> web.Response:
        return web.Response()
    app = web.Application()
    router.install(app)
    app.router.add_get("/health", extra)
    assert len(list(app.router.resources())) == 2
