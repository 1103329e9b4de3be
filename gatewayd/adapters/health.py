"""Readiness over the engine's unix socket: GET /health, 200 = ready (an openai
server: its own ready_path and ready_status, catalog.Model.health).

llama-server binds its socket before loading and answers 503 until the model
is loaded; whisper (behind systemd-socket-proxyd) resets connections until it
listens. Only the ready status counts.

A probe runs every few milliseconds while an engine loads (readiness.py), so it
is one short connection spoken by hand (engine_wire/exchange.py).
"""

from __future__ import annotations

from gatewayd.adapters.engine_wire.errors import EngineConnectionError
from gatewayd.adapters.engine_wire.exchange import exchange

# /health answers {"status":"ok"}; an openai server's /v1/models lists its models
MAX_ANSWER = 1024 * 1024


class UnixHealthProbe:
    async def status(self, socket: str, timeout: float = 2.0,
                     path: str = "/health") -> int | None:
        try:
            status, _ = await exchange(socket, "GET", path, timeout=timeout,
                                       max_answer=MAX_ANSWER)
        except (TimeoutError, OSError, EngineConnectionError):
            return None
        return status
