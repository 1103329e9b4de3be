"""The gateway's own short exchanges with an engine: one request on a connection of its
own (Connection: close), the answer read to its end.

Readiness polls (health.py) run every few milliseconds while an engine loads, the KV
cache's save and restore (kv_cache.py) just before it is ready, its parallel slots (/props) as it
becomes ready, an operator's look at its /metrics: on the same cores as the engine, never
queued behind inference (the engine keeps spare HTTP threads for those). A bare socket on
the loop, no transport or protocol objects: an aiohttp session per call cost several
times the CPU of the exchange itself, and its time lay on the cold start's path. The
answer goes through the one parser (framing.py), as the proxy's do.
"""

from __future__ import annotations

import asyncio
import socket as socket_module

from gatewayd.adapters.engine_wire.errors import EngineConnectionError
from gatewayd.adapters.engine_wire.framing import AnswerParser, request_head

MAX_ANSWER = 16 << 20   # /slots of many parallel slots: tens of KB; this big is no engine
OWN_HEADERS = (("User-Agent", "llm-gateway"), ("Connection", "close"))   # not a client's
JSON_BODY = (("Content-Type", "application/json"),)


async def exchange(socket: str, method: str, target: str, body: bytes = b"", *,
                   timeout: float, max_answer: int = MAX_ANSWER) -> tuple[int, bytes]:
    """One request; the answer's status and body. Raises OSError (no engine there),
    TimeoutError, or EngineConnectionError (not an answer the gateway takes, or over
    max_answer bytes)."""
    loop = asyncio.get_running_loop()
    with_body = bool(body) or method == "POST"
    head = request_head(method, target, OWN_HEADERS + (JSON_BODY if with_body else ()),
                        len(body), body_expected=with_body)
    parts: list[bytes] = []
    parser = AnswerParser(parts.append)
    parser.begin(method)
    sock = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    try:
        sock.setblocking(False)
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, socket)
            await loop.sock_sendall(sock, head + body)
            # read to the end (Connection: close): closing on an answer still being
            # written would reset the engine's side of the connection
            size = 0
            while more := await loop.sock_recv(sock, 65536):
                size += len(more)
                if size > max_answer:   # a cut answer would parse as a shorter one
                    raise EngineConnectionError(f"{method} {target}: the answer is over "
                                                f"{max_answer} bytes")
                parser.feed(more)
    finally:
        sock.close()
    if not parser.closed() or parser.head is None:
        raise EngineConnectionError(f"{method} {target}: the answer ends in the middle")
    return parser.head[0], b"".join(parts)
