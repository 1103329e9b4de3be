"""Readiness over the engine's unix socket: GET /health, 200 = ready.

llama-server binds its socket before loading and answers 503 until the model
is loaded; whisper (behind systemd-socket-proxyd) resets connections until it
listens. Only a 200 counts.

A probe runs every few milliseconds while an engine loads (readiness.py), so it
is one short connection spoken by hand (engine_wire/exchange.py).
"""

from __future__ import annotations

from gatewayd.adapters.engine_wire.errors import EngineConnectionError
from gatewayd.adapters.engine_wire.exchange import exchange

MAX_ANSWER = 64 * 1024   # /health answers {"status":"ok"}; anything longer is not an engine


class UnixHealthProbe:
    async def status(self, socket: str, timeout: float = 2.0) -> int | None:
        try:
            status, _ = await exchange(socket, "GET", "/health", timeout=timeout,
                                       max_answer=MAX_ANSWER)
        except (TimeoutError, OSError, EngineConnectionError):
            return None
        return status
