"""aiohttp middleware: the one place an exception becomes an HTTP answer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import HttpVersion11, StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from gatewayd.core.errors import (
    ERROR_SOURCE_HEADER,
    RETRY_HEADER,
    BadFraming,
    BodyTooLarge,
    BodyTooSlow,
    ErrorSource,
    GatewayError,
    ShuttingDown,
    anthropic_error_body,
    error_body,
)
from gatewayd.core.routes import Caller
from gatewayd.core.routing import speaks_anthropic
from gatewayd.http.auth import check_access, preflight, request_route
from gatewayd.http.request_parser import refusal_reason

log = logging.getLogger("gatewayd")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Shutdown:
    """The gateway's stop: draining from the moment it was told to stop (/ready answers
    503, so balancers take it out); expired when its drain time (shutdown_timeout_s) has
    run out: the requests still open are cancelled then, and each answers shutting_down
    instead of vanishing."""

    expired: bool = False
    draining: bool = False


SHUTDOWN = web.AppKey("shutdown", Shutdown)
# a body refused for its size: at most this much of its rest is read and dropped, so that
# the 413 reaches the client (one a little over max_body_mb, the common case) instead of a
# reset; a larger rest, or one slower than DISCARD_S, gets the 413 and a closed connection
DISCARD_MAX_BYTES = 16 * 1024 * 1024
DISCARD_S = 5.0
# a body of which no byte came for this long is refused (408): a client that stops
# mid-body would otherwise hold its handler and connection for ever (the shipped HAProxy
# waits as long: timeout http-request)
BODY_IDLE_S = 30.0


def shutdown_error() -> ShuttingDown:
    return ShuttingDown("the gateway is shutting down and its drain time "
                        "(shutdown_timeout_s) ran out before this answer was complete")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as a JSON body in the caller's dialect (OpenAI's envelope, or
    Anthropic's on /v1/messages*) with the same status; never a traceback or HTML.
    Each says it is the gateway's own (ERROR_SOURCE_HEADER, and `source` in the body);
    a relayed engine's or upstream's error answer comes with its own source set by the
    relay (http/proxy.py). Access (http/auth.py: Host, Origin, the route table, keys)
    is checked here first: one middleware layer less on the hot path."""
    watch: asyncio.Task[None] | None = None
    try:
        matched = check_access(request)
        if request.method == "OPTIONS" and matched is not None:
            return preflight(request, matched)
        if request.body_exists and not request.content.is_eof():   # (a small body: whole)
            watch = asyncio.create_task(_body_idle_watch(request.content))
        return await handler(request)
    except GatewayError as e:
        if isinstance(e, BodyTooLarge) and await _rest_discarded(request):
            return _answer(request, e, keep_open=True)
        return _answer(request, e)
    except RequestPayloadError as e:
        # the body, refused by the HTTP parser while it was read (http/request_parser.py)
        return _answer(request, BadFraming(
            f"the request's body was refused part-way by the HTTP parser: "
            f"{refusal_reason(e)}"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.reason or "error"
        code = e.reason.lower().replace(" ", "_") if e.reason else None
        if speaks_anthropic(request.path):
            return _own_error(anthropic_error_body(e.status, message, code=code), e.status)
        body = error_body(message, code=code,
                          type_="invalid_request_error" if e.status < 500 else "server_error")
        return _own_error(body, e.status)
    except asyncio.CancelledError:
        if not request.app[SHUTDOWN].expired:
            raise   # the client went away: nobody to answer
        return _own_error(_in_dialect(shutdown_error(), request.path), ShuttingDown.status)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        error = GatewayError("internal error; see the gateway's journal")
        return _own_error(_in_dialect(error, request.path), 500)
    finally:
        if watch is not None:
            watch.cancel()


async def _body_idle_watch(content: StreamReader) -> None:
    """Until the body is whole: once no byte of it came for BODY_IDLE_S, every reader of
    it (read, json, multipart: whichever the handler uses) raises BodyTooSlow, which is
    answered as the gateway's 408."""
    loop = asyncio.get_running_loop()
    seen, since = content.total_bytes, loop.time()
    while not content.is_eof():
        await asyncio.sleep(BODY_IDLE_S / 4)
        if content.total_bytes != seen:
            seen, since = content.total_bytes, loop.time()
        elif loop.time() - since >= BODY_IDLE_S and not content.is_eof():
            content.set_exception(BodyTooSlow(
                f"no byte of the request body came for {BODY_IDLE_S:g} s; send it whole"))
            return


async def _rest_discarded(request: web.Request) -> bool:
    """The rest of a body refused for its size read and dropped, where it is small enough
    to (its Content-Length at most DISCARD_MAX_BYTES past what was read, arriving within
    DISCARD_S); whether it was. Then the 413 reaches the client and its connection serves
    on. Otherwise the connection is closed after the answer: a client still sending may
    then meet a reset before it reads the 413 (closing with its bytes unread)."""
    length = request.content_length
    if length is None or length - request.content.total_bytes > DISCARD_MAX_BYTES:
        return False
    try:
        async with asyncio.timeout(DISCARD_S):
            while await request.content.readany():
                pass
    except (TimeoutError, OSError, RequestPayloadError):
        return False
    return request.content.at_eof()


def _answer(request: web.Request, e: GatewayError, *,
            keep_open: bool = False) -> web.Response:
    headers = dict(e.headers)
    if e.retry_after is not None:
        headers["Retry-After"] = str(e.retry_after)
    if not _for_admin(request):
        withhold_engine_logs(e)
    response = _own_error(_in_dialect(e, request.path), e.status, headers)
    if e.closes_connection and not keep_open:
        response.force_close()
    return response


def _own_error(body: dict[str, Any], status: int,
               headers: dict[str, str] | None = None) -> web.Response:
    """An error answer of the gateway's own, which says so (ERROR_SOURCE_HEADER); a 503
    also says a balancer may try another gateway (RETRY_HEADER): the gateway answers 503
    only where it delivered no answer and will deliver none (its queue full, no room, its
    stop), never after an answer began."""
    own = {**(headers or {}), ERROR_SOURCE_HEADER: ErrorSource.GATEWAY.value}
    if status == 503:
        own[RETRY_HEADER] = "safe"
    return web.json_response(body, status=status, headers=own)


class ClientBytesRefused(logging.Filter):
    """For aiohttp.server: a request its HTTP parser refused (a header past 64 KiB, more
    than 128 fields, a malformed line) is the client's bytes, not the gateway's fault. One
    line, no traceback: aiohttp logs each at ERROR with a traceback, so any client could fill
    the journal with them, a dozen lines a request. So is a body it refused part-way
    (`RequestPayloadError`, http/request_parser.py: logged as aiohttp reads what is left of
    it after the gateway's 400), and one that stopped coming (`BodyTooSlow`: aiohttp meets
    it draining a body its handler answered without reading). Other errors keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError | RequestPayloadError | BodyTooSlow):
            reason = refusal_reason(exc) if isinstance(exc, RequestPayloadError) \
                else exc.message if isinstance(exc, BodyTooSlow) \
                else str(exc.message or exc).splitlines()[0]
            record.msg, record.args = "%s: refused by the HTTP parser: %s", (
                record.getMessage(), reason[:200])
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


async def close_after_upgrade(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: a request that asks to upgrade the connection (the gateway never
    does) ends it. aiohttp takes the bytes after such a request for the new protocol: where
    the handler left its body unread (an early answer), its parser stops reading, and the next
    request on the connection would wait forever (found by tests/http/test_fuzz.py)."""
    if "Upgrade" in request.headers:
        response.force_close()
        response.headers["Connection"] = "close"   # (its headers are made: say so too)


async def close_unframed(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: an answer of a length not known in advance (a stream) to an
    HTTP/1.0 client, which has no chunked coding, ends only with the connection's close.
    aiohttp leaves out its `Connection: keep-alive` then, yet keeps the connection open
    after the answer where the client asked for keep-alive: the client waited for the end
    forever (found by tests/http/test_fuzz.py). A bodiless answer needs no end."""
    if (request.version < HttpVersion11 and response.content_length is None
            and request.method != "HEAD" and response.status not in (204, 304)):
        response.force_close()
        response.headers["Connection"] = "close"   # (its headers are made: say so too)


def _for_admin(request: web.Request) -> bool:
    matched = request_route(request)
    return matched is not None and matched.route.access is Caller.ADMIN


def withhold_engine_logs(error: GatewayError) -> None:
    """An engine's journal lines are for the admin API and the CLI: an inference caller
    is told the failure and where the logs are, not what they say (they may hold other
    clients' prompts, paths, the host's details)."""
    failure = error.extra.get("failure")
    if isinstance(failure, dict) and "log_tail" in failure:
        error.extra["failure"] = {k: v for k, v in failure.items() if k != "log_tail"}


def _in_dialect(error: GatewayError, path: str) -> dict[str, Any]:
    return error.anthropic_body() if speaks_anthropic(path) else error.body()
