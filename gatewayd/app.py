"""The composition root: the one place adapters are built and wired to the core,
and the gateway process's lifecycle (serve → ready → signal → drain → stop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from gatewayd import admin_api, openai_api
from gatewayd.catalog import build_catalog
from gatewayd.config import GatewayConfig, UnitMode
from gatewayd.desired import DesiredEngines
from gatewayd.dispatcher import Dispatcher
from gatewayd.engine_manager import EngineManager
from gatewayd.engines import Engine, EngineState
from gatewayd.errors import ConfigError, GatewayError
from gatewayd.events import EventHub
from gatewayd.gpu import open_gpu
from gatewayd.health import UnixHealthProbe
from gatewayd.journal import Journalctl
from gatewayd.notify import Notifier, inherited_socket
from gatewayd.proxy import Upstreams
from gatewayd.records import RecordWriter
from gatewayd.systemd import Systemd
from gatewayd.unit_control import TemplateEngineUnits, TransientEngineUnits, runtime_root

log = logging.getLogger("gatewayd")
CONFIG = web.AppKey("config", GatewayConfig)
NOTIFIER = web.AppKey("notifier", Notifier)
RESTORE = web.AppKey("restore", asyncio.Task[None])
DISPATCHER = admin_api.DISPATCHER

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI-shaped JSON body; never a traceback or HTML."""
    try:
        return await handler(request)
    except GatewayError as e:
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
        return web.json_response(e.body(), status=e.status, headers=headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        body = GatewayError(e.reason or "error").body()
        body["error"].update(type="invalid_request_error" if e.status < 500 else "server_error",
                             code=e.reason.lower().replace(" ", "_") if e.reason else None)
        return web.json_response(body, status=e.status)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(GatewayError("internal error; see the gateway's journal")
                                 .body(), status=500)


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


async def engine_layer(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    catalog = build_catalog(config)
    mode, bus, manager = unit_mode(config)
    systemd = await Systemd.connect(bus)
    units: TransientEngineUnits | TemplateEngineUnits
    if mode is UnitMode.TEMPLATE:
        units = TemplateEngineUnits(systemd, config)
    else:
        units = TransientEngineUnits(systemd, config, manager=manager,
                                     run_root=runtime_root(manager))
    gpu = open_gpu()
    engines = EngineManager(catalog=catalog, config=config, units=units,
                            health=UnixHealthProbe(), gpu=gpu, journal=Journalctl(manager),
                            desired=DesiredEngines(config.state_dir))
    app[admin_api.ENGINES] = engines
    app[DISPATCHER] = dispatcher = Dispatcher(engines)
    notifier = app[NOTIFIER]
    engines.subscribe(lambda old, new: _report(notifier, engines, old, new))
    log.info("%d models; engines as %s units of the %s manager; GPU: %s",
             len(catalog), units.mode, manager, gpu.description)
    await engines.adopt()
    # Restore (and preload) runs in the background, one engine at a time, while we serve.
    app[RESTORE] = asyncio.get_running_loop().create_task(engines.restore())
    dispatcher.start_timers()
    try:
        yield
    finally:
        app[RESTORE].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await app[RESTORE]
        await dispatcher.close()
        await engines.close()
        systemd.close()


def _report(notifier: Notifier, engines: EngineManager, old: Engine, new: Engine) -> None:
    if old.state is not new.state:
        ready = sum(1 for e in engines.engines() if e.state is EngineState.READY)
        notifier.status(f"{ready} engine(s) ready; {new.model_id} {new.state.value}")


async def front_door(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    engines, dispatcher, hub = app[admin_api.ENGINES], app[DISPATCHER], app[admin_api.EVENTS]
    engines.subscribe(lambda old, new: admin_api.publish_engine(hub, engines, old, new))
    dispatcher.on_queue = lambda model, depth: hub.publish(
        {"type": "queue", "model": model, "depth": depth})
    records = RecordWriter(config.records_file) if config.records_enabled else None
    upstreams = Upstreams(config.read_timeout_s)
    app[openai_api.FRONT] = openai_api.FrontDoor(config, app[admin_api.ENGINES],
                                                 app[DISPATCHER], upstreams, records)
    try:
        yield
    finally:
        await upstreams.close()
        if records is not None:
            await asyncio.to_thread(records.close)  # drains every queued record


EngineLayerCtx = Callable[[web.Application], AsyncIterator[None]]


def build_app(config: GatewayConfig, notifier: Notifier | None = None,
              engines_ctx: EngineLayerCtx = engine_layer) -> web.Application:
    """engines_ctx sets app[ENGINES] and app[DISPATCHER]; tests pass one on fakes."""
    app = web.Application(middlewares=[error_middleware],
                          client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[NOTIFIER] = notifier or Notifier()
    app[admin_api.EVENTS] = EventHub()
    app.cleanup_ctx.append(engines_ctx)
    app.cleanup_ctx.append(front_door)
    admin_api.add_routes(app)
    openai_api.add_routes(app)   # last: it ends with the catch-all proxy route
    return app


def serve(config: GatewayConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    asyncio.run(_serve(config))


def _raise_fd_limit() -> None:
    """A proxy holds two descriptors per open request; systemd's default soft limit is 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _serve(config: GatewayConfig) -> None:
    _raise_fd_limit()
    notifier = Notifier()
    app = build_app(config, notifier)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           handler_cancellation=True,
                           shutdown_timeout=config.shutdown_timeout_s)
    await runner.setup()
    sock = inherited_socket()
    site: web.BaseSite
    if sock is not None:
        site = web.SockSite(runner, sock)
        where = f"the socket from systemd ({_sockname(sock)})"
    else:
        site = web.TCPSite(runner, config.listen_host, config.listen_port)
        where = f"http://{config.listen_host}:{config.listen_port}"
    await site.start()
    log.info("serving on %s", where)
    ready = sum(1 for e in app[admin_api.ENGINES].engines() if e.state is EngineState.READY)
    notifier.ready(f"serving on {where}; {ready} engine(s) ready")
    notifier.start_watchdog()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("stopping: letting open requests finish (up to %gs)", config.shutdown_timeout_s)
    notifier.stopping()
    notifier.stop_watchdog()
    await runner.cleanup()


def _sockname(sock: object) -> str:
    try:
        return str(sock.getsockname())  # type: ignore[attr-defined]
    except OSError:
        return "?"
