"""A stream's events passed from the engine to the client by relay.c (the module
gatewayd.adapters.engine_wire._relay), in a thread of its own, with no interpreter per event.

After the answer's head and first event (sent by http/proxy as always), the relay hands
both sockets to relay.c until something needs Python: an event naming usage, the last
chunk, odd framing, the engine's end or failure, a client that left or stalled, a
cancelled handler. Then it takes the connection back with whatever was read and not
sent, and http/proxy's Python relay finishes the stream as it would have from the
start: the client sees the same bytes either way, the record the same counts.

Only where it cannot go wrong: a local engine's chunked body between two chunks with
nothing buffered, a chunked answer to a plain (not TLS) client with nothing waiting in
its transport, a free thread (at most `max_streams` at once; the rest relay in Python).
LLM_GATEWAY_NATIVE_RELAY=0 turns it off (benchmarks compare both; a fallback if it
ever misbehaves).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from gatewayd.adapters.engine_wire.client import EngineResponse

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

_native: ModuleType | None
try:
    from gatewayd.adapters.engine_wire import _relay
    _native = _relay
except ImportError:   # not built (no C compiler where it was installed): Python's relay
    _native = None

MAX_STREAMS = 64   # native streams at once: a thread each, kept once started (the rest: Python)


@dataclass(slots=True)
class Forwarded:
    """What relay.c did: why it stopped, and what it passed on."""

    reason: str         # handback, engine_eof, engine_error, idle, client_gone, stalled,
                        # cancelled
    events: int         # content events passed on (as SseRelay counts them)
    last_chunk: bytes   # the last chunk passed on, framing and all (b"": none)
    data_bytes: int     # their data, without the framing

    @property
    def client_gone(self) -> bool:
        return self.reason in ("client_gone", "stalled")


# relay.c's reasons by their own constants' names (HANDBACK -> "handback", ...)
_REASONS = {getattr(_native, name): name.lower() for name in (
    "HANDBACK", "ENGINE_EOF", "ENGINE_ERROR", "IDLE", "CLIENT_GONE", "STALLED", "CANCELLED")
} if _native is not None else {}


class NativeRelay:
    """The threads relay.c runs in, and the streams it has now."""

    def __init__(self, max_streams: int = MAX_STREAMS) -> None:
        # why streams are relayed in Python only (None: they are not)
        self.why_off: str | None = None
        if os.environ.get("LLM_GATEWAY_NATIVE_RELAY", "1") in ("0", "no", "false"):
            self.why_off = "turned off by LLM_GATEWAY_NATIVE_RELAY"
        elif _native is None:
            self.why_off = ("gatewayd/adapters/engine_wire/relay.c was not built where the "
                            "gateway was installed (no C compiler or Python headers)")
        self._max = max_streams
        self._pool: ThreadPoolExecutor | None = None
        self._running: dict[int, int] = {}   # each running stream's eventfd: its engine fd
        self.streams = 0                   # streams it has taken part of, since the start

    @property
    def enabled(self) -> bool:
        return self.why_off is None

    @property
    def active(self) -> int:
        return len(self._running)

    def usable(self, transport: asyncio.Transport | None, upstream: object) -> bool:
        """Whether relay.c may take this stream: a local engine's answer, a plain client
        connection with nothing waiting in it, a free thread."""
        return (self.enabled and isinstance(upstream, EngineResponse)
                and len(self._running) < self._max and transport is not None
                and not transport.is_closing()
                and transport.get_extra_info("sslcontext") is None
                and transport.get_write_buffer_size() == 0
                and transport.get_extra_info("socket") is not None)

    async def forward(self, transport: asyncio.Transport, upstream: EngineResponse,
                      stall_timeout_s: float, took: Callable[[Forwarded], None]
                      ) -> Forwarded | None:
        """Runs relay.c on this stream until it stops, then calls took() with what it did
        and returns it; None if it could not start (the stream is then as it was). If the
        handler is cancelled meanwhile, relay.c is stopped and waited for (it returns at
        once), took() called, the connection taken back, and CancelledError re-raised."""
        assert _native is not None
        engine_fd = upstream.detach()
        if engine_fd is None:
            return None
        client_fd = cancel_fd = -1
        try:
            client_fd = os.dup(transport.get_extra_info("socket").fileno())
            cancel_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except OSError:
            for fd in (engine_fd, client_fd):
                if fd != -1:
                    os.close(fd)
            upstream.reattach(b"", 0.0)
            return None
        # imported at the first stream, off the socket-activated start's path
        # (docs/benchmarks.md, "Figures behind choices in the code")
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(self._max, thread_name_prefix="relay")
        self._running[cancel_fd] = engine_fd
        self.streams += 1
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(self._pool, _native.forward, engine_fd, client_fd,
                                       cancel_fd, upstream.read_timeout_s, stall_timeout_s)
        cancelled = False
        try:
            while not running.done():
                try:
                    await asyncio.shield(running)
                except asyncio.CancelledError:
                    # the client left, or the gateway stops: relay.c returns at once
                    cancelled = True
                    _interrupt(cancel_fd, engine_fd)
                except Exception:   # running.result() below raises it
                    pass
        finally:
            self._running.pop(cancel_fd, None)
            fds = (engine_fd, client_fd, cancel_fd)
            if running.done():
                _close(fds)
            else:   # left by something else than a cancel: never close what relay.c uses
                _interrupt(cancel_fd, engine_fd)
                running.add_done_callback(lambda _: _close(fds))
        try:
            result = running.result()
        except Exception:   # (MemoryError from relay.c): the stream stays Python's
            upstream.reattach(b"", 0.0)
            raise
        reason, _errno, unread, events, last_chunk, data_bytes, idle_s, unsent = result
        done = Forwarded(_REASONS[reason], events, last_chunk, data_bytes)
        upstream.reattach(b"" if done.client_gone or done.reason == "cancelled" else unread,
                          idle_s)
        if unsent and not transport.is_closing():
            transport.write(unsent)   # the rest of a chunk a cancel cut: first, whole
        took(done)
        if cancelled:
            raise asyncio.CancelledError()
        return done

    def close(self) -> None:
        """Stops every stream relay.c has (the gateway stops) and lets its threads go."""
        for cancel_fd, engine_fd in list(self._running.items()):
            _interrupt(cancel_fd, engine_fd)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _interrupt(cancel_fd: int, engine_fd: int) -> None:
    """relay.c stops at once: its cancel signalled, and a read waiting on the engine woken
    (the engine connection's reading is shut down: a cancelled stream is not read on)."""
    assert _native is not None
    with contextlib.suppress(OSError):
        _native.interrupt(cancel_fd, engine_fd)


def _close(fds: tuple[int, ...]) -> None:
    for fd in fds:
        os.close(fd)
