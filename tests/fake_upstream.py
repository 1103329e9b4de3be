"""A fake remote upstream: an OpenAI-compatible server on TCP (optionally TLS), for the
cases a real remote is hard to make misbehave on cue: down, slow, 500, a broken stream.

It answers like the fake engine (tests/fake_engine.py: "die after N" in a prompt breaks
a stream, "slow N" spaces its tokens) under /v1, plus GET /v1/models from a list the
test can change, and checks the API key it was given. The real remote in the
end-to-end tests is a second llm-gateway.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from tests.fake_engine import FakeEngine, Seen

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class FakeUpstream:
    name: str
    models: list[str] = field(default_factory=list)
    key: str | None = None            # the Bearer key it wants (None: any or none)
    status: int | None = None         # answer every inference request with this status
    delay_s: float = 0.0              # before answering anything
    tls: ssl.SSLContext | None = None
    port: int = 0
    engine: FakeEngine = field(init=False)
    model_lists: int = 0              # GET /v1/models answered (probes)
    _runner: web.AppRunner | None = None

    def __post_init__(self) -> None:
        self.engine = FakeEngine(self.name)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[Seen]:
        return self.engine.requests

    def app(self) -> web.Application:
        app = self.engine.app(catch_all=False)
        app.middlewares.append(self._gate)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_route("*", "/{tail:.*}", self.engine.anything)
        return app

    @web.middleware
    async def _gate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "bad key", "type": "auth",
                                                "code": "invalid_api_key"}}, status=401)
        if self.status is not None and request.path != "/v1/models":
            await self.engine._seen(request)
            return web.json_response({"error": {"message": f"upstream says {self.status}",
                                                "type": "server_error", "code": "boom"}},
                                     status=self.status)
        return await handler(request)

    async def list_models(self, request: web.Request) -> web.Response:
        self.model_lists += 1
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": self.name} for m in self.models]})

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.tls,
                           reuse_address=True)
        await site.start()
        if not self.port:
            server = site._server
            assert server is not None and server.sockets   # type: ignore[attr-defined]
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        """Down: the port refuses connections from now on (start() brings it back)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
