"""HTTP/1.x on a raw socket, for tests that must write what a client library would not send
(conflicting framing, bytes no header may hold) and read the answer byte for byte.

A Request is written down compactly (a Long stands for a long run of one piece, so that a
Hypothesis case with a 1 MiB body prints in a line); a Connection sends it and reads the
answer strictly: a status line, header fields and a body framed as they say, or the test
fails saying what came instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

HOST = b"{HOST}"             # stands for the server's host:port in a request
ANSWER_S = 10.0              # an answer comes within this
CLOSE_S = 2.0                # and a close the answer says, or the RFC asks for, within this


@dataclass(frozen=True)
class Long:
    """`piece` repeated to `size` bytes: long values and bodies, short to write down."""

    piece: bytes
    size: int

    def bytes(self) -> bytes:
        return (self.piece * (self.size // max(1, len(self.piece)) + 1))[:self.size] \
            if self.piece else b""


Part = bytes | Long


def joined(parts: tuple[Part, ...] | Part) -> bytes:
    if isinstance(parts, tuple):
        return b"".join(joined(p) for p in parts)
    return parts.bytes() if isinstance(parts, Long) else parts


@dataclass(frozen=True)
class Request:
    """One request as sent. Its framing is in its header fields (what they say is what the
    checks go by); the body is sent chunked where `chunks` is set (the sizes of all chunks
    but the last; `chunk_fault`: a broken size line sent for the first), else as is."""

    method: bytes
    target: bytes
    version: bytes = b"1.1"
    fields: tuple[tuple[bytes, Part], ...] = ((b"Host", HOST),)
    body: tuple[Part, ...] = ()
    chunks: tuple[int, ...] | None = None
    chunk_fault: bytes | None = None
    trailers: tuple[tuple[bytes, bytes], ...] = ()

    def wire(self, host: bytes) -> bytes:
        head = [self.method + b" " + self.target.replace(HOST, host) + b" HTTP/"
                + self.version]
        head += [name + b": " + joined(value).replace(HOST, host)
                 for name, value in self.fields]
        return b"\r\n".join(head) + b"\r\n\r\n" + self._framed_body()

    def _framed_body(self) -> bytes:
        body = joined(self.body)
        if self.chunks is None:
            return body
        out, at = [], 0
        for i, size in enumerate((*self.chunks, max(0, len(body) - sum(self.chunks)))):
            piece, at = body[at:at + size], at + size
            if not piece:
                continue
            size_line = self.chunk_fault if i == 0 and self.chunk_fault is not None \
                else b"%x" % len(piece) + (b";ext=1" if i % 2 else b"")
            out.append(size_line + b"\r\n" + piece + b"\r\n")
        if self.chunk_fault is not None and not out:
            out.append(self.chunk_fault + b"\r\n")
        out.append(b"0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in self.trailers)
                   + b"\r\n")
        return b"".join(out)

    def values(self, name: bytes) -> list[bytes]:
        return [joined(v).strip(b" \t") for n, v in self.fields if n.lower() == name]

    @property
    def path(self) -> str:
        """The path as the gateway sees it (decoded; from an absolute-form target too)."""
        target = self.target.replace(HOST, b"h").decode("latin-1")
        return unquote(urlsplit(target).path)


@dataclass
class Answer:
    version: bytes
    status: int
    fields: list[tuple[bytes, bytes]]
    body: bytes
    interim: list[int]

    def get(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.fields if n.lower() == name), None)

    def tokens(self, name: bytes) -> set[bytes]:
        return {t.strip().lower() for n, v in self.fields if n.lower() == name
                for t in v.split(b",")}

    def __repr__(self) -> str:
        return f"HTTP/{self.version.decode()} {self.status} {self.fields} {self.body[:300]!r}"


class Connection:
    """A raw socket read strictly: what comes back must be HTTP/1.x, exactly."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf, self.eof = sock, bytearray(), False
        self.loop = asyncio.get_running_loop()

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        return cls(sock)

    async def send(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def _more(self) -> None:
        assert not self.eof, f"closed in the middle of an answer: {bytes(self.buf[:300])!r}"
        data = await self.loop.sock_recv(self.sock, 1 << 16)
        self.eof = not data
        self.buf += data

    async def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            assert len(self.buf) < 1 << 17, "a line without end"
            await self._more()
        line = bytes(self.buf[:end])
        del self.buf[:end + 2]
        return line

    async def exactly(self, size: int) -> bytes:
        while len(self.buf) < size:
            await self._more()
        data = bytes(self.buf[:size])
        del self.buf[:size]
        return data

    async def answer(self, head_only: bool) -> Answer:
        interim: list[int] = []
        while True:
            line = await self.line()
            status = re.fullmatch(rb"HTTP/(1\.[01]) ([1-5][0-9][0-9]) [\t -~\x80-\xff]*", line)
            assert status, f"not a status line: {line!r}"
            fields = []
            while line := await self.line():
                m = re.fullmatch(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([^\x00]*?)[ \t]*",
                                 line)
                assert m, f"not a header field: {line!r}"
                fields.append((m[1], m[2]))
            answer = Answer(status[1], int(status[2]), fields, b"", interim)
            if answer.status >= 200:
                break
            assert answer.status == 100 and not interim, f"an odd interim answer: {answer}"
            interim.append(answer.status)
        te, cl = answer.get(b"transfer-encoding"), answer.get(b"content-length")
        assert te is None or cl is None, f"Transfer-Encoding and Content-Length: {answer}"
        # (the parser refuses a request before it knows it is a HEAD: its refusal has a body)
        if (head_only and not refused_by_parser(answer)) or answer.status in (204, 304):
            return answer
        if te is not None:
            assert te.lower() == b"chunked", answer
            while size := int(await self.line(), 16):
                answer.body += await self.exactly(size)
                assert await self.exactly(2) == b"\r\n", answer
            while await self.line():   # trailers
                pass
        elif cl is not None:
            assert cl.isdigit(), answer
            answer.body = await self.exactly(int(cl))
        else:   # delimited by the close
            while not self.eof:
                await self._more()
            answer.body, self.buf = bytes(self.buf), bytearray()
        return answer

    async def closed(self) -> bool:
        """Whether the gateway closes the connection now, sending nothing more."""
        try:
            while not self.eof:
                assert not self.buf, f"more than one answer: {bytes(self.buf[:300])!r}"
                await asyncio.wait_for(self._more(), CLOSE_S)
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        assert not self.buf, f"more than one answer: {bytes(self.buf[:300])!r}"
        return True

    def close(self) -> None:
        self.sock.close()


async def exchange(host: str, port: int, req: Request
                   ) -> tuple[Connection, Answer | None, BaseException | None]:
    """Send the request while reading its answer (the gateway may answer before it has
    read the whole body); the answer, or what broke the connection before one came."""
    conn = await Connection.open(host, port)
    sending = asyncio.ensure_future(conn.send(req.wire(f"{host}:{port}".encode())))
    try:
        async with asyncio.timeout(ANSWER_S):
            answer = await conn.answer(head_only=req.method == b"HEAD")
    except (ConnectionResetError, AssertionError) as e:
        if isinstance(e, AssertionError) and not (conn.eof and not conn.buf):
            raise
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        return conn, None, e
    except TimeoutError:
        raise AssertionError(f"no answer in {ANSWER_S:g}s; read {bytes(conn.buf[:300])!r}") \
            from None
    # answered before the body was read, and closed: the answer is what counts
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        await sending
    return conn, answer, None


def refused_by_parser(answer: Answer) -> bool:
    return answer.status == 400 and (answer.get(b"content-type") or b"").startswith(
        b"text/plain")
