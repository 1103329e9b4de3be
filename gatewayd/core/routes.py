"""Every method and path the gateway answers, and who may call it. Pure.

The one allow-list of the front door: a request whose path is not in this table is a
404 and a known path asked with another method a 405, before anything runs (no key
check, no body read, no engine woken, no upstream asked). For each route it says:

- who may call it (`Caller`): PUBLIC (liveness: no key, ever), INFERENCE (the
  OpenAI/Anthropic API and the llama-server paths clients use that read nothing of
  other clients: an inference key), ADMIN (what changes an engine or reads other
  clients' state, and the gateway's /admin API: the admin socket's peers, or an admin
  key on the public port while `[admin] public`);
- who answers it (`Answerer`): the gateway itself, a model's engine, or (for the
  OpenAI paths under /v1/) an engine or a remote upstream;
- what body it takes (`Body`): JSON (any other content type is refused, so a web
  page's "simple" cross-origin POST never parses) or multipart/form-data (uploads);
- `target`: the path an engine is sent, always the table's own spelling (never the
  client's raw bytes: `/v1/chat%2Fcompletions` reaches no engine as such);
- `handler`: the function that answers it, as "module.function" under gatewayd/http
  (every engine route: `openai_api.proxy_request`, the relay). aiohttp's router is built
  from this table (http/router.py): where a path is handled is its line here.

docs/security.md's route table is checked against this one (tests/unit/test_routes.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from gatewayd.core.errors import MethodNotAllowed, RouteNotFound

RELAY = "openai_api.proxy_request"   # the handler of every engine route


class Caller(StrEnum):
    PUBLIC = "public"
    INFERENCE = "inference"
    ADMIN = "admin"


class Answerer(StrEnum):
    GATEWAY = "gateway"
    ENGINE = "engine"
    ENGINE_OR_UPSTREAM = "engine or upstream"


class Body(StrEnum):
    NONE = "none"
    JSON = "json"
    MULTIPART = "multipart"


@dataclass(frozen=True)
class Route:
    """One path of the table and the methods it is answered for."""
    path: str                      # as written in the table; "{n}" a number, "{id}" any
                                   # rest, "{key}" one id-like part (a file's, a batch's)
    methods: frozenset[str]
    access: Caller
    answerer: Answerer
    body: Body = Body.NONE
    keyless: bool = False          # admin, but holds no data: the status page's shell
    note: str = ""
    handler: str = RELAY           # "module.function" under gatewayd/http
    query: bool = False            # takes core/query's typed parameters only (admin: always)

    @property
    def upstream(self) -> bool:
        """May be relayed to a remote upstream (OpenAI paths only)."""
        return self.answerer is Answerer.ENGINE_OR_UPSTREAM

    @property
    def engine(self) -> bool:
        return self.answerer is not Answerer.GATEWAY

    @property
    def typed_query(self) -> bool:
        """Its query is core/query's to check: the parameters it lists, typed, no others
        (the gateway's own admin routes, and those that say so)."""
        return not self.engine and (self.access is Caller.ADMIN or self.query)


@dataclass(frozen=True)
class Matched:
    """A request's route, and the path to send on (the table's spelling)."""
    route: Route
    target: str


def _r(methods: str, path: str, access: Caller, answerer: Answerer,
       body: Body = Body.NONE, *, keyless: bool = False, note: str = "",
       handler: str = RELAY, query: bool = False) -> Route:
    verbs = set(methods.split())
    if "GET" in verbs:
        verbs.add("HEAD")    # aiohttp answers HEAD wherever GET is
    if (answerer is Answerer.GATEWAY) == (handler == RELAY):
        raise ValueError(f"{path}: the gateway's own routes name their handler, and only "
                         "the engine routes go to the relay")
    return Route(path, frozenset(verbs), access, answerer, body, keyless, note, handler,
                 query)


PUB, INF, ADM = Caller.PUBLIC, Caller.INFERENCE, Caller.ADMIN
GW, EN, UP = Answerer.GATEWAY, Answerer.ENGINE, Answerer.ENGINE_OR_UPSTREAM
JSON, FORM = Body.JSON, Body.MULTIPART

ROUTES: tuple[Route, ...] = (
    # liveness, for probes and load balancers
    _r("GET", "/health", PUB, GW, handler="openai_api.health"),
    _r("GET", "/ready", PUB, GW, note="for balancers' health checks: 503 once the gateway "
       "is stopping (docs/fleet.md)", handler="openai_api.ready"),
    _r("GET", "/favicon.ico", PUB, GW, note="browsers ask; 204, no engine woken",
       handler="openai_api.no_icon"),
    # the OpenAI and Anthropic APIs
    _r("GET", "/v1/models", INF, GW, note="only the models the caller's key may use",
       handler="openai_api.list_models"),
    _r("GET", "/v1/models/{id}", INF, GW, handler="openai_api.retrieve_model"),
    _r("POST", "/v1/chat/completions", INF, UP, JSON),
    _r("POST", "/v1/completions", INF, UP, JSON),
    _r("POST", "/v1/responses", INF, UP, JSON),
    _r("POST", "/v1/responses/input_tokens", INF, UP, JSON),
    _r("POST", "/v1/messages", INF, UP, JSON, note="errors in Anthropic's shape"),
    _r("POST", "/v1/messages/count_tokens", INF, UP, JSON),
    _r("POST", "/v1/embeddings", INF, UP, JSON),
    _r("POST", "/v1/rerank", INF, UP, JSON),
    _r("POST", "/v1/reranking", INF, UP, JSON),
    _r("POST", "/v1/audio/transcriptions", INF, UP, FORM),
    _r("POST", "/v1/audio/translations", INF, UP, FORM),
    _r("POST", "/v1/audio/speech", INF, UP, JSON, note="the audio streamed as it comes"),
    _r("POST", "/v1/images/generations", INF, UP, JSON),
    _r("POST", "/v1/images/edits", INF, UP, FORM),
    _r("POST", "/v1/images/variations", INF, UP, FORM),
    # llama-server's own paths that read nothing of other clients
    _r("POST", "/completion", INF, EN, JSON),
    _r("POST", "/completions", INF, EN, JSON),
    _r("POST", "/chat/completions", INF, EN, JSON),
    _r("POST", "/infill", INF, EN, JSON),
    _r("POST", "/embedding", INF, EN, JSON),
    _r("POST", "/embeddings", INF, EN, JSON),
    _r("POST", "/rerank", INF, EN, JSON),
    _r("POST", "/reranking", INF, EN, JSON),
    _r("POST", "/tokenize", INF, EN, JSON),
    _r("POST", "/detokenize", INF, EN, JSON),
    _r("POST", "/apply-template", INF, EN, JSON),
    _r("GET", "/props", INF, EN, note="the engine's settings"),
    _r("GET", "/lora-adapters", INF, EN),
    # whisper-server's own upload path (its /load, which loads any file, is not here)
    _r("POST", "/inference", INF, EN, FORM),
    _r("POST", "/audio/transcriptions", INF, EN, FORM),
    # llama-server's paths that change an engine or show other clients' state
    _r("GET", "/slots", ADM, EN, note="other clients' prompts"),
    _r("POST", "/slots/{n}", ADM, EN, JSON, note="action=save|restore|erase"),
    _r("POST", "/props", ADM, EN, JSON),
    _r("POST", "/lora-adapters", ADM, EN, JSON),
    _r("GET", "/metrics", ADM, EN, note="the engine's raw metrics"),
    # the gateway's admin API
    _r("GET", "/admin", ADM, GW, keyless=True, note="the status page: it asks for a key",
       handler="admin_api.status_page"),
    _r("GET", "/admin/", ADM, GW, keyless=True, handler="admin_api.status_page"),
    _r("GET", "/admin/status", ADM, GW, handler="admin_api.status"),
    _r("GET", "/admin/models", ADM, GW, handler="admin_api.models"),
    _r("GET", "/admin/engines", ADM, GW, handler="admin_api.list_engines"),
    _r("POST", "/admin/engines/start", ADM, GW, JSON, handler="admin_api.start_engine"),
    _r("POST", "/admin/engines/stop", ADM, GW, JSON, handler="admin_api.stop_engine"),
    _r("GET", "/admin/engines/logs", ADM, GW, note="?follow=1: SSE, the journal as written",
       handler="admin_api.engine_logs"),
    _r("GET", "/admin/records", ADM, GW, handler="admin_api.call_records"),
    _r("GET", "/admin/series", ADM, GW, note="call records per time bucket: the charts",
       handler="console_api.call_series"),
    _r("GET", "/admin/events", ADM, GW, handler="admin_api.follow_events"),
    _r("GET", "/admin/events/history", ADM, GW, note="the events kept for a window",
       handler="admin_api.event_history"),
    _r("GET", "/admin/logs", ADM, GW, note="the gateway's own journal; ?follow=1: SSE",
       handler="admin_api.gateway_logs"),
    _r("GET", "/admin/metrics", ADM, GW, note="keyless while [admin] public_metrics",
       handler="admin_api.metrics"),
    _r("POST", "/admin/reload", ADM, GW, JSON, handler="admin_api.reload_config"),
    _r("POST", "/admin/models/pull", ADM, GW, JSON, note="download a model from a hub",
       handler="pull_api.pull"),
    _r("GET", "/admin/pulls", ADM, GW, handler="pull_api.list_pulls"),
    _r("POST", "/admin/pulls/cancel", ADM, GW, JSON, handler="pull_api.cancel_pull"),
    _r("POST", "/admin/models/remove", ADM, GW, JSON, note="delete a model's files",
       handler="pull_api.remove"),
    # OpenAI's Batch API (core/batch): a key's own files and batches (the admin's: all)
    _r("POST", "/v1/files", INF, GW, FORM, note="a batch input file (JSONL), every line "
       "checked", query=True, handler="batches_api.upload_file"),
    _r("GET", "/v1/files", INF, GW, query=True, handler="batches_api.list_files"),
    _r("GET", "/v1/files/{key}", INF, GW, query=True, handler="batches_api.retrieve_file"),
    _r("DELETE", "/v1/files/{key}", INF, GW, query=True, handler="batches_api.delete_file"),
    _r("GET", "/v1/files/{key}/content", INF, GW, query=True, handler="batches_api.file_content"),
    _r("POST", "/v1/batches", INF, GW, JSON, query=True, handler="batches_api.create_batch"),
    _r("GET", "/v1/batches", INF, GW, query=True, handler="batches_api.list_batches"),
    _r("GET", "/v1/batches/{key}", INF, GW, query=True, handler="batches_api.retrieve_batch"),
    _r("POST", "/v1/batches/{key}/cancel", INF, GW, JSON,
       query=True, handler="batches_api.cancel_batch"),
    _r("GET", "/admin/batches", ADM, GW, note="every key's batches: `llm-gateway batches`",
       handler="batches_api.all_batches"),
    _r("POST", "/admin/batches/cancel", ADM, GW, JSON, handler="batches_api.cancel_any"),
)


class RouteTable:
    """ROUTES, looked up by a request's decoded path and method: exact paths in one dict,
    the patterns ("/slots/{n}", "/v1/models/{id}", "/v1/files/{key}/content") by prefix.
    A path may have a route per method (GET /props is inference, POST /props admin)."""

    def __init__(self, routes: Iterable[Route] = ROUTES) -> None:
        self.routes = tuple(routes)
        self._exact: dict[str, list[Route]] = {}
        self._prefixed: list[tuple[str, str, list[Route]]] = []   # (prefix, kind, routes)
        for route in self.routes:
            head, brace, _ = route.path.partition("{")
            if brace:
                kind = route.path[len(head):]
                same = next((rs for p, k, rs in self._prefixed if (p, k) == (head, kind)), None)
                if same is None:
                    self._prefixed.append((head, kind, same := []))
                _add(same, route)
            else:
                _add(self._exact.setdefault(route.path, []), route)

    def find(self, path: str) -> tuple[list[Route], str] | None:
        """The routes a decoded path names and the path to send on; None: no such path."""
        routes = self._exact.get(path)
        if routes is not None:
            return routes, path
        for prefix, kind, routes in self._prefixed:
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            if kind == "{n}" and rest.isascii() and rest.isdigit() and len(rest) <= 6:
                return routes, prefix + str(int(rest))
            if kind == "{id}" and rest and not {".", ".."} & set(rest.split("/")):
                return routes, path    # the gateway's own: a model's name
            if kind.startswith("{key}") and rest.endswith(suffix := kind[len("{key}"):]) \
                    and _KEY.fullmatch(rest[:len(rest) - len(suffix)]):
                return routes, path    # the gateway's own: a file's or a batch's id
        return None

    def match(self, method: str, path: str, *, preflight_for: str | None = None) -> Matched:
        """The route for method + path; RouteNotFound (404) or MethodNotAllowed (405).
        OPTIONS (a CORS preflight) is matched as the method it asks about (preflight_for;
        any of the path's where it names none)."""
        found = self.find(path)
        if found is None:
            raise RouteNotFound(f"{_printable(path)} is not a path this gateway serves")
        routes, target = found
        wanted = method
        if method == "OPTIONS":
            wanted = preflight_for.upper() if preflight_for else sorted(routes[0].methods)[0]
        for route in routes:
            if wanted in route.methods:
                return Matched(route, target)
        allowed = ", ".join(sorted({m for r in routes for m in r.methods}))
        raise MethodNotAllowed(f"{_printable(wanted)} is not allowed on {routes[0].path} "
                               f"(allowed: {allowed})", allow=allowed)

    def methods(self, path: str) -> frozenset[str]:
        """Every method a path is answered for."""
        found = self.find(path)
        return frozenset(m for r in found[0] for m in r.methods) if found else frozenset()


_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _add(routes: list[Route], route: Route) -> None:
    if any(route.methods & other.methods for other in routes):
        raise ValueError(f"{route.path} is in the table twice for one method")
    routes.append(route)


def _printable(path: str) -> str:
    """A client's path in a message: bounded, no control characters."""
    cut = path[:200] + ("…" if len(path) > 200 else "")
    return "".join(c if c.isprintable() else "?" for c in cut)


TABLE = RouteTable()
