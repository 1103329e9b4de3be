"""Taking connections from a listening socket ourselves, so that a stop can stop taking
them without losing one already taken.

asyncio's own server (loop.create_server, which aiohttp's sites use) has no public way to
stop accepting short of closing it, and closing loses connections: it accepts a batch per
wakeup and gives each its transport a loop turn later, and a transport made after the
close fails (Server._attach asserts the server is open), so the client is reset. Here the
accepting is ours: a stop stops polling the socket, waits until every connection already
taken has its transport, and only then closes our descriptor. A socket systemd passed us
stays open in systemd: what was not accepted waits in its backlog for the next process.

The protocol factory is aiohttp's web.Server (the documented low-level use:
`loop.create_server(runner.server, ...)`), so the connections are aiohttp's as before.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import weakref
from collections.abc import Callable, Sequence

log = logging.getLogger("gatewayd")

ACCEPT_BATCH = 128       # the most accepted per wakeup (asyncio's own server's figure)
# the queue of connections not accepted yet: the kernel's bound (net.core.somaxconn, 4096
# since Linux 5.4), as a systemd socket's Backlog= defaults to. aiohttp's 128 overflowed in
# a burst of connections (a flood of refused requests: 10 000 at once), and a SYN the queue
# drops is retried by the client 1, 3, 7 s later: seconds on a new connection's first answer
BACKLOG = socket.SOMAXCONN
# out of descriptors or memory: how long the socket rests before the next accept
# (asyncio's own server waits the same)
ACCEPT_RETRY_S = 1.0
_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class Listener:
    """Accepts connections from listening sockets and hands each to a protocol."""

    def __init__(self, sockets: Sequence[socket.socket], protocol: ProtocolFactory) -> None:
        self._sockets = list(sockets)
        self._protocol = protocol
        self._accepting = False
        # accepted, their transport not made yet: a stop waits for these
        self._pending: set[asyncio.Task[None]] = set()
        # weak: a closed connection leaves by itself, with no bookkeeping per close
        self._connections: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()

    def start(self) -> None:
        self._accepting = True
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            sock.setblocking(False)
            loop.add_reader(sock, self._accept, sock)

    def connections(self) -> list[asyncio.BaseTransport]:
        """The connections taken from these sockets that are still open."""
        return [t for t in list(self._connections) if not t.is_closing()]

    async def stop(self) -> None:
        """Stop taking connections; every one already taken is set up before this
        returns (none is reset). Our descriptors are closed, not the socket systemd holds."""
        if not self._accepting:
            return
        self._accepting = False
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            loop.remove_reader(sock)
        while self._pending:
            await asyncio.wait(set(self._pending))
        for sock in self._sockets:
            sock.close()

    def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPT_BATCH):
            if not self._accepting:
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue   # the client gave up while queued: the next one
            except OSError as e:
                # polled again at once it would fail again at once (a busy loop)
                level = logging.WARNING if e.errno in _RESOURCE_ERRORS else logging.ERROR
                log.log(level, "accepting a connection failed (%s); accepting again in %gs",
                        e, ACCEPT_RETRY_S)
                loop.remove_reader(sock)
                loop.call_later(ACCEPT_RETRY_S, self._resume, sock)
                return
            task = loop.create_task(self._set_up(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def _resume(self, sock: socket.socket) -> None:
        if self._accepting:
            asyncio.get_running_loop().add_reader(sock, self._accept, sock)

    async def _set_up(self, conn: socket.socket) -> None:
        try:
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                # answers go out as written: asyncio's own server sets it only where the
                # socket was made with IPPROTO_TCP, uvloop always
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
                self._protocol, conn)
        except OSError as e:   # the client left before it was set up: nobody to tell
            log.debug("an accepted connection failed before it was served: %s", e)
            conn.close()
            return
        self._connections.add(transport)


async def bind_tcp(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for host:port, bound as asyncio's create_server binds them: one
    per address the name resolves to ("": every address of this machine), SO_REUSEADDR,
    an IPv6 socket IPv6 only (its IPv4 twin has its own)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise OSError(e.errno, f"error while attempting to bind on address "
                                       f"{address!r}: {e.strerror}") from None
            sock.listen(BACKLOG)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
