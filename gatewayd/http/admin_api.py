"""The admin HTTP API: list, start and stop engines, read their logs. Thin handlers.

Model names travel in the JSON body or the query string, never in the URL
path, so no name (with slashes, dots or anything else) can change the route.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from gatewayd.adapters import records
from gatewayd.adapters.engine_wire.errors import EngineConnectionError
from gatewayd.adapters.engine_wire.exchange import exchange
from gatewayd.adapters.events import EventHub
from gatewayd.adapters.journal import Journals
from gatewayd.adapters.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gatewayd.adapters.metrics import EngineFigures, Snapshot
from gatewayd.core import logs, model_server, placement, scheduler
from gatewayd.core.budget import MIB
from gatewayd.core.catalog import Catalog
from gatewayd.core.config import Backend, GatewayConfig
from gatewayd.core.engines import COMING_STATES, PLACE_STATES, Engine, EngineState
from gatewayd.core.errors import GpuUnavailable, InvalidRequest, NotASystemdUnit
from gatewayd.core.model_server import KvUse
from gatewayd.core.ports import EngineUnitInfo
from gatewayd.core.priority import NAMES
from gatewayd.core.query import FOLLOW_LINES
from gatewayd.core.waits import Swap
from gatewayd.http import openai_api
from gatewayd.http.auth import query_of
from gatewayd.http.batches_api import BATCHES
from gatewayd.http.sse import SSE_HEADERS, sse_event
from gatewayd.service.dispatcher import Dispatcher
from gatewayd.service.engine_manager import EngineManager
from gatewayd.service.engine_parts import EngineHooksView, EngineParts
from gatewayd.service.pulls import Puller
from gatewayd.service.reload import Reloader

ENGINES = web.AppKey("engines", EngineManager)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
EVENTS = web.AppKey("events", EventHub)
RELOADER = web.AppKey("reloader", Reloader)
PULLER = web.AppKey("puller", Puller)
JOURNALS = web.AppKey("journals", Journals)
KV_READINGS = web.AppKey("kv_readings", model_server.KvReadings)
HEARTBEAT_S = 15.0
ENGINE_METRICS_TIMEOUT_S = 2.0
# a picker scrapes every second or faster: a busy engine's slots are left out, not waited on
ENGINE_SLOTS_TIMEOUT_S = 0.5


class AdminEngines(EngineParts, Protocol):
    """What the admin API asks of the engine layer (service/engine_manager has it): the
    catalog and configuration in force, the parts by name, and what only the whole layer
    says (its overview, the GPU's devices, parked units, an engine's journal)."""

    @property
    def catalog(self) -> Catalog: ...

    @property
    def config(self) -> GatewayConfig: ...

    @property
    def hooks(self) -> EngineHooksView: ...

    def describe(self) -> dict[str, Any]: ...

    def gpu_devices(self) -> list[placement.DeviceMemory] | None: ...

    def parked(self) -> list[str]: ...

    async def logs(self, model_id: str, lines: int) -> list[str]: ...

    def log_unit(self, model_id: str) -> tuple[str, str]: ...


def _engines(request: web.Request) -> AdminEngines:
    return request.app[ENGINES]



# beside this module, not through importlib.resources: that and the zipfile it imports
# would be imported on the socket-activated start's path (docs/benchmarks.md, "Figures
# behind choices in the code"), and the package is always installed as files (its
# preloaded wait is a library LD_PRELOAD must find on disk)
def _page() -> tuple[bytes, dict[str, str]]:
    """The page with its scripts inlined (one request, and the scripts stay files of their
    own, which ESLint and node's unit tests read: tests/js), and the headers it is served
    with: a Content-Security-Policy that runs those scripts alone (by their hashes: no
    other inline or remote script, no eval), lets the page talk only to this gateway, and
    lets no page of any site frame it (a framing page could trick clicks on start/stop);
    X-Frame-Options for browsers that predate frame-ancestors."""
    here = Path(__file__).parent
    page = (here / "status_page.html").read_bytes()
    hashes = []
    for name in ("console_core.js", "console_page.js"):
        tag = f'<script src="{name}"></script>'.encode()
        if tag not in page:
            raise RuntimeError(f"status_page.html does not load {name}")
        script = b"\n" + (here / name).read_bytes()
        hashes.append("'sha256-" + base64.b64encode(hashlib.sha256(script).digest()).decode()
                      + "'")
        page = page.replace(tag, b"<script>" + script + b"</script>")
    policy = ("default-src 'none'; script-src " + " ".join(hashes) + "; "
              # style="" attributes in the page; styles cannot run code
              "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
              "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return page, {"Content-Security-Policy": policy, "X-Frame-Options": "DENY",
                  "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                  "Cache-Control": "no-cache"}


STATUS_PAGE, PAGE_HEADERS = _page()


async def status_page(request: web.Request) -> web.Response:
    """The status page: one self-contained file (no build step, no CDN) that reads this
    API and follows /admin/events."""
    return web.Response(body=STATUS_PAGE, content_type="text/html", charset="utf-8",
                        headers=PAGE_HEADERS)


async def status(request: web.Request) -> web.Response:
    mgr = _engines(request)
    ram = mgr.capacity.ram()
    return web.json_response({
        **mgr.describe(),
        **_gpu_memory(request),
        "ram_memory_mib": ram.describe() if ram is not None else None,
        "config": str(mgr.config.source) if mgr.config.source else None,
        "records_dropped": front.records.dropped
        if (front := request.app.get(openai_api.FRONT)) and front.records else 0,
        "upstreams": front.remotes.describe() if front else [],
        # models being downloaded (state downloading/verifying), and the last finished
        "pulls": [p.describe() for p in puller.pulls()]
        if (puller := request.app.get(PULLER)) else [],
        # the order for room and the models waiting for it, head first
        "schedule": dispatcher.schedule()
        if (dispatcher := request.app.get(DISPATCHER)) is not None else None,
        # the batch jobs not yet ended (OpenAI's Batch objects), oldest first
        "batches": [{**b.describe(), "owner": b.owner} for b in await batches.unended()]
        if (batches := request.app.get(BATCHES)) is not None else [],
    })


async def reload_config(request: web.Request) -> web.Response:
    """Re-read the configuration in place (as SIGHUP does); 422 config_invalid, with the
    reason, when it is refused (the configuration in force stays)."""
    plan = await request.app[RELOADER].reload()
    return web.json_response({"reloaded": True, **plan.as_json()})


async def models(request: web.Request) -> web.Response:
    mgr = _engines(request)
    return web.json_response({"models": [m.describe() for m in mgr.catalog],
                              "variants": [v.describe() for v in mgr.catalog.variants]})


async def list_engines(request: web.Request) -> web.Response:
    mgr = _engines(request)
    uses = _uses(request)
    rows = []
    mgr.capacity.read_ram()
    vram = mgr.capacity.vram_held() if mgr.capacity.has_gpu() else {}
    for engine in mgr.registry.engines():
        row = engine_json(mgr, engine, await mgr.lifecycle.info(engine.unit))
        # measured on the GPU (NVML, per process): the console's bars set it beside the need
        row["vram_mib"] = vram.get(engine.model_id)
        use = uses.get(engine.model_id)
        row["in_flight"], row["queued"] = (use.in_flight, use.queued) if use else (0, 0)
        row["priority"] = NAMES[use.priority] if use else None   # its requests' class
        rows.append(row)
    return web.json_response({"engines": rows})


async def start_engine(request: web.Request) -> web.Response:
    mgr = _engines(request)
    model = mgr.catalog.resolve(await _model_field(request))
    if (puller := request.app.get(PULLER)) is not None:   # a source not pulled yet
        await puller.ensure(model, mgr.config.load_timeout_s)
    engine = await mgr.lifecycle.start(model.id)
    mgr.capacity.read_ram()
    info = await mgr.lifecycle.info(engine.unit)
    return web.json_response({"engine": engine_json(mgr, engine, info)})


async def stop_engine(request: web.Request) -> web.Response:
    mgr = _engines(request)
    name = await _model_field(request)
    model_id = name if mgr.registry.get(name) else mgr.catalog.resolve(name).id
    engine = await mgr.lifecycle.stop(model_id)
    return web.json_response({"engine": engine_json(mgr, engine, None)})


async def engine_logs(request: web.Request) -> web.StreamResponse:
    """An engine's journal: its last lines (?lines=N, default 100); with ?follow=1 an event
    stream, the last lines (default 50) then each one as it is written; ?grep=TEXT keeps
    the lines that contain TEXT (any case)."""
    mgr = _engines(request)
    q = query_of(request)
    name = q.get("model")
    if not name:
        raise InvalidRequest("give the model: ?model=NAME", param="model")
    follow = q.get("follow", False)
    lines = q.get("lines", FOLLOW_LINES if follow else 100)
    model_id = name if mgr.registry.get(name) else mgr.catalog.resolve(name).id
    keep = logs.line_filter(q.get("grep"))
    if follow:   # the unit from the engine or the catalog, never the query's text
        return await _follow_log(request, *mgr.log_unit(model_id), lines, keep)
    return web.json_response({"model": model_id, "lines": [
        line for line in await mgr.logs(model_id, lines) if keep(line)]})


async def gateway_logs(request: web.Request) -> web.StreamResponse:
    """The gateway's own journal, as engine_logs gives an engine's: where it runs as a
    systemd unit (else 409 not_a_systemd_unit)."""
    journals = request.app[JOURNALS]
    q = query_of(request)
    follow = q.get("follow", False)
    lines = q.get("lines", FOLLOW_LINES if follow else 100)
    keep = logs.line_filter(q.get("grep"))
    own = journals.own_unit()
    if own is None:
        raise NotASystemdUnit("the gateway is not running as a systemd unit: its log is its "
                              "standard error")
    if follow:
        return await _follow_log(request, own.unit, own.manager, lines, keep)
    found = await journals.tail(own.unit, own.manager, lines)
    return web.json_response({"unit": own.unit, "lines": [ln for ln in found if keep(ln)]})


async def _follow_log(request: web.Request, unit: str, manager: str, lines: int,
                      keep: Callable[[str], bool]) -> web.StreamResponse:
    """SSE: one event per journal line, {"line": "..."}, the last `lines` then each one as
    it is written; {"type": "shutdown"} last when the gateway stops, {"type": "end"} if
    journalctl ends by itself. The journalctl process ends when the client goes away."""
    if request.method == "HEAD":   # the head only: no journalctl for it
        return web.Response(headers=SSE_HEADERS)
    journals = request.app[JOURNALS]
    follow = await journals.follow(unit, manager, lines)   # 429 past the bound: no stream
    response = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await response.prepare(request)
        while True:
            try:
                line = await asyncio.wait_for(follow.line(), HEARTBEAT_S)
            except TimeoutError:   # (the line being read stays for the next read)
                await response.write(b": keep-alive\n\n")
                continue
            if line is None:
                await follow.end()   # reaped: its exit status is known
                end = {"type": "shutdown"} if journals.closed else {
                    "type": "end", "reason": f"journalctl ended (exit status "
                                             f"{follow.exit_status})"}
                await response.write(sse_event({**end, "ts": time.time()}))
                break
            if keep(line):
                await response.write(sse_event({"line": line}))
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        await follow.end()
    return response


async def call_records(request: web.Request) -> web.Response:
    """Newest first; filters: model, endpoint, since/until (epoch seconds), status, outcome,
    limit."""
    mgr = _engines(request)
    q = query_of(request)
    rows = await records.search(
        mgr.config.records_file, model=q.get("model"), since=q.get("since"),
        until=q.get("until"), status=q.get("status"), outcome=q.get("outcome"),
        endpoint=q.get("endpoint"), limit=q.get("limit", 100))
    return web.json_response({"records": rows})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition: the gateway's counters plus the current figures (engine
    states, queues, systemd's memory and CPU per engine unit, GPU memory); with
    ?engines=1 also every ready llama engine's own /metrics, labelled by model."""
    mgr, front = _engines(request), request.app[openai_api.FRONT]
    if front.metrics is None:
        raise web.HTTPNotFound()
    kv_counts = mgr.hooks.kv_cache_counts()
    snapshot = Snapshot(max_engines=mgr.config.max_engines, parked=len(mgr.parked()),
                        records_dropped=front.records.dropped if front.records else 0,
                        kv_cache=kv_counts,
                        upstreams=[(r.name, r.up, r.in_flight) for r in front.remotes.remotes()])
    if (batches := request.app.get(BATCHES)) is not None:
        snapshot.batch_lines = await batches.lines_waiting()
    pruned = front.records.pruned if front.records else {}
    snapshot.bounded = {"engine_framing": front.engine_client.refused["framing"],
                        "records_max_age_days": pruned.get("age", 0),
                        "records_max_mb": pruned.get("size", 0),
                        "kv_cache_unconfigured": kv_counts.get(("prune", "removed"), 0)}
    ram = mgr.capacity.ram()   # read first: each engine's RAM below is this reading's
    engines = mgr.registry.engines()
    ready_llama = [e for e in engines if e.state is EngineState.READY
                   and (model := mgr.catalog.get(e.model_id)) is not None
                   and model.backend is Backend.LLAMA]
    infos, kv = await asyncio.gather(asyncio.gather(*(mgr.lifecycle.info(e.unit)
                                                      for e in engines)),
                                     _engine_kv(mgr, ready_llama, request.app[KV_READINGS]))
    vram_held = mgr.capacity.vram_held()
    uses = _uses(request)   # after the waits above: one moment with the engines' figures
    for engine, info in zip(engines, infos, strict=True):
        use = uses.get(engine.model_id)
        snapshot.engines.append(EngineFigures(
            model=engine.model_id, state=engine.state.value, restarts=engine.restarts,
            in_flight=use.in_flight if use else 0, queued=use.queued if use else 0,
            waiting=front.engine_client.waiting(engine.socket),
            memory_bytes=info.memory_bytes if info else None,
            cpu_seconds=info.cpu_ns / 1e9 if info and info.cpu_ns is not None else None,
            memory=_engine_memory(mgr, engine, vram_held.get(engine.model_id)),
            adapters=engine.adapters or (), kv=kv.get(engine.model_id)))
    gpu = _gpu_memory(request)   # a lost GPU: no figures (status says why)
    for d in gpu["gpu_devices"] or ():
        snapshot.gpus.append((d["uuid"], (d["total"] - d["free"]) * MIB, d["total"] * MIB))
    if (ledger := gpu["gpu_memory_mib"]) is not None:
        snapshot.budgets.update({("gpu", figure): ledger[key] * MIB for figure, key in (
            ("total", "total"), ("available", "free"), ("claimed", "held_by_engines"),
            ("pending", "pending_loads"), ("free", "free_for_planning"))})
    if ram is not None:
        snapshot.budgets.update({("ram", figure): mib * MIB for figure, mib in (
            ("total", ram.total_mib), ("available", ram.available_mib),
            ("reserve", ram.reserve_mib), ("budget", ram.budget_mib),
            ("claimed", ram.claimed_mib), ("pending", ram.pending_mib),
            ("free", ram.plan_free_mib)) if mib is not None})
    _as_one_model_server(snapshot, mgr, request.app.get(DISPATCHER), uses)
    own = None
    if query_of(request).get("engines", False):
        own = await _engine_metrics(ready_llama)
    return web.Response(body=front.metrics.render(snapshot, own),
                        headers={"Content-Type": METRICS_CONTENT_TYPE})


def _as_one_model_server(snapshot: Snapshot, mgr: AdminEngines,
                         dispatcher: Dispatcher | None,
                         uses: dict[str, scheduler.Usage]) -> None:
    """The host's figures for an endpoint picker (core/model_server), from the engines'
    figures and memory budgets already in snapshot and the dispatcher's queues (a model
    waiting for room for its first engine has a queue and no engine). An engine being
    drained to make room for another is neither running nor coming: it is on its way out."""
    depths = dispatcher.queue_depths() if dispatcher is not None else {}
    listed = {e.model for e in snapshot.engines}
    snapshot.queued_no_engine = {m: n for m, n in depths.items() if m not in listed}
    waiting = sum(e.waiting for e in snapshot.engines)
    snapshot.requests_waiting = sum(depths.values()) + waiting
    snapshot.requests_running = max(0, sum(e.in_flight for e in snapshot.engines) - waiting)
    leaving = {m for m, u in uses.items() if u.draining}
    ready = [e.model for e in snapshot.engines
             if e.state == EngineState.READY.value and e.model not in leaving]
    coming = {e.model for e in snapshot.engines if EngineState(e.state) in COMING_STATES}
    coming |= {m for m in depths if m not in ready and m not in leaving}
    places = sum(1 for e in snapshot.engines if EngineState(e.state) in PLACE_STATES)
    held = {*ready, *coming, *leaving}
    # the smallest model not running (by its files) stands for "one more": one estimate a
    # scrape, not one for every model in models_dir (a picker scrapes every second)
    smallest = min((m for m in mgr.catalog if m.id not in held),
                   key=lambda m: m.size_bytes, default=None)
    needs = [] if smallest is None else [mgr.capacity.need(smallest)]
    budgets = snapshot.budgets
    room = model_server.room_for_one_more(
        places, mgr.config.max_engines,
        [(n.ram_mib * MIB, n.vram_mib * MIB if mgr.capacity.has_gpu() else 0) for n in needs],
        budgets.get(("ram", "free")), budgets.get(("gpu", "free")))
    snapshot.warm = model_server.warm(
        {m: mgr.catalog.engine_names(m) for m in {*ready, *coming}}, ready, coming, room=room)


def _engine_memory(mgr: AdminEngines, engine: Engine, vram_mib: int | None
                   ) -> dict[tuple[str, str], int]:
    """llm_gateway_memory_engine_bytes of one engine: (memory, figure) -> bytes, the figures
    known only (its RAM from the caller's reading)."""
    out: dict[tuple[str, str], int] = {}
    if (model := mgr.catalog.get(engine.model_id)) is not None:
        need = mgr.capacity.need(model)
        out["ram", "need"] = need.ram_mib * MIB
        if mgr.capacity.has_gpu():
            out["vram", "need"] = need.vram_mib * MIB
    if (use := mgr.capacity.ram_measured(engine.model_id)) is not None:
        out["ram", "measured"] = use.current_bytes
        if use.peak_bytes is not None:
            out["ram", "peak"] = use.peak_bytes
    if vram_mib is not None:
        out["vram", "measured"] = vram_mib * MIB
    return out


async def _engine_metrics(engines: list[Engine]) -> dict[str, str]:
    """Each engine's own /metrics text (llama-server --metrics); one that does not answer
    in time is left out, never the whole scrape."""
    async def one(engine: Engine) -> tuple[str, str | None]:
        try:
            status, body = await exchange(engine.socket, "GET", "/metrics",
                                          timeout=ENGINE_METRICS_TIMEOUT_S)
            return engine.model_id, body.decode(errors="replace") if status == 200 else None
        except (TimeoutError, EngineConnectionError, OSError):
            return engine.model_id, None
    found = await asyncio.gather(*(one(e) for e in engines))
    return {model: text for model, text in found if text is not None}


async def _engine_kv(mgr: AdminEngines, engines: list[Engine],
                     readings: model_server.KvReadings) -> dict[str, KvUse]:
    """Each ready llama engine's KV use from its /slots; one that does not answer in time
    (busy with a long prompt) counts at its last reading; one never read is left out (its
    figure absent, never made up)."""
    from gatewayd.core.memory_estimate import EngineSettings  # (not on the start's path)

    def shared(model_id: str) -> bool:
        model = mgr.catalog.get(model_id)
        return model is None or EngineSettings.parse(
            model.config.args, ctx_size=model.config.ctx_size).unified

    async def one(engine: Engine) -> tuple[str, KvUse | None]:
        try:
            status, body = await exchange(engine.socket, "GET", "/slots",
                                          timeout=ENGINE_SLOTS_TIMEOUT_S)
            return engine.model_id, model_server.kv_use(
                json.loads(body), shared=shared(engine.model_id)) if status == 200 else None
        except (TimeoutError, EngineConnectionError, OSError, ValueError, RecursionError):
            return engine.model_id, None
    return readings.read(dict(await asyncio.gather(*(one(e) for e in engines))))


def _uses(request: web.Request) -> dict[str, scheduler.Usage]:
    """Per model, its requests in flight and queued (the dispatcher's view)."""
    dispatcher = request.app.get(DISPATCHER)
    return {u.model_id: u for u in dispatcher.usages()} if dispatcher is not None else {}


def _gpu_memory(request: web.Request) -> dict[str, Any]:
    """status's gpu_memory_mib (the ledger), gpu_devices (each device and the engines
    placed on it), both from one fresh reading, and gpu_error (why there is none when
    NVML fails)."""
    mgr = _engines(request)
    try:
        devices = mgr.gpu_devices()
    except GpuUnavailable as e:
        return {"gpu_memory_mib": None, "gpu_devices": None, "gpu_error": e.message}
    if devices is None:
        return {"gpu_memory_mib": None, "gpu_devices": None, "gpu_error": None}
    ledger = scheduler.memory_ledger(*placement.total(devices), _uses(request).values())
    engines = [e for e in mgr.registry.engines() if e.holds_place]
    return {"gpu_error": None, "gpu_memory_mib": {
        "total": ledger.total_mib, "free": ledger.free_mib, "held_by_engines": ledger.held_mib,
        "pending_loads": ledger.pending_mib, "external": ledger.external_mib,
        "free_for_planning": ledger.plan_free_mib},
        "gpu_devices": [{"index": d.index, "uuid": d.uuid, "name": d.name,
                         "total": d.total_mib, "free": d.free_mib,
                         "engines": [e.model_id for e in engines
                                     if not e.devices or d.uuid in e.devices]}
                        for d in devices]}


def publish_engine(hub: EventHub, mgr: AdminEngines, old: Engine, new: Engine,
                   swap: Callable[[str], Swap | None] | None = None) -> None:
    """Engine state changes as events: starting, ready (load_s: from its start or restart),
    failed and restarting (reason), stopping and stopped (why; evicted_for: the model an
    eviction made room for, and from `swap` (the dispatcher's) why it got room: because,
    rule, waited_s, core/waits.Swap)."""
    if old.state is new.state:
        publish_failure_logs(hub, old, new)
        return
    event: dict[str, Any] = {"type": "engine", "model": new.model_id, "state": new.state.value,
                             "from": old.state.value, "unit": new.unit,
                             "restarts": new.restarts}
    if new.state in (EngineState.FAILED, EngineState.RESTARTING) and new.failure is not None:
        event["reason"] = new.failure.reason
    elif new.state in (EngineState.STOPPING, EngineState.STOPPED):
        event["reason"] = mgr.lifecycle.stop_reasons.get(new.model_id,
                                                         "stopped outside the gateway")
        if (evicted_for := mgr.lifecycle.evicted_for.get(new.model_id)) is not None:
            event["evicted_for"] = evicted_for
            if swap is not None and (why := swap(new.model_id)) is not None \
                    and why.model == evicted_for:
                event.update(why.describe())
    elif new.state is EngineState.READY \
            and (load_s := mgr.registry.load_seconds(new.model_id)) is not None:
        event["load_s"] = round(load_s, 3)
    hub.publish(event)


def publish_failure_logs(hub: EventHub, old: Engine, new: Engine) -> None:
    """A failed or restarting engine's journal lines, once read (a little after its state
    event): `engine_failure` with its reason, cause and log_tail, when its first lines
    come or they say another cause (not at each re-read: the events are kept 24 h)."""
    failure = new.failure
    if failure is None or not failure.log_tail or new.state not in (
            EngineState.FAILED, EngineState.RESTARTING):
        return
    before = old.failure
    if before is not None and before.log_tail and before.cause == failure.cause:
        return
    hub.publish({"type": "engine_failure", "model": new.model_id, "state": new.state.value,
                 "unit": new.unit, **failure.describe()})


async def event_history(request: web.Request) -> web.Response:
    """The events kept for the window (adapters/events: engines, evictions, reloads, pulls'
    ends; no queue depths), oldest first; ?since=EPOCH, ?limit=N (the newest N)."""
    hub = request.app[EVENTS]
    q = query_of(request)
    since, limit = q.get("since"), q.get("limit")
    if limit is not None and not limit <= hub.keep_max:
        raise InvalidRequest(f"limit must be 1..{hub.keep_max}", param="limit")
    return web.json_response({"events": hub.history(since, limit), "kept_s": hub.keep_s,
                              "kept_max": hub.keep_max})


async def follow_events(request: web.Request) -> web.StreamResponse:
    """SSE: a snapshot first, then every engine state change and queue depth change."""
    mgr, hub = _engines(request), request.app[EVENTS]
    if request.method == "HEAD":   # the head only: aiohttp would send a stream's body too
        return web.Response(headers=SSE_HEADERS)
    queue = hub.follow()
    response = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await response.prepare(request)
        snapshot = {"type": "snapshot", "engines": [
            {"model": e.model_id, "state": e.state.value, "unit": e.unit}
            for e in mgr.registry.engines()]}
        await response.write(sse_event(snapshot))
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
            except TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            if event is None:
                await response.write(sse_event({"type": "shutdown", "ts": time.time()}))
                break
            await response.write(sse_event(event))
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        hub.unfollow(queue)
    return response


def engine_json(mgr: AdminEngines, engine: Engine, info: EngineUnitInfo | None
                ) -> dict[str, Any]:
    """An engine as the admin API shows it; its RAM from the caller's mgr.capacity.read_ram()."""
    uptime = None
    if info is not None and info.started_at_us and engine.state.value in ("loading", "ready"):
        uptime = round(time.time() - info.started_at_us / 1e6, 1)
    ram = mgr.capacity.ram_measured(engine.model_id)
    model = mgr.catalog.get(engine.model_id)
    need = mgr.capacity.need(model) if model is not None else None
    memory = info.memory_bytes if info else None
    if memory is None and ram is not None:
        # on a cgroup-v1 host systemd shows no MemoryCurrent: the meter's reading (the
        # v1 cgroup's, or the processes' PSS) is the figure there is
        memory = ram.current_bytes
    return {
        "model": engine.model_id,
        "state": engine.state.value,
        "unit": engine.unit,
        "pid": engine.main_pid or None,
        "socket": engine.socket,
        "restarts": engine.restarts,
        "uptime_s": uptime,
        "memory_bytes": memory,
        "adopted": engine.adopted,
        "gpus": list(engine.devices),
        "holds_place": engine.holds_place,   # counts against max_engines
        "failure": engine.failure.describe() if engine.failure else None,
        "ram_bytes": ram.current_bytes if ram else None,
        "ram_peak_bytes": ram.peak_bytes if ram else None,
        "ram_source": ram.source if ram else None,
        "ram_need_mib": need.ram_mib if need else None,
        "ram_need_source": need.ram_source if need else None,
        # without a GPU there is no VRAM to need (Need's figure is then unused)
        "vram_need_mib": need.vram_mib if need and mgr.capacity.has_gpu() else None,
        "vram_need_source": need.vram_source if need and mgr.capacity.has_gpu() else None,
    }


async def _model_field(request: web.Request) -> str:
    try:
        body = await request.json() if request.can_read_body else {}
    except json.JSONDecodeError:
        raise InvalidRequest("the body is not valid JSON") from None
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model.strip():
        raise InvalidRequest('give the model as {"model": "NAME"}', param="model")
    return model
