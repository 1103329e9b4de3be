"""aiohttp middleware: the one place an exception becomes an HTTP answer."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from gatewayd.core.errors import GatewayError, error_body

log = logging.getLogger("gatewayd")

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
        body = error_body(e.reason or "error",
                          type_="invalid_request_error" if e.status < 500 else "server_error",
                          code=e.reason.lower().replace(" ", "_") if e.reason else None)
        return web.json_response(body, status=e.status)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(GatewayError("internal error; see the gateway's journal")
                                 .body(), status=500)
