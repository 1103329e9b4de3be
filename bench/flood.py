"""A load generator for refusals: raw sockets, requests pipelined on kept-alive connections.

    python -m bench.flood --port 18650 --request 401.http --connections 32 --depth 16 \
        --seconds 3

Each connection keeps up to `depth` requests in flight: the request bytes (a file holding
one whole request, head and body) sent `depth` times at once, then once more for every
answer read, in batches of half the depth. Answers are framed by their Content-Length (a
refusal has one) and counted by status. A connection the server closes is opened again
(counted). Several --request files: the connections take them in turn (a mixed flood).

It prints `go` once every connection is open and the flood begins, then, at the end, one
JSON line: answers by status, the seconds measured, its own CPU seconds over them (so a
report can say what the generator took of the machine), reopened connections. The
standard library only, one thread: a Python client spends a few µs per pipelined answer,
well below what a server spends on a request, so the server is what is measured.
`--until-stdin-closes`: flood until the standard input closes instead of for --seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import selectors
import socket
import sys
import time
from collections import Counter
from pathlib import Path

LENGTH = b"\r\ncontent-length: "
READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class Connection:
    def __init__(self, address: tuple[str, int], request: bytes, depth: int) -> None:
        self.address, self.request, self.depth = address, request, depth
        self.sock = self._open()
        self.buf = b""
        self.out = request * depth
        self.owed = 0   # answers read whose next requests are not sent yet
        self.writing = True   # registered for EVENT_WRITE

    def _open(self) -> socket.socket:
        sock = socket.create_connection(self.address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        return sock

    def reopen(self) -> None:
        self.sock.close()
        self.sock = self._open()
        self.buf = b""
        self.out = self.request * self.depth
        self.owed = 0
        self.writing = True

    def answers(self, data: bytes, counts: Counter[bytes]) -> int:
        """The whole answers in what was read so far, counted by status; how many."""
        n, self.buf = split_answers(self.buf + data if self.buf else data, counts)
        return n


def split_answers(buf: bytes, counts: Counter[bytes]) -> tuple[int, bytes]:
    """The whole answers at the start of buf, counted by status (framed by their
    Content-Length; none: no body): how many, and the bytes left after them."""
    pos, n = 0, 0
    while True:
        end = buf.find(b"\r\n\r\n", pos)
        if end < 0:
            break
        head = buf[pos:end].lower()
        at = head.find(LENGTH)
        if at < 0:
            length = 0
        else:
            stop = head.find(b"\r\n", at + len(LENGTH))
            length = int(head[at + len(LENGTH):stop if stop >= 0 else len(head)])
        if len(buf) < end + 4 + length:
            break
        counts[buf[pos + 9:pos + 12]] += 1
        pos = end + 4 + length
        n += 1
    return n, buf[pos:]


def flood(address: tuple[str, int], requests: list[bytes], connections: int, depth: int,
          seconds: float | None) -> dict[str, object]:
    conns = [Connection(address, requests[i % len(requests)], depth)
             for i in range(connections)]
    sel = selectors.DefaultSelector()
    for c in conns:
        sel.register(c.sock, READ | WRITE, c)
    if seconds is None:
        sel.register(sys.stdin, selectors.EVENT_READ, None)
    counts: Counter[bytes] = Counter()
    reopened = 0
    print("go", flush=True)
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    deadline = t0 + seconds if seconds is not None else float("inf")
    running = True
    while running:
        timeout = deadline - time.perf_counter()
        if timeout <= 0:
            break
        for key, events in sel.select(min(timeout, 1.0)):
            c = key.data
            if c is None:   # stdin: closed (or a line) is the end
                running = False
                break
            if events & READ:
                data: bytes | None
                try:
                    data = c.sock.recv(1 << 18)
                except (BlockingIOError, InterruptedError):
                    data = None
                except OSError:   # reset
                    data = b""
                if data == b"":   # the server closed it: a new one
                    sel.unregister(c.sock)
                    c.reopen()
                    reopened += 1
                    sel.register(c.sock, READ | WRITE, c)
                    continue
                if data:
                    c.owed += c.answers(data, counts)
                    # sent in batches of half the depth: fewer, larger writes (the
                    # generator's own cost per answer)
                    if c.owed * 2 >= c.depth:
                        c.out += c.request * c.owed
                        c.owed = 0
            if c.out:
                try:
                    sent = c.sock.send(c.out)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except (BrokenPipeError, ConnectionResetError):
                    sent = len(c.out)   # the read that follows sees the close
                c.out = c.out[sent:]
            if bool(c.out) != c.writing:   # (epoll_ctl only when it changes)
                c.writing = bool(c.out)
                sel.modify(c.sock, READ | (WRITE if c.writing else 0), c)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    for c in conns:
        c.sock.close()
    return {"statuses": {k.decode(): v for k, v in sorted(counts.items())},
            "answers": sum(counts.values()), "seconds": round(wall, 4),
            "cpu_s": round(usage.ru_utime + usage.ru_stime
                           - usage0.ru_utime - usage0.ru_stime, 4),
            "reopened": reopened}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.flood")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--request", type=Path, action="append", required=True,
                    help="a file holding one whole request (head and body)")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--depth", type=int, default=16, help="requests in flight per connection")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--until-stdin-closes", action="store_true")
    a = ap.parse_args(argv)
    requests = [p.read_bytes() for p in a.request]
    result = flood((a.host, a.port), requests, a.connections, a.depth,
                   None if a.until_stdin_closes else a.seconds)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
