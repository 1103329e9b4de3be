"""Readiness over the engine's unix socket: GET /health, 200 = ready.

llama-server binds its socket before loading and answers 503 until the model
is loaded; whisper (behind systemd-socket-proxyd) resets connections until it
listens. Only a 200 counts.
"""

from __future__ import annotations

import aiohttp


class UnixHealthProbe:
    async def status(self, socket: str, timeout: float = 2.0) -> int | None:
        try:
            async with aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(path=socket),
                    timeout=aiohttp.ClientTimeout(total=timeout)) as session, \
                    session.get("http://engine/health") as resp:
                return resp.status
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
