"""Readiness over the engine's unix socket: GET /health, 200 = ready.

llama-server binds its socket before loading and answers 503 until the model
is loaded; whisper (behind systemd-socket-proxyd) resets connections until it
listens. Only a 200 counts.

A probe runs every few milliseconds while an engine loads (readiness.py), so it
is one short connection spoken by hand: an aiohttp session per probe (connector,
timeouts, cookie jar) cost several times the CPU of the request itself, taken
from the engine that is loading on the same cores.
"""

from __future__ import annotations

import asyncio

REQUEST = b"GET /health HTTP/1.1\r\nHost: engine\r\nConnection: close\r\n\r\n"
MAX_ANSWER = 64 * 1024   # /health answers {"status":"ok"}; anything longer is not an engine


class UnixHealthProbe:
    async def status(self, socket: str, timeout: float = 2.0) -> int | None:
        writer = None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(socket)
                writer.write(REQUEST)
                # read to the end (Connection: close): closing on an answer still being
                # written would reset the engine's side of the connection
                answer = await reader.read(MAX_ANSWER)
                while answer and not reader.at_eof() and len(answer) < MAX_ANSWER:
                    more = await reader.read(MAX_ANSWER)
                    if not more:
                        break
                    answer += more
        except (TimeoutError, OSError, EOFError):
            return None
        finally:
            if writer is not None:
                writer.close()
        return parse_status(answer)


def parse_status(answer: bytes) -> int | None:
    """The status code of an HTTP/1.x answer's status line, or None."""
    line = answer.split(b"\r\n", 1)[0].split(None, 2)
    if len(line) < 2 or not line[0].startswith(b"HTTP/1.") or not line[1].isdigit() \
            or len(line[1]) != 3:
        return None
    return int(line[1])
