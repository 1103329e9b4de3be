"""The gateway's own small exchanges with an engine over its unix socket, spoken by hand.

Readiness polls (health.py) and the KV cache's slot calls (kv_cache.py) run while an
engine loads or just before it is ready, on the same cores as the engine: one short
connection each (Connection: close, read to the end). An aiohttp session per call
(connector, timeouts, cookie jar) cost several times the CPU of the exchange itself, and
its time lay on the cold start's path.
"""

from __future__ import annotations

import asyncio
import socket as socket_module

MAX_ANSWER = 16 << 20   # /slots with many slots is tens of KB; anything this big is no engine
# a chunk's size: 15 hex digits stay below 2**60 (and so fit any size type on the way)
MAX_CHUNK_DIGITS = 15
HEX_DIGITS = b"0123456789abcdefABCDEF"


class BadAnswer(ValueError):
    """Not an HTTP/1.x answer the gateway can read."""


async def exchange(socket: str, method: str, target: str, body: bytes = b"", *,
                   timeout: float, max_answer: int = MAX_ANSWER) -> tuple[int, bytes]:
    """One request; the answer's status and body. Raises OSError (no engine there),
    TimeoutError, or BadAnswer."""
    loop = asyncio.get_running_loop()
    head = (f"{method} {target} HTTP/1.1\r\nHost: engine\r\nConnection: close\r\n"
            + (f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
               if body or method == "POST" else "") + "\r\n").encode()
    # a bare socket on the loop: no transport, protocol or stream objects per look
    sock = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    try:
        sock.setblocking(False)
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, socket)
            await loop.sock_sendall(sock, head + body)
            # read to the end (Connection: close): closing on an answer still being
            # written would reset the engine's side of the connection
            parts: list[bytes] = []
            size = 0
            while more := await loop.sock_recv(sock, 65536):
                size += len(more)
                if size > max_answer:   # a cut answer would parse as a shorter one
                    raise BadAnswer(f"{method} {target}: the answer is over "
                                    f"{max_answer} bytes")
                parts.append(more)
            answer = b"".join(parts)
    finally:
        sock.close()
    status = parse_status(answer)
    if status is None:
        raise BadAnswer(f"{method} {target}: not an HTTP answer")
    head_end = answer.find(b"\r\n\r\n")
    if head_end < 0:
        raise BadAnswer(f"{method} {target}: the answer's head has no end")
    headers = answer[:head_end].lower()
    content = answer[head_end + 4:]
    if b"\r\ntransfer-encoding: chunked" in headers:
        content = dechunk(content)
    return status, content


def parse_status(answer: bytes) -> int | None:
    """The status code of an HTTP/1.x answer's status line, or None."""
    line = answer.split(b"\r\n", 1)[0].split(None, 2)
    if len(line) < 2 or not line[0].startswith(b"HTTP/1.") or not line[1].isdigit() \
            or len(line[1]) != 3:
        return None
    return int(line[1])


def chunk_size(line: bytes) -> int | None:
    """A chunk-size line's size (extensions after `;` ignored), or None unless it is plain
    hex digits, at most MAX_CHUNK_DIGITS of them: int(x, 16) alone also takes a sign, a
    0x prefix, underscores and surrounding whitespace, and a negative size walked a
    parser backwards (forever)."""
    digits = line.split(b";", 1)[0].rstrip(b" \t")
    if not 0 < len(digits) <= MAX_CHUNK_DIGITS or digits.strip(HEX_DIGITS):
        return None
    return int(digits, 16)


def dechunk(data: bytes) -> bytes:
    """A chunked body's content (the trailer, if any, is dropped)."""
    out: list[bytes] = []
    at = 0
    while True:
        line_end = data.find(b"\r\n", at)
        if line_end < 0:
            raise BadAnswer("a chunked answer ends in the middle")
        size = chunk_size(data[at:line_end])
        if size is None:
            raise BadAnswer(f"a chunk's size is not hex digits: {data[at:line_end][:40]!r}")
        if size == 0:
            return b"".join(out)
        start = line_end + 2
        if len(data) < start + size:
            raise BadAnswer("a chunked answer ends in the middle")
        out.append(data[start:start + size])
        at = start + size + 2
