"""aiohttp's router, built from the route table (core/routes.py).

One resource answers every path: it looks the request up in the table and hands aiohttp
the handler that table line names ("module.function" under gatewayd/http, resolved once
when the app is built: a name that does not resolve stops the build). Where a path is
handled is therefore its line in core/routes.py, and nothing else registers a route.

A path the table does not list, or a method it does not list for the path, resolves to
its refusal (RouteNotFound, 404; MethodNotAllowed, 405). The gate (http/auth.check_access)
reads the entry or raises the refusal in its own order: after the framing, Host and Origin
checks, before any key check or handler. Without the gate (an app built without access
rules) the refusal is raised where a handler would have run.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Iterator, Mapping

from aiohttp import web
from aiohttp.web_urldispatcher import (
    AbstractResource,
    AbstractRoute,
    ResourceRoute,
    UrlMappingMatchInfo,
)
from yarl import URL

from gatewayd.core.errors import GatewayError, MethodNotAllowed, RouteNotFound
from gatewayd.core.routes import TABLE, Matched, Route, RouteTable

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HANDLERS_PACKAGE = "gatewayd.http"


class TableMatch(UrlMappingMatchInfo):
    """aiohttp's match info for a request: the table's entry, or why there is none."""

    def __init__(self, match_dict: dict[str, str], route: AbstractRoute,
                 matched: Matched | None, refusal: GatewayError | None) -> None:
        super().__init__(match_dict, route)
        self.matched = matched
        self.refusal = refusal

    def entry(self) -> Matched:
        """The table's route for the request; raises its refusal where there is none."""
        if self.matched is None:
            assert self.refusal is not None
            raise self.refusal
        return self.matched


class TableResource(AbstractResource):
    """Every path: the table decides (indexed under "/", where aiohttp's walk up the
    path's parts ends, so it is asked for any path)."""

    def __init__(self, table: RouteTable, handlers: Mapping[Route, Handler]) -> None:
        super().__init__(name=None)
        self._table = table
        self._routes = {route: ResourceRoute("*", handler, self)
                        for route, handler in handlers.items()}
        self._refused = ResourceRoute("*", _refuse, self)

    @property
    def canonical(self) -> str:
        return "/"

    def url_for(self, **kwargs: str) -> URL:
        raise NotImplementedError("the table's paths are written in core/routes.py")

    def add_prefix(self, prefix: str) -> None:
        raise RuntimeError("the route table is served at the root only")

    def get_info(self) -> dict[str, str]:  # type: ignore[override]
        return {"path": "/"}

    def raw_match(self, path: str) -> bool:
        # aiohttp's add_route reuses an unnamed resource that raw-matches the path: a route
        # added by hand beside the table gets a resource of its own (and still the gate)
        return False

    def __len__(self) -> int:
        return len(self._routes)

    def __iter__(self) -> Iterator[AbstractRoute]:
        return iter(self._routes.values())

    async def resolve(self, request: web.Request) -> tuple[UrlMappingMatchInfo | None,
                                                           set[str]]:
        try:
            matched = self._table.match(
                request.method, request.path,
                preflight_for=request.headers.get("Access-Control-Request-Method"))
        except (RouteNotFound, MethodNotAllowed) as refusal:
            return TableMatch({}, self._refused, None, refusal), set()
        return TableMatch(_parts(matched), self._routes[matched.route], matched, None), set()


def _parts(matched: Matched) -> dict[str, str]:
    """The path's variable part by its name in the table ("/slots/{n}": {"n": "7"};
    "/v1/files/{key}/content": {"key": the id})."""
    path = matched.route.path
    head, brace, rest = path.partition("{")
    if not brace:
        return {}
    name, _, suffix = rest.partition("}")
    return {name: matched.target[len(head):len(matched.target) - len(suffix)]}


async def _refuse(request: web.Request) -> web.StreamResponse:
    info = request.match_info
    assert isinstance(info, TableMatch)
    info.entry()    # raises
    raise AssertionError("a refused match has an entry")   # pragma: no cover


def handler_of(route: Route) -> Handler:
    """The function a table line names."""
    module, _, name = route.handler.rpartition(".")
    found = getattr(importlib.import_module(f"{HANDLERS_PACKAGE}.{module}"), name, None)
    if not callable(found):
        raise LookupError(f"{route.path}: no handler {route.handler!r} in {HANDLERS_PACKAGE}")
    return found   # type: ignore[no-any-return]


def install(app: web.Application, table: RouteTable = TABLE) -> None:
    """Route every request of app by the table."""
    app.router.register_resource(TableResource(
        table, {route: handler_of(route) for route in table.routes}))
