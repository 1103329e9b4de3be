"""gatewayd/adapters/engine_wire/relay.c on its own: real sockets (a socketpair for each
side), the function run in a thread as the gateway runs it, every way it can stop."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from multidict import CIMultiDict

from gatewayd.adapters.engine_wire import native_relay
from gatewayd.adapters.engine_wire.client import EngineResponse

_relay = native_relay._native
Result = tuple[int, int, bytes, int, bytes, int, float, bytes]   # relay.c's forward()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def event(text: str) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"%b"}}]}\n\n' % text.encode()


@dataclass
class Pipes:
    engine: socket.socket            # the test writes here, as the engine
    client: socket.socket            # the test reads here, as the client
    _relay_ends: list[socket.socket] = field(default_factory=list)
    cancel: int = -1
    result: Result | None = None
    thread: threading.Thread | None = None

    def start(self, read_timeout: float = 10.0, stall_timeout: float = 10.0) -> None:
        assert _relay is not None
        engine_end, client_end = self._relay_ends

        def run() -> None:
            assert _relay is not None
            self.result = _relay.forward(engine_end.fileno(), client_end.fileno(),
                                         self.cancel, read_timeout, stall_timeout)
        self.thread = threading.Thread(target=run)
        self.thread.start()

    def finish(self, timeout: float = 10.0) -> Result:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "relay.c did not return"
        assert self.result is not None
        return self.result

    def interrupt(self) -> None:
        """As the gateway stops relay.c: the cancel signalled, the engine's read woken."""
        assert _relay is not None
        _relay.interrupt(self.cancel, self._relay_ends[0].fileno())

    def read_client(self, size: int, timeout: float = 10.0) -> bytes:
        self.client.settimeout(timeout)
        got = b""
        while len(got) < size:
            piece = self.client.recv(size - len(got))
            if not piece:
                break
            got += piece
        return got


@pytest.fixture
def pipes() -> Iterator[Pipes]:
    if _relay is None:
        pytest.fail("gatewayd/adapters/engine_wire/relay.c is not built (scripts/setup builds it)")
    engine, engine_end = socket.socketpair()
    client_end, client = socket.socketpair()
    for s in (engine_end, client_end):
        s.setblocking(False)          # as uvloop's sockets are
    p = Pipes(engine, client, [engine_end, client_end],
              os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK))
    yield p
    if p.thread is not None and p.thread.is_alive():
        p.interrupt()
        p.thread.join(10)
    for s in (engine, engine_end, client_end, client):
        s.close()
    os.close(p.cancel)


def test_whole_chunks_pass_with_their_framing_until_the_last_chunk(pipes: Pipes) -> None:
    assert _relay is not None
    pipes.start()
    sent = [chunk(event(f"w{i}")) for i in range(3)]
    for c in sent:
        pipes.engine.sendall(c)
    assert pipes.read_client(sum(map(len, sent))) == b"".join(sent)
    pipes.engine.sendall(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    reason, _, unread, events, last, data_bytes, *_ = pipes.finish()
    assert reason == _relay.HANDBACK and unread == b"0\r\n\r\n"   # the end is Python's
    done = chunk(b"data: [DONE]\n\n")
    assert pipes.read_client(len(done)) == done
    assert events == 3 and last == chunk(b"data: [DONE]\n\n")
    assert data_bytes == sum(len(event(f"w{i}")) for i in range(3)) + 14


def test_a_chunk_split_over_reads_goes_whole(pipes: Pipes) -> None:
    assert _relay is not None
    pipes.start()
    c = chunk(event("split") * 3)
    pipes.engine.sendall(c[:5])
    pipes.client.settimeout(0.2)
    with pytest.raises(TimeoutError):   # nothing of it yet: only whole chunks go
        pipes.client.recv(1)
    pipes.engine.sendall(c[5:])
    assert pipes.read_client(len(c)) == c
    pipes.engine.shutdown(socket.SHUT_WR)
    reason, _, unread, events, *_ = pipes.finish()
    assert reason == _relay.ENGINE_EOF and unread == b"" and events == 3


@pytest.mark.parametrize("odd", [
    chunk(b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n'),   # the record's
    b"1A\r\n" + b"x" * 24 + b"\n\n\r\n",                    # uppercase hex
    b"1a;ext=1\r\n" + b"x" * 24 + b"\n\n\r\n",              # an extension
    b"01a\r\n" + b"x" * 24 + b"\n\n\r\n",                   # a leading zero
    chunk(b"data: half an event\n"),                      # not whole events
    b"1a\r\n" + b"x" * 24 + b"\n\nXX",                      # bad framing after the data
], ids=["usage", "uppercase", "extension", "leading-zero", "half-event", "bad-crlf"])
def test_what_python_must_see_is_handed_back_unsent(pipes: Pipes, odd: bytes) -> None:
    assert _relay is not None
    pipes.start()
    first = chunk(event("a"))
    pipes.engine.sendall(first)
    assert pipes.read_client(len(first)) == first
    pipes.engine.sendall(odd + chunk(event("b")))
    reason, _, unread, events, last, *_ = pipes.finish()
    assert reason == _relay.HANDBACK and unread.startswith(odd)
    assert events == 1 and last == first
    pipes.client.setblocking(False)
    with pytest.raises(BlockingIOError):
        pipes.client.recv(1)                 # nothing after the first went out


def test_a_chunk_larger_than_the_buffer_is_handed_back(pipes: Pipes) -> None:
    assert _relay is not None
    pipes.start()
    big = chunk(b"data: " + b"x" * (_relay.BUF_SIZE) + b"\n\n")
    pipes.engine.sendall(big[:1000])
    reason, _, unread, events, *_ = pipes.finish()
    assert reason == _relay.HANDBACK and big[:1000].startswith(unread) and events == 0


def test_engine_silence_ends_after_the_read_timeout(pipes: Pipes) -> None:
    assert _relay is not None
    t0 = time.monotonic()
    pipes.start(read_timeout=0.3)
    reason, _, unread, _, _, _, idle, _ = pipes.finish()
    assert reason == _relay.IDLE and unread == b""
    assert idle >= 0.3 and time.monotonic() - t0 >= 0.3


def test_a_signal_during_the_wait_does_not_extend_the_read_timeout(pipes: Pipes) -> None:
    """SO_RCVTIMEO counts from each read's start: a read restarted after a signal (EINTR)
    waits only for the rest of read_timeout, not a whole one more."""
    assert _relay is not None
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)   # (no SA_RESTART: EINTR)
    try:
        t0 = time.monotonic()
        pipes.start(read_timeout=0.5)
        time.sleep(0.35)                 # relay.c is waiting on the silent engine
        assert pipes.thread is not None and pipes.thread.ident is not None
        signal.pthread_kill(pipes.thread.ident, signal.SIGUSR1)
        reason, *_ = pipes.finish()
        took = time.monotonic() - t0
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert reason == _relay.IDLE
    assert 0.5 <= took < 0.75, took      # a whole timeout more would end at 0.85 at least


def test_a_client_that_takes_nothing_is_stalled_and_its_bytes_not_counted(
        pipes: Pipes) -> None:
    assert _relay is not None
    pipes.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    pipes.start(stall_timeout=0.3)
    payload = b'data: {"y": "' + b"y" * 30000 + b'"}\n\n'
    c = chunk(payload)

    def engine_writes() -> None:
        try:
            for _ in range(200):
                pipes.engine.sendall(c)
        except OSError:
            pass
    writer = threading.Thread(target=engine_writes, daemon=True)
    writer.start()
    reason, _, _, events, _, data_bytes, *_ = pipes.finish()
    assert reason == _relay.STALLED
    # what went before the stall went whole; the send that stalled is not counted
    assert data_bytes == events * len(payload)
    pipes.engine.close()


def test_a_client_that_left_ends_it(pipes: Pipes) -> None:
    assert _relay is not None
    pipes.start()
    pipes.client.close()
    pipes.engine.sendall(chunk(event("nobody")))
    reason, err, _, events, *_ = pipes.finish()
    assert reason == _relay.CLIENT_GONE and err in (32, 104)   # EPIPE, ECONNRESET
    assert events == 0


def test_a_cancel_stops_it_at_once(pipes: Pipes) -> None:
    assert _relay is not None
    pipes.start()
    first = chunk(event("a"))
    pipes.engine.sendall(first)
    assert pipes.read_client(len(first)) == first
    pipes.interrupt()
    reason, _, _, events, last, *_ = pipes.finish(timeout=2)
    assert reason == _relay.CANCELLED and events == 1 and last == first


@pytest.mark.parametrize("how", ["handback", "idle", "cancelled"])
def test_the_engine_socket_is_non_blocking_again_however_it_ends(
        pipes: Pipes, how: str) -> None:
    """relay.c waits in a blocking read with SO_RCVTIMEO on the engine's socket (shared
    with the event loop's): both are put back before it returns, or the loop's next read
    of that connection would block the gateway."""
    assert _relay is not None
    engine_end = pipes._relay_ends[0]
    pipes.start(read_timeout=0.3 if how == "idle" else 10.0)
    blocked_at = time.monotonic() + 5
    while not os.get_blocking(engine_end.fileno()):   # it waits in a blocking read
        assert time.monotonic() < blocked_at, "relay.c never blocked on the engine"
        time.sleep(0.005)
    if how == "handback":
        pipes.engine.sendall(b"0\r\n\r\n")
    elif how == "cancelled":
        pipes.interrupt()
    reason, *_ = pipes.finish()
    assert reason == getattr(_relay, how.upper())
    assert os.get_blocking(engine_end.fileno()) is False
    timeout = engine_end.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
    assert timeout == bytes(16)   # (struct timeval: none, as before)


def test_an_interrupt_before_it_starts_is_not_lost(pipes: Pipes) -> None:
    assert _relay is not None
    pipes.interrupt()
    pipes.start()
    reason, *_ = pipes.finish(timeout=2)
    assert reason == _relay.CANCELLED


def test_an_engine_end_that_is_no_socket_is_polled(pipes: Pipes) -> None:
    """Where the engine's descriptor takes no socket options (a pipe here), relay.c polls
    before each read: the same events pass, the same cancel stops it."""
    assert _relay is not None
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    client_end = pipes._relay_ends[1]
    results: list[Result] = []
    thread = threading.Thread(target=lambda: results.append(_relay.forward(
        read_end, client_end.fileno(), pipes.cancel, 10.0, 10.0)))
    thread.start()
    try:
        first = chunk(event("a"))
        os.write(write_end, first)
        assert pipes.read_client(len(first)) == first
        os.eventfd_write(pipes.cancel, 1)   # (no socket to shut down: the cancel alone)
        thread.join(2)
        assert not thread.is_alive() and results[0][0] == _relay.CANCELLED
        assert results[0][3] == 1 and os.get_blocking(read_end) is False
    finally:
        os.eventfd_write(pipes.cancel, 1)
        thread.join(10)
        os.close(read_end)
        os.close(write_end)


class _Transport:
    def __init__(self, **extra: object) -> None:
        self.extra = {"sslcontext": None, "socket": object(), **extra}
        self.buffered = 0
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.extra.get(name, default)

    def get_write_buffer_size(self) -> int:
        return self.buffered


def _engine_answer() -> EngineResponse:
    return EngineResponse(cast(Any, None), cast(Any, None), 200, "OK", CIMultiDict())


@pytest.mark.parametrize("case", ["tls", "buffered", "closing", "remote", "full", "off"])
def test_the_native_relay_is_not_used_where_it_could_go_wrong(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never for a TLS client (its socket carries records, not the events), nor with bytes
    still waiting in the client's transport (they would come after relay.c's), nor for a
    remote upstream's answer, nor past max_streams threads, nor when turned off."""
    if _relay is None:
        pytest.fail("gatewayd/adapters/engine_wire/relay.c is not built (scripts/setup builds it)")
    transport = _Transport()
    upstream: object = _engine_answer()
    relay = native_relay.NativeRelay()
    assert relay.usable(cast(Any, transport), upstream)           # the plain case: used
    if case == "tls":
        transport.extra["sslcontext"] = object()
    elif case == "buffered":
        transport.buffered = 1
    elif case == "closing":
        transport.closing = True
    elif case == "remote":
        upstream = object()
    elif case == "full":
        relay = native_relay.NativeRelay(max_streams=0)
    else:
        monkeypatch.setenv("LLM_GATEWAY_NATIVE_RELAY", "0")
        relay = native_relay.NativeRelay()
    assert not relay.usable(cast(Any, transport), upstream)


def test_a_cancel_in_the_middle_of_a_chunk_gives_its_rest_back(pipes: Pipes) -> None:
    """The gateway's drain deadline, with a slow client: relay.c stops inside a chunk. Its
    rest comes back to be sent first, so the error event that follows is a chunk of its
    own, not bytes inside one."""
    assert _relay is not None
    pipes._relay_ends[1].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    pipes.start()
    payload = b'data: {"y": "' + b"y" * (_relay.BUF_SIZE - 200) + b'"}\n\n'
    c = chunk(payload)
    pipes.engine.sendall(c)
    pipes.client.setblocking(False)
    got = b""
    deadline = time.monotonic() + 10
    while not got:                       # some of it reached the client, not all
        assert time.monotonic() < deadline
        try:
            got = pipes.client.recv(1024)
        except BlockingIOError:
            time.sleep(0.01)
    pipes.interrupt()
    reason, _, unread, events, last, data_bytes, _, unsent = pipes.finish()
    assert reason == _relay.CANCELLED and unread == b""
    assert 0 < len(unsent) < len(c) and c.endswith(unsent)
    assert events == 1 and last == c and data_bytes == len(payload)
    while True:                          # what the client can still read, then the rest
        try:
            piece = pipes.client.recv(65536)
        except BlockingIOError:
            break
        got += piece
    assert got + unsent == c


def test_why_the_native_relay_is_off_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway logs it at the start: an install without relay.c still works, at more
    CPU per event, and its operator can see why."""
    monkeypatch.setenv("LLM_GATEWAY_NATIVE_RELAY", "0")
    off = native_relay.NativeRelay()
    assert not off.enabled and "LLM_GATEWAY_NATIVE_RELAY" in (off.why_off or "")
    monkeypatch.delenv("LLM_GATEWAY_NATIVE_RELAY")
    monkeypatch.setattr(native_relay, "_native", None)
    unbuilt = native_relay.NativeRelay()
    assert not unbuilt.enabled and "relay.c was not built" in (unbuilt.why_off or "")
    monkeypatch.undo()
    if _relay is not None:
        on = native_relay.NativeRelay()
        assert on.enabled and on.why_off is None
