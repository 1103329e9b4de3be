"""The least a Python relay can spend on a stream: a raw asyncio protocol that passes the
engine's bytes to the client as they arrive, unparsed (bench/hotpath's `raw`).

Not a proxy anyone could use (no parsing, no errors, no records: the engine's own head
and chunked body go to the client verbatim, one engine connection per request); it tells
how much of the gateway's CPU per event is the gateway's and how much the event loop's,
the two recv/send system calls and the Python callback every relay pays.

    python -m bench.raw_relay --socket /tmp/engine.sock --port 18610
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

_FORWARDS: set[asyncio.Future[None]] = set()


class _EngineSide(asyncio.Protocol):
    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client
        self.client_write = client.write

    def data_received(self, data: bytes) -> None:
        if not self.client.is_closing():   # (the client may leave mid-stream)
            self.client_write(data)


class _ClientSide(asyncio.Protocol):
    def __init__(self, socket: str) -> None:
        self.socket = socket
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)   # (uvloop's: no subclass)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end == -1:
            return
        head = self.buffer[:end].lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at != -1 else 0
        if len(self.buffer) < end + 4 + length:
            return
        request, self.buffer = self.buffer[:end + 4 + length], self.buffer[end + 4 + length:]
        task = asyncio.ensure_future(self._forward(request))
        _FORWARDS.add(task)
        task.add_done_callback(_FORWARDS.discard)

    async def _forward(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        engine, _ = await loop.create_unix_connection(
            lambda: _EngineSide(self.transport), self.socket)
        engine.write(request)


async def serve(socket: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _ClientSide(socket), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.raw_relay")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    asyncio.run(serve(a.socket, a.port))


if __name__ == "__main__":
    main()
