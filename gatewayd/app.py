"""The composition root: the one place adapters are built and wired to the core."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from gatewayd import admin_api
from gatewayd.catalog import build_catalog
from gatewayd.config import GatewayConfig, UnitMode
from gatewayd.desired import DesiredEngines
from gatewayd.engine_manager import EngineManager
from gatewayd.errors import ConfigError, GatewayError
from gatewayd.gpu import open_gpu
from gatewayd.health import UnixHealthProbe
from gatewayd.journal import Journalctl
from gatewayd.systemd import Systemd
from gatewayd.unit_control import TransientEngineUnits, runtime_root

log = logging.getLogger("gatewayd")
CONFIG = web.AppKey("config", GatewayConfig)
RESTORE = web.AppKey("restore", asyncio.Task[None])

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI-shaped JSON body; never a traceback or HTML."""
    try:
        return await handler(request)
    except GatewayError as e:
        return web.json_response(e.body(), status=e.status)
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


def systemd_target(config: GatewayConfig) -> tuple[str, str]:
    """(bus, manager kind): the system manager as root, else the user's own manager."""
    if config.bus == "auto":
        return ("system", "system") if os.geteuid() == 0 else ("user", "user")
    if config.bus in ("system", "user"):
        return config.bus, config.bus
    return config.bus, "system"  # an explicit address: a system manager's bus


async def engine_layer(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    if config.unit_mode is UnitMode.TEMPLATE:
        raise ConfigError("unit_mode = \"template\" needs the llm-engine@.service template, "
                          "which ships with the system-service packaging; use \"auto\"")
    catalog = build_catalog(config)
    bus, manager = systemd_target(config)
    systemd = await Systemd.connect(bus)
    units = TransientEngineUnits(systemd, config, manager=manager,
                                 run_root=runtime_root(manager))
    gpu = open_gpu()
    engines = EngineManager(catalog=catalog, config=config, units=units,
                            health=UnixHealthProbe(), gpu=gpu, journal=Journalctl(manager),
                            desired=DesiredEngines(config.state_dir))
    app[admin_api.ENGINES] = engines
    log.info("%d models; engines as %s units of the %s manager; GPU: %s",
             len(catalog), units.mode, manager, gpu.description)
    await engines.adopt()
    # Restore runs in the background, one engine at a time, while we serve.
    app[RESTORE] = asyncio.get_running_loop().create_task(engines.restore())
    try:
        yield
    finally:
        app[RESTORE].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await app[RESTORE]
        await engines.close()
        systemd.close()


def build_app(config: GatewayConfig) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[CONFIG] = config
    app.cleanup_ctx.append(engine_layer)
    admin_api.add_routes(app)
    return app


def serve(config: GatewayConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    web.run_app(build_app(config), host=config.listen_host, port=config.listen_port,
                access_log=None, print=None, shutdown_timeout=10)
