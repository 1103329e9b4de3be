"""The OpenAI front door: thin handlers. Parse, choose the engine, relay, record.

Every path an engine serves is proxied (POST with the model in the JSON body
or the multipart `model` field; GET with ?model=); /v1/models and /health are
answered by the gateway itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.helpers import parse_mimetype
from multidict import CIMultiDict

from gatewayd.adapters.answer import Answer
from gatewayd.adapters.engine_wire.client import EngineClient
from gatewayd.adapters.metrics import GatewayMetrics
from gatewayd.adapters.records import CallRecord, RecordWriter
from gatewayd.adapters.remote_client import never_connected, to_remote
from gatewayd.adapters.remote_upstreams import Remote, Remotes
from gatewayd.core import progress
from gatewayd.core.auth import ApiKey, check_model
from gatewayd.core.catalog import Catalog, Model, Served, Variant, named_for_engine
from gatewayd.core.config import Backend, GatewayConfig
from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.errors import (
    BodyTooLarge,
    ConcurrencyLimit,
    EngineFailed,
    EngineLimitReached,
    ErrorSource,
    GatewayError,
    GpuUnavailable,
    InsufficientGpu,
    InvalidRequest,
    ModelNotFound,
    ModelNotLoaded,
    QueueFull,
    RouteNotFound,
    UpstreamTimeout,
    UpstreamUnavailable,
    UpstreamUnreachable,
)
from gatewayd.core.priority import HEADER as PRIORITY_HEADER
from gatewayd.core.priority import NORMAL, of_request
from gatewayd.core.routing import INFERENCE_PATHS, TRANSLATION_PATHS, choose_model
from gatewayd.core.upstreams import REMOTE_PREFIX
from gatewayd.core.variants import Applied, loaded_adapters, shape_body, with_adapters
from gatewayd.http.auth import request_key, request_route
from gatewayd.http.middleware import SHUTDOWN, shutdown_error
from gatewayd.http.proxy import (
    WHISPER_INFERENCE_PATH,
    Outgoing,
    as_whisper_translation,
    relay,
    request_headers,
    to_engine,
)
from gatewayd.http.waiting import ClientLeft, Progress
from gatewayd.service.batch_lines import Activity
from gatewayd.service.dispatcher import Dispatcher
from gatewayd.service.engine_manager import EngineManager
from gatewayd.service.pulls import Puller

# where llama-server honours stream_options.include_usage
USAGE_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions",
                         "/completions"})
# a local model with spill_over goes remote when it fails to get an engine with these:
# it could not take the request within its wait (a request the engine began is never
# sent elsewhere)
SPILL_OVER = (QueueFull, ConcurrencyLimit, InsufficientGpu, EngineLimitReached,
              GpuUnavailable, ModelNotLoaded, EngineFailed)
log = logging.getLogger("gatewayd.front")


@dataclass
class FrontDoor:
    """The OpenAI-compatible handlers' collaborators, shared by every request."""
    config: GatewayConfig
    manager: EngineManager   # the engine layer (its engines: manager.registry.engines())
    dispatcher: Dispatcher
    engine_client: EngineClient
    records: RecordWriter | None
    metrics: GatewayMetrics | None = None
    remotes: Remotes = field(default_factory=lambda: Remotes((), read_timeout_s=600))
    puller: Puller | None = None     # a configured model's file pulled at its first use
    # when an interactive request last came: batch lines keep out of its way until quiet
    activity: Activity = field(default_factory=Activity)


FRONT = web.AppKey("front", FrontDoor)


async def health(request: web.Request) -> web.Response:
    engines = request.app[FRONT].manager.registry.engines()
    ready = sum(1 for e in engines if e.state is EngineState.READY)
    return web.json_response({"status": "ok", "engines_ready": ready})


async def ready(request: web.Request) -> web.Response:
    """A balancer's health check (docs/fleet.md): 200 while the gateway takes requests,
    503 from the moment it was told to stop, while it still serves (`drain_notice_s`), so
    the balancer sends no more before its socket closes."""
    if request.app[SHUTDOWN].draining:
        return web.json_response({"status": "draining"}, status=503)
    engines = request.app[FRONT].manager.registry.engines()
    return web.json_response({"status": "ready", "engines_ready": sum(
        1 for e in engines if e.state is EngineState.READY)})


async def no_icon(request: web.Request) -> web.Response:
    return web.Response(status=204)


async def list_models(request: web.Request) -> web.Response:
    """Ready engines first, then the models that could be started, then remote models."""
    front = request.app[FRONT]
    engines = {e.model_id: e for e in front.manager.registry.engines()}
    key = request_key(request)
    catalog = front.manager.catalog
    front.manager.capacity.read_ram()   # once for every row: what each engine holds now
    rows = [_model_object(front, model, engines.get(model.id))
            for model in catalog
            if key is None or key.may_use(model.id, model.names)]
    rows += [_variant_object(front, variant, engines.get(variant.base.id))
             for variant in catalog.variants
             if key is None or key.may_use(variant.id, variant.names)]
    rows.sort(key=lambda r: not r["loaded"])
    seen = {row["id"].casefold() for row in rows}
    for remote, model_id in front.remotes.serving():
        if model_id.casefold() in seen or catalog.find_served(model_id) is not None:
            continue   # a local model's name: it answers (and may spill over)
        if key is None or key.may_use(model_id):
            seen.add(model_id.casefold())
            rows.append(_remote_object(remote, model_id))
    return web.json_response({"object": "list", "data": rows})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id} (the SDKs' models.retrieve): any of the model's names; 404
    model_not_found otherwise."""
    front = request.app[FRONT]
    asked = request.match_info["id"]
    key = request_key(request)
    check_asked(key, front.manager.catalog, asked)
    try:
        served = front.manager.catalog.served(asked)
    except ModelNotFound as e:
        remote = front.remotes.candidates((asked,))
        if not remote:
            e.extra["available_models"] = available_models(front, request_key(request))
            raise
        check_model(request_key(request), remote[0].id, frozenset())
        upstream = next(r for r in front.remotes.remotes() if r.name == remote[0].upstream)
        return web.json_response(_remote_object(upstream, remote[0].id))
    check_model(request_key(request), served.id, served.names)
    front.manager.capacity.read_ram()
    engine = front.manager.registry.get(served.model.id)
    if served.variant is not None:
        return web.json_response(_variant_object(front, served.variant, engine))
    return web.json_response(_model_object(front, served.model, engine))


def _remote_object(remote: Remote, model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": remote.name,
            "state": "remote" if remote.up else "unreachable", "loaded": remote.up,
            "upstream": remote.name}


def _variant_object(front: FrontDoor, variant: Variant, engine: Engine | None
                    ) -> dict[str, Any]:
    """A variant as a model of its own: its base's engine and memory, its own names, what
    it is a variant of and the adapter it applies."""
    own = variant.describe()
    del own["system_prompt"]   # the operator's words: not for every key's client
    return {**_model_object(front, variant.base, engine), **own, "adapters": []}


def _model_object(front: FrontDoor, model: Model, engine: Engine | None) -> dict[str, Any]:
    """The OpenAI model object, with the gateway's own fields: its engine, and its memory
    per budget (the need admission counts and where that figure came from; what its
    engine holds now, read by the caller's read_ram)."""
    info = model.describe()
    need = front.manager.capacity.need(model)
    ram = front.manager.capacity.ram_measured(model.id) if engine is not None else None
    return {
        "id": model.id, "object": "model", "created": int(model.path.stat().st_mtime)
        if model.path is not None and model.path.exists() else 0, "owned_by": "llm-gateway",
        "backend": info["backend"], "kind": info["kind"], "capabilities": info["capabilities"],
        "state": engine.state.value if engine else EngineState.STOPPED.value,
        "loaded": engine is not None and engine.state is EngineState.READY,
        "engine": engine.unit if engine else None,
        "vram_estimate_mib": need.vram_mib, "vram_estimate_source": need.vram_source,
        "vram_measured_mib": front.manager.capacity.measured_mib(model),
        "ram_estimate_mib": need.ram_mib, "ram_estimate_source": need.ram_source,
        "ram_measured_mib": ram.current_mib if ram else None,
        "ram_measured_source": ram.source if ram else None,
        "ram_peak_mib": ram.peak_mib if ram else None,
        "context_length": info["context_length"], "quantization": info["quantization"],
        "parameter_count": info["parameter_count"], "architecture": info["architecture"],
        "aliases": info["aliases"], "adapters": info["adapters"],
        "spill_over": [r.upstream for r in front.remotes.candidates(model.names)]
        if model.config.spill_over else None,
    }


async def proxy_request(request: web.Request) -> web.StreamResponse:
    """An engine route of the table: the request parsed into a Call, delivered to whoever
    answers it (deliver), and recorded however it ends."""
    front = request.app[FRONT]
    t0 = time.monotonic()
    key = request_key(request)
    record = CallRecord(ts=time.time(), method=request.method, endpoint=request.path,
                        api_key=key.name if key is not None else None)
    told: Progress | None = None   # a stream told of its wait (http/waiting)
    try:
        call = await parse_call(front, request, key, record, t0)
        told = call.told
        response = await deliver(front, call)
        if front.config.records_store_text and isinstance(response, web.Response) \
                and isinstance(response.body, bytes):
            record.response_text = _capped(response.body, front.config.records_text_max_bytes)
        return response
    except ClientLeft as e:   # while its wait was told (recorded)
        return e.response
    except GatewayError as e:
        if told is not None and told.response is not None:
            return await told.end(e)   # its 200 is out: the stream's error event says it
        record.status, record.outcome, record.error_code = e.status, "error", e.code
        record.error_source = ErrorSource.GATEWAY.value   # (the middleware answers it)
        raise
    except web.HTTPException as e:
        record.status, record.outcome = e.status, "error"
        record.error_source = ErrorSource.GATEWAY.value
        raise
    except asyncio.CancelledError:
        if record.stream:   # a stream's relay knows whether it was all delivered
            raise
        if told is not None and told.response is not None:   # told of its wait, then:
            if request.app[SHUTDOWN].expired:
                return await told.end(shutdown_error())   # (done: not re-raised)
            told.left()
            raise
        if request.app[SHUTDOWN].expired:   # cancelled at the drain deadline: the client is there
            error = shutdown_error()
            record.status, record.outcome, record.error_code = error.status, "error", error.code
            record.error_source = ErrorSource.GATEWAY.value
            raise error from None
        record.disconnected, record.outcome = True, "disconnected"
        raise
    finally:
        record.latency_ms = (time.monotonic() - t0) * 1000
        if front.records is not None:
            front.records.add(record)
        if front.metrics is not None:
            front.metrics.observe_call(record)


async def parse_call(front: FrontDoor, request: web.Request, key: ApiKey | None,
                     record: CallRecord, t0: float) -> Call:
    """The request as it will go out: its route, body, model (the key's rules checked),
    class, and our changes to it; raises the client's error otherwise."""
    matched = request_route(request)
    if matched is None or not matched.route.engine:
        # only an engine route of the table (core/routes.py) is relayed; the gate
        # (http/auth) stops the rest, and an app built without it relays nothing
        raise RouteNotFound(f"{request.path} is not a path this gateway serves")
    body = await read_body(request, front.config.max_body_bytes)
    record.bytes_in = len(body)
    model, payload, multipart = await model_of(request, body)
    asked = model or request.query.get("model")
    catalog = front.manager.catalog
    if asked is not None:
        check_asked(key, catalog, asked)
    try:
        model_id = choose_model(request.path, asked, catalog=catalog,
                                engines=front.manager.registry.engines(),
                                default_model=front.config.default_model)
    except ModelNotFound as e:
        if asked is None or not front.remotes.candidates((asked,)):
            e.extra["available_models"] = available_models(front, key)
            raise
        model_id = asked    # a remote model: served by an upstream only
    served = catalog.find_served(model_id)   # a variant's: its base's engine answers
    local = served.model if served is not None else None
    names = served.names if served is not None else frozenset({model_id.casefold()})
    record.model = model_id
    headers = request_headers(request.headers)   # never the client's key: ours to check
    if key is not None:
        check_model(key, model_id, names)
    # Inference (POST) may load a model and counts as use for eviction; polls such
    # as GET /props or /metrics?model= neither load one nor keep one alive.
    inference = request.method == "POST"
    autoload = (inference and front.config.autoload
                and request.query.get("autoload") != "false")
    stream = payload is not None and payload.get("stream") is True
    try:   # its class for the order of waiting models (core/priority)
        priority = of_request(key.priority if key is not None else None,
                              served.priority if served is not None else NORMAL,
                              request.headers.get(PRIORITY_HEADER))
    except ValueError as e:
        raise InvalidRequest(str(e), param=PRIORITY_HEADER) from None
    changed = served is not None and inference and shaped(served, request.path, payload,
                                                          multipart)
    if local is not None and payload is not None and named_for_engine(local, payload):
        changed = True
    drop_usage = False
    if stream and request.path in USAGE_PATHS and payload is not None:
        options = payload.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage")):
            # ask for usage on the client's behalf (for the record), hide it again
            payload["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                         "include_usage": True}
            changed = drop_usage = True
    if changed:
        body = json.dumps(payload).encode()
    if request.path in TRANSLATION_PATHS and not multipart:
        raise InvalidRequest("a translation is a multipart/form-data upload with a "
                             "`file` and a `model` field")
    if front.config.records_store_text and not multipart:
        record.request_text = _capped(body, front.config.records_text_max_bytes)
    told = waits_told(front, request, record, t0, local.id) \
        if stream and local is not None else None
    return Call(request, record, t0, payload, body, headers, stream, drop_usage,
                matched.target, model_id=model_id, local=local,
                names=local.names if local is not None else names,
                upstream_route=matched.route.upstream, multipart=multipart,
                inference=inference, autoload=autoload,
                whisper=local is not None and local.backend is Backend.WHISPER,
                priority=priority, client=client_of(request, key), told=told,
                adapter=served.shape.adapter if served is not None else None)


@dataclass
class Call:
    """One request on its way out, as parsed (the body with our changes)."""

    request: web.Request
    record: CallRecord
    t0: float
    payload: dict[str, Any] | None
    body: bytes
    headers: CIMultiDict[str]
    stream: bool
    drop_usage: bool
    target: str       # the path to send on: the route table's spelling, not the client's
    model_id: str = ""
    local: Model | None = None     # None: a remote model, served by an upstream only
    # the model's names, as upstreams are asked (a variant's: its base's)
    names: frozenset[str] = frozenset()
    upstream_route: bool = False   # an OpenAI path under /v1/, which an upstream may take
    multipart: bool = False
    inference: bool = True   # a POST: it may load the model and counts as use
    autoload: bool = False
    whisper: bool = False   # a whisper model's: its engine is whisper-server, whose
                            # requests and answers differ from OpenAI's
    priority: int = NORMAL  # its class (core/priority): its turn is taken in it
    client: str | None = None   # who asks, as the order's grace tells clients apart
    told: Progress | None = None   # its wait told to its client: the stream begun there
    adapter: Applied | None = None   # the LoRA adapter its name applies (core/variants)


def shaped(served: Served, path: str, payload: dict[str, Any] | None,
           multipart: bool) -> bool:
    """The body changed as its name says (core/variants: a variant's defaults and limits;
    the adapter goes in at the engine, relay_local); whether it changed. A request on a
    generating path whose body cannot carry a limit (an upload, no JSON object) is
    refused: the limit would not hold."""
    if not served.shape.changes_anything:
        return False
    if payload is None:
        if served.shape.max_tokens is None or path not in INFERENCE_PATHS:
            return False   # defaults are for JSON requests; an upload keeps its own
        what = "is an upload" if multipart else "has no JSON body"
        raise InvalidRequest(
            f"{served.id!r} has a length limit, which the gateway sets in a JSON body: "
            f"this request {what}", param="model")
    return shape_body(served.shape, path, payload)


def client_of(request: web.Request, key: ApiKey | None) -> str | None:
    """Who asks, as core/scheduler's grace tells clients apart: the host it connects
    from, and its key where keys are on (not the connection: curl and many scripts open
    one per request). None where the host cannot be told (a unix socket): the grace then
    holds as for a stranger."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(peer, tuple) and peer:
        return f"{key.name if key is not None else ''}@{peer[0]}"
    return None


async def deliver(front: FrontDoor, call: Call) -> web.StreamResponse:
    """The request to whoever answers it: a remote model's upstream, or its model's engine
    for one journey (service/dispatcher.journey: the turn, the send, the one retry on an
    engine systemd restarts, the turn given back), its file pulled first where it has
    none yet; a local model with spill_over goes to an upstream when it gets no turn."""
    local = call.local
    if local is None:
        return await relay_remote(front, call)
    if call.inference:
        front.activity.seen(local.id)
    told = call.told
    if not local.config.downloaded and call.autoload and front.puller is not None:
        # its file pulled from its source first, within the wait for a load; the
        # catalog has it once this returns (503 model_downloading with the ETA if not)
        pulled = front.puller.ensure(local, front.config.load_timeout_s)
        await (pulled if told is None else told.wait(pulled))

    async def spill_over(e: GatewayError) -> web.StreamResponse:
        if not isinstance(e, SPILL_OVER):
            raise e
        log.info("%s cannot take the request here (%s): spilling over", local.id, e.code)
        return await relay_remote(front, call)

    spills = local.config.spill_over and call.upstream_route \
        and bool(front.remotes.candidates(call.names))
    return await front.dispatcher.journey(
        local.id, lambda engine: relay_local(front, call, engine), autoload=call.autoload,
        counts_as_use=call.inference, priority=call.priority, client=call.client,
        wait=None if told is None else told.wait, no_turn=spill_over if spills else None)


async def relay_local(front: FrontDoor, call: Call, engine: Engine) -> web.StreamResponse:
    """To the model's engine, in the turn the journey took."""
    request = call.request
    body, path = call.body, call.target
    if call.whisper and call.multipart and request.path in TRANSLATION_PATHS:
        # whisper-server has one inference path (an openai server its own translations)
        body = as_whisper_translation(body, _boundary(request))
        path = WHISPER_INFERENCE_PATH
    target = _with_query(path, request)
    call.record.engine = engine.unit
    loaded = loaded_adapters(engine.adapters,
                             call.local.config.adapters if call.local else ())
    if call.inference and request.path in INFERENCE_PATHS and with_adapters(
            request.path, call.payload, loaded, call.adapter, call.model_id):
        body = json.dumps(call.payload).encode()   # its engine's own lora list
    send = to_engine(front.engine_client, engine.socket, request.method, target,
                     call.headers, body, stream=call.stream)
    return await relay(request, outgoing(front.config, send, call), call.record, call.t0)


async def relay_remote(front: FrontDoor, call: Call) -> web.StreamResponse:
    """To the first upstream serving one of the model's names that is up and has room."""
    request, names, asked = call.request, call.names, call.model_id
    route = request_route(request)
    if route is None or not route.route.upstream:
        raise InvalidRequest(f"{asked!r} is served by a remote upstream, which is asked "
                             f"only on the OpenAI paths under {REMOTE_PREFIX}, not "
                             f"{request.path}",
                             param="model")
    try:
        remote, target = front.remotes.take(names, asked)
    except (UpstreamUnreachable, ConcurrencyLimit) as e:
        call.record.upstream = ",".join(e.extra.get("upstreams", ()))   # the ones that said no
        raise
    call.record.upstream = remote.name
    try:
        body, payload = call.body, call.payload
        if payload is not None and payload.get("model") != target.id:
            payload["model"] = target.id     # the name the upstream knows it by
            body = json.dumps(payload).encode()
        headers = call.headers.copy()
        headers.update(remote.auth_headers())
        assert remote.session is not None
        send = to_remote(remote.session, request.method,
                         remote.config.url_for(_with_query(call.target, request)),
                         headers, body)
        out = outgoing(front.config, send, call, upstream=remote.name,
                       redact=remote.config.redact)
        try:
            return await relay(request, out, call.record, call.t0)
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            if never_connected(e.__cause__):
                front.remotes.connect_failed(remote, remote.config.redact(str(e.__cause__)))
            raise
    finally:
        front.remotes.release(remote)


def check_asked(key: ApiKey | None, catalog: Catalog, asked: str) -> None:
    """The key's model check, before anything that depends on the model (its kind,
    whether it exists): a key learns nothing of models it may not use."""
    if key is not None:
        found = catalog.find_served(asked)
        check_model(key, found.id if found else asked,
                    found.names if found else frozenset({asked.casefold()}))


def _with_query(path: str, request: web.Request) -> str:
    """path (the route table's) with the client's query string as it was sent."""
    query = request.rel_url.raw_query_string
    return path + (f"?{query}" if query else "")


def outgoing(config: GatewayConfig, send: Callable[[], Awaitable[Answer]], call: Call,
             **remote: Any) -> Outgoing:
    """How a call goes out, with the configuration's timeouts and bounds in force."""
    return Outgoing(send=send, stream=call.stream, drop_usage_event=call.drop_usage,
                    stall_timeout_s=config.read_timeout_s,
                    max_answer_bytes=config.max_answer_bytes,
                    max_event_bytes=config.max_event_bytes, whisper=call.whisper,
                    response=call.told.response if call.told is not None else None,
                    **remote)


def waits_told(front: FrontDoor, request: web.Request, record: CallRecord, t0: float,
               model_id: str) -> Progress | None:
    """A stream's waits told to its client, where the setting and the client's header say
    so (core/progress.wanted; a header value that is neither yes nor no is a 400)."""
    try:
        if not progress.wanted(front.config.stream_progress,
                               request.headers.get(progress.HEADER)):
            return None
    except ValueError as e:
        raise InvalidRequest(str(e), param=progress.HEADER) from None
    return Progress(request, record, t0, model_id, dispatcher=front.dispatcher,
                    engines=front.manager, puller=front.puller,
                    stall_timeout_s=front.config.read_timeout_s)


def available_models(front: FrontDoor, key: ApiKey | None) -> list[str]:
    """The models the caller may use (all of them with keys off)."""
    catalog = front.manager.catalog
    ids = [m.id for m in (*catalog, *catalog.variants)
           if key is None or key.may_use(m.id, m.names)]
    return [*ids, *(m for _, m in front.remotes.serving()
                    if m not in ids and catalog.find_served(m) is None
                    and (key is None or key.may_use(m)))]


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"the request body ({request.content_length} bytes) is over the "
                           f"limit of {limit} bytes (max_body_mb)", limit=limit)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(f"the request body is over the limit of {limit} bytes "
                           "(max_body_mb)", limit=limit) from None


async def model_of(request: web.Request, body: bytes) -> tuple[str | None, dict | None, bool]:  # type: ignore[type-arg]
    """(model, JSON payload, is multipart) of a request body."""
    if not body:
        return None, None, False
    if request.content_type == "multipart/form-data":
        return await multipart_model(request, body), None, True
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("the body is nested too deeply to be parsed") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("the body must be a JSON object")
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("\"model\" must be a string", param="model")
    return model, payload, False


async def multipart_model(request: web.Request, body: bytes) -> str | None:
    """The `model` form field, found by its Content-Disposition name (never a filename),
    in the body read whole (it is forwarded byte for byte: http/form_field.py parses it
    where it lies). A body cut short (its closing boundary missing) is refused here: the
    engine would answer it with its own plain-text 400."""
    from gatewayd.http import form_field  # audio uploads only: not on the start's path

    boundary = _boundary(request)
    try:
        model = form_field.text_field(body, boundary, "model")
    except form_field.FormError as e:   # the client's bytes: a 400
        raise InvalidRequest(f"the multipart body cannot be parsed: {e}") from None
    if body.rfind(b"--" + boundary.encode() + b"--") == -1:
        raise InvalidRequest("the multipart body cannot be parsed: it ends before its "
                             "closing boundary (cut short?)")
    return model


def _boundary(request: web.Request) -> str:
    """The multipart boundary its Content-Type names (form_field checks it is one); a 400
    where it names none."""
    boundary = str(parse_mimetype(request.headers.get("Content-Type", "")).parameters.get(
        "boundary", ""))
    if not boundary:
        raise InvalidRequest("the multipart body cannot be parsed: its Content-Type "
                             "names no boundary")
    return boundary


def _capped(data: bytes, limit: int) -> str:
    return data[:limit].decode(errors="replace")

