"""A fake remote upstream: an OpenAI-compatible server on TCP (optionally TLS), for the
cases a real remote is hard to make misbehave on cue: down, slow, 500, 429, a broken or
stalled stream, events framed with CRLF.

It answers like the fake engine (tests/fake_engine.py: "die after N" in a prompt breaks
a stream, "slow N" spaces its tokens) under /v1, plus GET /v1/models from a list the
test can change, and checks the API key it was given. A streamed chat is its own where
the test asks for `line_end` or `stall_after`. `in_thread` serves one from a thread, for
the tests that drive the real gateway from synchronous code; `Blackhole` is a peer that
takes TCP connections and never answers, or never even accepts them. The real remote
in the end-to-end tests is a second llm-gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.fake_engine import FakeEngine, Seen

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class FakeUpstream:
    name: str
    models: list[str] = field(default_factory=list)
    key: str | None = None            # the Bearer key it wants (None: any or none)
    status: int | None = None         # answer every inference request with this status
    retry_after: str | None = None    # ... with this Retry-After
    delay_s: float = 0.0              # before answering anything
    # a streamed chat: each line ended with line_end (b"\r\n": events end "\r\n\r\n");
    # token_delay_s between its tokens; stall_after: after that many tokens, silent (the
    # connection open) until the gateway goes
    line_end: bytes = b"\n"
    token_delay_s: float = 0.0
    stall_after: int | None = None
    stalled: int = 0                  # streams that went silent
    tls: ssl.SSLContext | None = None
    port: int = 0
    engine: FakeEngine = field(init=False)
    model_lists: int = 0              # GET /v1/models answered (probes)
    _runner: web.AppRunner | None = None
    _loop: asyncio.AbstractEventLoop | None = None   # its own, when served by in_thread

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
                                     status=self.status,
                                     headers={"Retry-After": self.retry_after}
                                     if self.retry_after is not None else None)
        if (self.line_end != b"\n" or self.stall_after is not None) \
                and request.path == "/v1/chat/completions":
            payload = json.loads(await request.read())   # (read once, kept by aiohttp)
            if payload.get("stream"):
                await self.engine._seen(request)
                return await self._own_stream(request, payload)
        return await handler(request)

    async def _own_stream(self, request: web.Request, payload: dict[str, Any]
                          ) -> web.StreamResponse:
        """A chat stream as vLLM sends one, with this fake's line ends, pace and stall."""
        n = int(payload.get("max_tokens", 4))
        base = {"id": "up-1", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": payload.get("model")}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        end = self.line_end

        async def event(data: str) -> None:
            await response.write(b"data: " + data.encode() + end + end)

        def chunk(**fields: Any) -> str:
            return json.dumps({**base, **fields})
        await event(chunk(choices=[{"index": 0, "finish_reason": None,
                                    "delta": {"role": "assistant", "content": ""}}]))
        for i in range(n):
            if i == self.stall_after:
                self.stalled += 1
                # silent, the connection open, until the gateway closes it
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.05)
                return response
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            await event(chunk(choices=[{"index": 0, "finish_reason": None,
                                        "delta": {"content": f" w{i}"}}]))
        await event(chunk(choices=[{"index": 0, "finish_reason": "length", "delta": {}}]))
        if (payload.get("stream_options") or {}).get("include_usage"):
            await event(chunk(choices=[], usage={"prompt_tokens": 11, "completion_tokens": n,
                                                 "total_tokens": 11 + n}))
        await event("[DONE]")
        await response.write_eof()
        return response

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

    def call(self, step: Awaitable[None]) -> None:
        """From another thread: run step (start(), stop()) on in_thread's loop."""
        assert self._loop is not None, "not served by in_thread"
        asyncio.run_coroutine_threadsafe(_awaited(step), self._loop).result(10)

    async def stop(self) -> None:
        """Down: the port refuses connections from now on (start() brings it back)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@contextlib.contextmanager
def in_thread(fake: FakeUpstream) -> Iterator[FakeUpstream]:
    """fake served by an event loop of its own in a thread, for synchronous tests (its
    settings may be changed from the test's thread between requests)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"fake-upstream-{fake.name}",
                              daemon=True)
    thread.start()
    try:
        fake._loop = loop
        fake.call(fake.start())
        yield fake
    finally:
        fake.call(fake.stop())
        fake._loop = None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class Blackhole:
    """A TCP peer on 127.0.0.1:port that never answers. accept=True: it takes every
    connection and reads nothing back (a hung server: the caller's read timeout).
    accept=False: it listens with a backlog of 0 that is filled at once and never
    accepts, so the kernel drops every further SYN (an overloaded or firewalled host:
    the caller's connect timeout)."""

    def __init__(self, port: int = 0, *, accept: bool) -> None:
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self.port = self._listener.getsockname()[1]
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if accept:
            self._listener.listen(64)
            self._listener.settimeout(0.1)
            self._thread = threading.Thread(target=self._take, daemon=True)
            self._thread.start()
        else:
            self._listener.listen(0)
            self._fill()

    def _fill(self) -> None:
        """Connections of our own until one is no longer taken in: the queue is full."""
        for _ in range(8):
            probe = socket.socket()
            probe.setblocking(False)
            probe.connect_ex(("127.0.0.1", self.port))
            self._held.append(probe)
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                if probe.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 \
                        and _connected(probe):
                    break
                time.sleep(0.01)
            else:
                return       # this one's SYN was dropped: nothing more gets in

    def _take(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._held.append(conn)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(5)
        for sock in (*self._held, self._listener):
            sock.close()

    def __enter__(self) -> Blackhole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


async def _awaited(step: Awaitable[None]) -> None:
    await step
