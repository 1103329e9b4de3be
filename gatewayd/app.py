"""The composition root: the one place adapters are built and wired to the core,
and the gateway process's lifecycle (serve → ready → signal → drain → stop)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import os
import resource
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from gatewayd.adapters import admin_socket, client_tls
from gatewayd.adapters.batch_store import BatchStore
from gatewayd.adapters.config_file import load_config
from gatewayd.adapters.desired import DesiredEngines
from gatewayd.adapters.engine_memory import CgroupMemoryMeter
from gatewayd.adapters.engine_wire.client import EngineClient, learn_parallel_slots
from gatewayd.adapters.event_loop import event_loop_factory
from gatewayd.adapters.events import EventHub
from gatewayd.adapters.gpu import open_gpu
from gatewayd.adapters.health import UnixHealthProbe
from gatewayd.adapters.host_memory import MemInfo
from gatewayd.adapters.host_names import own_host_names
from gatewayd.adapters.hub import HuggingFaceHub, hub_token
from gatewayd.adapters.journal import Journalctl, Journals
from gatewayd.adapters.kv_cache import KvCache
from gatewayd.adapters.learned_memory import RAM_FILE_NAME, LearnedMemory
from gatewayd.adapters.listener import Listener, bind_tcp
from gatewayd.adapters.metrics import GatewayMetrics
from gatewayd.adapters.model_files import TensorTables, load_catalog
from gatewayd.adapters.notify import Notifier, inherited_sockets
from gatewayd.adapters.records import CallRecord, RecordWriter
from gatewayd.adapters.remote_upstreams import Remotes
from gatewayd.adapters.systemd import Systemd
from gatewayd.adapters.unit_control import (
    EngineUnitsBase,
    TemplateEngineUnits,
    TransientEngineUnits,
    binary_identity,
    resolve_binary,
    runtime_root,
)
from gatewayd.core.batch import Batch, Line
from gatewayd.core.budget import MIB
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import Backend, GatewayConfig, UnitMode
from gatewayd.core.engine_units import server_binary, settings_stamp
from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.errors import ConfigError, ConfigInvalid, EngineBinaryMissing
from gatewayd.core.model_server import KvReadings
from gatewayd.core.origins import BrowserPolicy
from gatewayd.http import admin_api, batches_api, openai_api, request_parser, router
from gatewayd.http.auth import ACCESS, PARSER_LIMITS, Access, cors_headers
from gatewayd.http.drain import (
    ABANDON_GRACE_S,
    OPEN_REQUESTS,
    OpenRequests,
    drain,
    drain_notice,
    track_requests,
)
from gatewayd.http.middleware import (
    SHUTDOWN,
    ClientBytesRefused,
    Shutdown,
    close_after_upgrade,
    close_unframed,
    error_middleware,
)
from gatewayd.service.batches import Batches
from gatewayd.service.dispatcher import Dispatcher
from gatewayd.service.engine_manager import EngineManager
from gatewayd.service.liveness import Liveness
from gatewayd.service.pulls import Puller
from gatewayd.service.reload import Reloader
from gatewayd.service.restore import Reconciler, adopt, restore

log = logging.getLogger("gatewayd")
COLLECTOR_SETTLE_S = 1.0   # after the start, the garbage collector back on (settle_collector)
DAY_S = 86400.0
CONFIG = web.AppKey("config", GatewayConfig)
NOTIFIER = web.AppKey("notifier", Notifier)
RESTORE = web.AppKey("restore", asyncio.Task[None])
UNITS = web.AppKey("units", EngineUnitsBase)
DISPATCHER = admin_api.DISPATCHER

TEMPLATE_PATHS = ("/etc/systemd/system/llm-engine@.service",
                  "/usr/lib/systemd/system/llm-engine@.service",
                  "/lib/systemd/system/llm-engine@.service")


def unit_mode(config: GatewayConfig) -> tuple[UnitMode, str, str]:
    """(how engines are run, bus, manager kind), picked by the gateway itself:

    - root: transient units of the system manager (the administrator's choice);
    - not root, with the llm-engine@ template installed (the packaged system
      service): template instances on the system manager, allowed by polkit;
    - not root otherwise: transient units of the user's own manager.
    """
    root = os.geteuid() == 0
    template_installed = any(os.path.exists(p) for p in TEMPLATE_PATHS)
    mode = config.unit_mode
    if mode is UnitMode.AUTO:
        mode = UnitMode.TEMPLATE if not root and template_installed else UnitMode.TRANSIENT
    if mode is UnitMode.TEMPLATE:
        if not template_installed:
            raise ConfigError("unit_mode = \"template\" needs llm-engine@.service installed "
                              f"(one of {', '.join(TEMPLATE_PATHS)}); install the package, or "
                              "use \"auto\"")
        return mode, (config.bus if config.bus not in ("auto", "user") else "system"), "system"
    if config.bus == "auto":
        return (mode, "system", "system") if root else (mode, "user", "user")
    if config.bus in ("system", "user"):
        return mode, config.bus, config.bus
    return mode, config.bus, "system"  # an explicit address: a system manager's bus


def check_binaries(catalog: Catalog, config: GatewayConfig) -> None:
    """Say at start which engine servers cannot run (their models fail with the same
    words when asked for; the others are served)."""
    users: dict[tuple[str, str], list[str]] = {}
    for model in catalog:
        users.setdefault(server_binary(model, config), []).append(model.id)
    for binary, model_ids in users.items():
        try:
            resolve_binary(*binary)
        except EngineBinaryMissing as e:
            log.error("%s; models that need it cannot start: %s", e.message,
                      ", ".join(model_ids))


async def engine_layer(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    catalog = load_catalog(config)
    tables = TensorTables()
    mode, bus, manager = unit_mode(config)
    systemd = await Systemd.connect(bus)
    kv_cache = KvCache(config.state_dir / "kv-cache", config.kv_cache_max_mb * MIB)
    units: TransientEngineUnits | TemplateEngineUnits
    if mode is UnitMode.TEMPLATE:
        units = TemplateEngineUnits(systemd, config, kv_cache)
    else:
        units = TransientEngineUnits(systemd, config, manager=manager,
                                     run_root=runtime_root(manager), kv_cache=kv_cache)
    gpu = open_gpu()
    health = UnixHealthProbe()
    engines = EngineManager(catalog=catalog, config=config, units=units,
                            health=health, gpu=gpu, journal=Journalctl(manager),
                            desired=DesiredEngines(config.state_dir), kv_cache=kv_cache,
                            learned=LearnedMemory(config.state_dir), host=MemInfo(),
                            meter=CgroupMemoryMeter(), estimate=tables.estimate,
                            learned_ram=LearnedMemory(config.state_dir, RAM_FILE_NAME))
    app[admin_api.ENGINES] = engines
    app[UNITS] = units
    app[DISPATCHER] = dispatcher = Dispatcher(engines, catalog=catalog, gpu=gpu,
                                              config=config)
    reconciler = Reconciler(engines, on_over_limit=dispatcher.enforce_limit)
    systemd.on_reconnect(reconciler.poke)   # signals sent while the bus was away are lost
    liveness = Liveness(engines, health, interval_s=config.health_interval_s,
                        timeout_s=config.health_timeout_s, misses=config.health_misses)
    notifier = app[NOTIFIER]
    engines.registry.subscribe(lambda old, new: _report(notifier, engines, old, new))
    log.info("%d models; engines as %s units of the %s manager; GPU: %s",
             len(catalog), units.mode, manager, gpu.description)
    check_binaries(catalog, config)
    await adopt(engines)
    await engines.hooks.drop_unconfigured_kv_caches()
    # Restore (and preload) runs in the background, one engine at a time, while we serve.
    app[RESTORE] = asyncio.get_running_loop().create_task(restore(engines))
    # the memory estimates' tensor tables, off the loop, now that the gateway serves
    warm = asyncio.get_running_loop().create_task(asyncio.to_thread(tables.warm, list(catalog)))
    dispatcher.start_timers()
    reconciler.start()
    liveness.start()
    try:
        yield
    finally:
        await liveness.close()
        warm.cancel()   # (its thread finishes the file it reads)
        with contextlib.suppress(asyncio.CancelledError):
            await warm
        app[RESTORE].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await app[RESTORE]
        await reconciler.close()
        await dispatcher.close()
        await engines.close()
        await units.close()
        systemd.close()


async def _pulls_at_start(puller: Puller, engines: EngineManager) -> None:
    await puller.resume_unfinished()
    await puller.pull_sources(list(engines.catalog),
                              then=lambda model: engines.lifecycle.start(model.id, wait=False))


def read_config(source: Path | None) -> tuple[GatewayConfig, Catalog]:
    """The configuration file (the one the gateway started with) and its catalog, read
    and validated whole: ConfigError says what is wrong, with the key."""
    config = load_config(source, required=source is not None)
    return config, load_catalog(config)


def _report(notifier: Notifier, engines: EngineManager, old: Engine, new: Engine) -> None:
    if old.state is not new.state:
        ready = sum(1 for e in engines.registry.engines() if e.state is EngineState.READY)
        notifier.status(f"{ready} engine(s) ready; {new.model_id} {new.state.value}")


async def front_door(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    engines, dispatcher, hub = app[admin_api.ENGINES], app[DISPATCHER], app[admin_api.EVENTS]
    engines.registry.subscribe(lambda old, new: admin_api.publish_engine(
        hub, engines, old, new, dispatcher.swap))
    dispatcher.subscribe_queue(lambda model, depth: hub.publish(
        {"type": "queue", "model": model, "depth": depth}))
    records = RecordWriter(config.records_file, max_age_s=config.records_max_age_days * DAY_S,
                           max_bytes=config.records_max_bytes) if config.records_enabled else None
    engine_client = EngineClient(config.read_timeout_s, queue_limit=config.queue_limit)

    def connection_queue_limit(model: Model) -> int:
        # the model's queue_limit: its requests waiting for a turn at its ready engine
        limit = model.config.queue_limit
        return engines.config.queue_limit if limit is None else limit

    def connections_follow(old: Engine, new: Engine) -> None:
        if old.holds_place and not new.holds_place:
            engine_client.forget(new.socket)
    engines.registry.subscribe(connections_follow)

    known_parallel: dict[str, int] = {}

    async def learn_parallel(model: Model, socket: str) -> None:
        # before the engine is ready: a burst waiting for it then meets the limit, and the
        # first request does not share the engine with this question
        engine_client.set_queue_limit(socket, connection_queue_limit(model))
        if model.backend is Backend.LLAMA:
            setup = (f"{settings_stamp(model, engines.config)}:"
                     f"{binary_identity(server_binary(model, engines.config)[0])}")
            await learn_parallel_slots(engine_client, socket, known=known_parallel, setup=setup)
    engines.hooks.before_ready(learn_parallel)
    metrics = GatewayMetrics()
    engines.registry.subscribe(lambda old, new: metrics.on_engine_change(
        old, new, engines.lifecycle.stop_reasons.get(new.model_id)))
    dispatcher.subscribe_waits(metrics.observe_wait)
    remotes = Remotes(config.upstreams, read_timeout_s=config.read_timeout_s)
    await remotes.start()
    app[openai_api.FRONT] = front = openai_api.FrontDoor(
        config, app[admin_api.ENGINES], app[DISPATCHER], engine_client, records, metrics,
        remotes)

    async def apply(new: GatewayConfig) -> None:   # the adapters' share of a reload
        front.config = new
        if (batches := app.get(batches_api.BATCHES)) is not None:
            batches.config = new
        engine_client.queue_limit = new.queue_limit
        for engine in engines.registry.engines():
            if engine.holds_place and (model := engines.catalog.get(engine.model_id)):
                engine_client.set_queue_limit(engine.socket, connection_queue_limit(model))
        if records is not None:
            records.max_age_s = new.records_max_age_days * DAY_S
            records.max_bytes = new.records_max_bytes
        app[ACCESS].keys = new.api_keys
        app[ACCESS].admin_public = new.admin_public
        app[ACCESS].metrics_public = new.admin_public_metrics
        app[ACCESS].browser = browser_policy(new)
        if UNITS in app:
            app[UNITS].reconfigure(new)
        await remotes.reconfigure(new.upstreams)
    app[admin_api.RELOADER] = reloader = Reloader(
        read=lambda: read_config(config.source), engines=engines, dispatcher=dispatcher,
        apply=apply, notify=app[NOTIFIER].notify,
        read_models=lambda: (engines.config, load_catalog(engines.config)),
        publish=hub.publish)
    app[admin_api.PULLER] = puller = Puller(
        hub=HuggingFaceHub(token=hub_token()), models_dir=lambda: engines.config.models_dir,
        catalog=engines.catalog, rescan=reloader.rescan_models, publish=hub.publish)
    front.puller = puller
    # a pull the last run did not finish goes on from the bytes it had; then the preload
    # models that name a source and are not here yet, each started once pulled
    resume = asyncio.get_running_loop().create_task(_pulls_at_start(puller, engines))
    try:
        yield
    finally:
        resume.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await resume
        await puller.close()
        await reloader.close()
        await remotes.close()
        await engine_client.close()
        if records is not None:
            records.flush()
            await asyncio.to_thread(records.close)  # drains every queued record


async def batch_jobs(app: web.Application) -> AsyncIterator[None]:
    """OpenAI's Batch API: files and batches under state_dir, the batches a previous run
    left unended going on (service/batches)."""
    front = app[openai_api.FRONT]

    def record(batch: Batch, line: Line, status: int, latency_ms: float,
               error_code: str | None, answer: Any) -> None:
        usage = answer.get("usage") if isinstance(answer, dict) else None
        tokens = usage if isinstance(usage, dict) else {}
        call = CallRecord(
            ts=time.time() - latency_ms / 1000, method="POST", endpoint=line.url,
            model=line.model, status=status,
            outcome="ok" if error_code is None and status < 400 else "error",
            error_code=error_code, latency_ms=latency_ms, api_key=batch.owner or None,
            batch=batch.id, prompt_tokens=_count(tokens.get("prompt_tokens")),
            completion_tokens=_count(tokens.get("completion_tokens")),
            error_source=None if error_code is None and status < 400
            else "gateway" if error_code is not None else "engine")
        if front.records is not None:
            front.records.add(call)
        if front.metrics is not None:
            front.metrics.observe_call(call)   # a batch line is a call like any other
    store = await asyncio.to_thread(BatchStore, front.config.state_dir)
    app[batches_api.BATCHES] = batches = Batches(
        store, engines=front.manager, dispatcher=front.dispatcher,
        answers=front.engine_client, config=front.config, catalog=front.manager.catalog,
        activity=front.activity, record=record, publish=app[admin_api.EVENTS].publish)
    await batches.start()
    try:
        yield
    finally:
        await batches.close()


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


EngineLayerCtx = Callable[[web.Application], AsyncIterator[None]]


def settle_collector() -> None:
    """The garbage collector back on after the start, where `llm-gateway serve` turned it
    off for the imports (it ran over their objects again and again, a good part of a
    socket-activated start: docs/benchmarks.md, "Figures behind choices in the code"). The
    start's garbage is collected once and what is left is frozen:
    it lives as long as the process, and no later collection need walk it. Nothing to do
    where the collector is on."""
    if gc.isenabled():
        return
    gc.collect()
    gc.freeze()
    gc.enable()


async def _collector_after_start(app: web.Application) -> None:
    # not at once: the first requests (a socket-activated start has one waiting) go first
    asyncio.get_running_loop().call_later(COLLECTOR_SETTLE_S, settle_collector)


def build_app(config: GatewayConfig, notifier: Notifier | None = None,
              engines_ctx: EngineLayerCtx = engine_layer) -> web.Application:
    """engines_ctx sets app[ENGINES] and app[DISPATCHER]; tests pass one on fakes."""
    request_parser.use()   # a body the parser refuses part-way is answered, not held
    open_requests = OpenRequests()
    app = web.Application(middlewares=[track_requests(open_requests), error_middleware],
                          client_max_size=config.max_body_bytes)
    app[OPEN_REQUESTS] = open_requests
    app[CONFIG] = config
    app[ACCESS] = Access(config.api_keys, config.admin_public, config.admin_public_metrics,
                         browser=browser_policy(config))
    app[SHUTDOWN] = Shutdown()
    app[NOTIFIER] = notifier or Notifier()
    app[admin_api.EVENTS] = EventHub()
    app[admin_api.JOURNALS] = Journals()
    app[admin_api.KV_READINGS] = KvReadings()
    app.on_shutdown.append(_end_journal_follows)
    app.cleanup_ctx.append(engines_ctx)
    app.cleanup_ctx.append(front_door)
    app.cleanup_ctx.append(batch_jobs)
    app.on_startup.append(_collector_after_start)
    app.on_response_prepare.append(cors_headers)
    app.on_response_prepare.append(close_after_upgrade)
    app.on_response_prepare.append(close_unframed)
    router.install(app)   # every route, its handler and its access rule: core/routes.py
    return app


async def _end_journal_follows(app: web.Application) -> None:
    """Every journal follow's journalctl ended and reaped before the app goes (the stop
    above began it; an app stopped otherwise, as in tests, ends them here)."""
    await app[admin_api.JOURNALS].aclose()


def browser_policy(config: GatewayConfig) -> BrowserPolicy:
    return BrowserPolicy.of(config.allowed_hosts, config.allowed_origins, own_host_names())


def serve(config: GatewayConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(ClientBytesRefused())
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(_serve(config))


def _raise_fd_limit() -> None:
    """A proxy holds two descriptors per open request; systemd's default soft limit is 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def gateway_runner(app: web.Application) -> web.AppRunner:
    """aiohttp's runner as the gateway serves with it: no access log (the records are
    ours), a handler cancelled when its client leaves. The drain (up to
    shutdown_timeout_s) is ours (http/drain.py); aiohttp's own wait only gives the
    answers cut at its end the moment to say so."""
    return web.AppRunner(app, handle_signals=False, access_log=None,
                         handler_cancellation=True, shutdown_timeout=ABANDON_GRACE_S,
                         **PARSER_LIMITS)


async def stop_serving(app: web.Application, runner: web.AppRunner, listener: Listener,
                       admin: Listener | None, timeout_s: float) -> None:
    """The stop after SIGTERM: the drain (http/drain.py), the admin API's socket last (it
    answers the CLI meanwhile), then aiohttp closes what is left and the app's cleanup
    runs."""
    watched = (admin,) if admin is not None else ()
    await drain(app, listener, timeout_s, also_watched=watched)
    for other in watched:
        await other.stop()
    await runner.cleanup()


async def _serve(config: GatewayConfig) -> None:
    _raise_fd_limit()
    notifier = Notifier()
    app = build_app(config, notifier)
    runner = gateway_runner(app)
    await runner.setup()
    assert runner.server is not None   # set up
    sock, admin_sock = inherited_sockets()
    if sock is not None:
        sockets = [sock]
        where = f"the socket from systemd ({_sockname(sock)})"
    else:
        sockets = await bind_tcp(config.listen_host, config.listen_port)
        where = f"http://{config.listen_host}:{config.listen_port}"
    # our own accepting, not a web.SockSite/TCPSite: a stop must lose no connection taken
    listener = Listener(sockets, runner.server)
    listener.start()
    log.info("serving on %s", where)
    _warn_if_open(config, sock)
    admin_listener, admin_path = _admin_listener(app, runner.server, config, admin_sock)
    ready = sum(1 for e in app[admin_api.ENGINES].registry.engines()
                if e.state is EngineState.READY)
    notifier.ready(f"serving on {where}; {ready} engine(s) ready")
    notifier.start_watchdog()
    certificates = asyncio.create_task(_load_ca_certificates())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    reloads: set[asyncio.Task[None]] = set()
    loop.add_signal_handler(signal.SIGHUP, lambda: _track(
        reloads, loop.create_task(_reload_quietly(app[admin_api.RELOADER]))))
    await stop.wait()
    notifier.stopping()
    await drain_notice(app, config.drain_notice_s)
    await certificates
    for task in reloads:
        task.cancel()
    log.info("stopping: letting open requests finish (up to %gs)", config.shutdown_timeout_s)
    app[admin_api.EVENTS].close()   # event followers are not answers to wait for
    app[admin_api.JOURNALS].close()   # nor journal follows: their journalctl ends now
    await stop_serving(app, runner, listener, admin_listener, config.shutdown_timeout_s)
    # pinged through the drain: systemd watches a stopping service too (seen: 'Watchdog
    # timeout' in the stop-sigterm state, the gateway killed mid-drain with its streams)
    notifier.stop_watchdog()
    if admin_path is not None:
        with contextlib.suppress(OSError):
            admin_path.unlink()


def _admin_listener(app: web.Application, server: web.Server, config: GatewayConfig,
                    inherited: socket.socket | None) -> tuple[Listener | None, Path | None]:
    """The admin API on its unix socket (adapters/admin_socket.py): systemd's
    (llm-gateway-admin.socket: there through restarts, its mode and group the unit's),
    else one bound here. Returns its listener (None: none could be bound: the gateway
    serves on without it, and says why) and the path to remove at exit (None: systemd's,
    or none)."""
    if inherited is not None:
        path = Path(inherited.getsockname())
        try:
            gid = (admin_socket.group_id(config.admin_group) if config.admin_group
                   else path.stat().st_gid)
        except (KeyError, OSError) as e:
            log.warning("admin socket from systemd at %s: %s; admin API refused there",
                        path, e)
            gid = None
        listener = Listener([inherited], server)
        listener.start()
        app[ACCESS].admin_socket, app[ACCESS].admin_gid = str(path), gid
        log.info("admin API on %s (from systemd; root, this gateway's user and gid %s)",
                 path, gid)
        return listener, None
    path = config.admin_socket or admin_socket.default_path()
    try:
        sock = admin_socket.bind(path, config.admin_group)
        # the socket's group may connect (0660): with no [admin] group, the gateway's own
        gid = admin_socket.group_id(config.admin_group) if config.admin_group else os.getgid()
    except KeyError:
        log.warning("[admin] group = %r: no such group; no admin socket", config.admin_group)
        return None, None
    except OSError as e:
        log.warning("no admin socket at %s (%s): the CLI reaches this gateway only with "
                    "--url, through the public port's admin API ([admin] public)", path, e)
        return None, None
    listener = Listener([sock], server)
    listener.start()
    app[ACCESS].admin_socket, app[ACCESS].admin_gid = str(path), gid
    log.info("admin API on %s (root, this gateway's user and group %s)", path,
             config.admin_group or gid)
    return listener, path


def _warn_if_open(config: GatewayConfig, sock: socket.socket | None) -> None:
    """Anyone who can reach a non-loopback address can use every model and the admin API
    when no API keys are configured: say so at start (it may be meant: a trusted LAN)."""
    if config.api_keys is not None or (sock is not None and sock.family == socket.AF_UNIX):
        return
    address = sock.getsockname()[0] if sock is not None else config.listen_host
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        loopback = address == "localhost"
    if not loopback:
        log.warning("listening on %s with no API keys: anyone who can reach it may use "
                    "every model and the admin API; set [auth] keys_file (see docs/security.md, "
                    "\"API keys\")", address)


async def _load_ca_certificates() -> None:
    """The CA certificates left out of the start-up (adapters/client_tls.py), now that the
    gateway serves."""
    try:
        await asyncio.to_thread(client_tls.load_deferred)
    except (OSError, ValueError) as e:   # ssl.SSLError is an OSError
        log.warning("could not load the system's CA certificates: %s", e)


async def _reload_quietly(reloader: Reloader) -> None:
    """SIGHUP (`systemctl reload`): a refused configuration is logged by the reloader and
    the one in force stays; nobody is waiting for an answer."""
    try:
        await reloader.reload()
    except ConfigInvalid:
        pass
    except Exception:
        log.exception("reload failed")


def _track(tasks: set[asyncio.Task[Any]], task: asyncio.Task[Any]) -> None:
    tasks.add(task)
    task.add_done_callback(tasks.discard)


def _sockname(sock: object) -> str:
    try:
        return str(sock.getsockname())  # type: ignore[attr-defined]
    except OSError:
        return "?"
