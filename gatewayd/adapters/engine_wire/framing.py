"""HTTP/1.1 as the gateway speaks it to an engine: the request's head, and the one parser
of answers that every exchange with an engine goes through.

Pure: bytes in, a head and the body's pieces out; no socket, no loop, no clock (so it is
fuzzed on its own, tests/unit/test_engine_framing.py). It takes what llama-server and
whisper-server answer:
- answers framed by Content-Length, by chunked transfer coding, or by the close of the
  connection; 1xx answers are skipped; a HEAD, 204 or 304 has no body;
- bounds on everything it holds before it can pass it on: the head (MAX_HEAD), a chunk's
  size line (MAX_CHUNK_LINE), the trailers (MAX_HEAD); a chunk size of plain hex digits
  only (int(x, 16) alone also takes a sign, a 0x prefix, underscores and spaces, and a
  negative size walked a parser backwards, for ever).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from multidict import CIMultiDict

from gatewayd.adapters.engine_wire.errors import BadFraming, EngineConnectionError

MAX_HEAD = 64 * 1024          # an answer's status line and headers (and, apart, its trailers)
MAX_CHUNK_LINE = 4096         # a chunk-size line (with extensions)
# a chunk's size: 15 hex digits stay below 2**60 (and so fit any size type on the way)
MAX_CHUNK_DIGITS = 15
HEX_DIGITS = b"0123456789abcdefABCDEF"
NO_BODY_STATUSES = frozenset({204, 304})

HEAD, BODY, DONE = range(3)                  # AnswerParser.state
LENGTH, CHUNKED, UNTIL_CLOSE = range(3)      # AnswerParser.framing

Head = tuple[int, str, CIMultiDict[str]]     # status, reason, headers


def request_head(method: str, target: str, headers: Iterable[tuple[str, str]],
                 length: int, *, body_expected: bool) -> bytes:
    """The request line and headers. The headers come from the client's request, already
    parsed by aiohttp's server (which refuses CR and LF in them) less the hop-by-hop ones,
    or are the gateway's own."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: engine\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers
                 if "\n" not in value and "\r" not in value)   # (never one, but never twice)
    if body_expected:
        lines.append(f"Content-Length: {length}\r\n")
    lines.append("\r\n")
    # aiohttp decoded the client's bytes as UTF-8 with surrogateescape: the same bytes go on
    return "".join(lines).encode("utf-8", "surrogateescape")


def parse_head(head: bytes) -> tuple[int, str, CIMultiDict[str], bool]:
    """(status, reason, headers, keep-alive) of an answer's head (without its blank line)."""
    text = head.decode("latin-1")
    status_line, _, rest = text.partition("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or len(parts[1]) != 3 \
            or not parts[1].isascii() or not parts[1].isdigit():   # (isdigit: also "²")
        raise BadFraming(f"not an HTTP answer from the engine: {status_line[:80]!r}")
    headers: CIMultiDict[str] = CIMultiDict()
    if rest:
        for line in rest.split("\r\n"):
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise BadFraming(f"bad header line from the engine: {line[:80]!r}")
            headers.add(name, value.strip())
    connection = headers.get("Connection", "").lower()
    keep_alive = "close" not in connection if parts[0] == "HTTP/1.1" else \
        "keep-alive" in connection
    return int(parts[1]), parts[2] if len(parts) > 2 else "", headers, keep_alive


def chunk_size(line: bytes) -> int | None:
    """A chunk-size line's size (extensions after `;` ignored), or None unless it is plain
    hex digits, at most MAX_CHUNK_DIGITS of them."""
    digits = line.split(b";", 1)[0].rstrip(b" \t")
    if not 0 < len(digits) <= MAX_CHUNK_DIGITS or digits.strip(HEX_DIGITS):
        return None
    return int(digits, 16)


class AnswerParser:
    """One answer at a time, fed as its bytes arrive; each piece of the body goes to push
    as soon as it is parsed. Raises EngineConnectionError (BadFraming past a bound) on an
    answer it cannot take; the connection is then done with."""

    __slots__ = (
        "_buffer",
        "_left",
        "_method",
        "_need_crlf",
        "_trailer_bytes",
        "_trailers",
        "framing",
        "head",
        "keep_alive",
        "push",
        "state",
    )

    def __init__(self, push: Callable[[bytes], None]) -> None:
        self.push = push
        self.state = DONE
        self.framing = LENGTH
        self.head: Head | None = None
        self.keep_alive = True        # the connection may carry another request after it
        self._method = "GET"
        self._buffer = b""            # bytes of a head or chunk framing not yet parsed
        self._left = 0                # body bytes (LENGTH) or chunk bytes (CHUNKED) to come
        self._need_crlf = False       # after a chunk's data
        self._trailers = False        # after the last chunk
        self._trailer_bytes = 0

    def begin(self, method: str) -> None:
        """The answer to a request with this method comes next."""
        self.state = HEAD
        self.head = None
        self.keep_alive = True
        self._method = method
        self._buffer = b""
        self._left = 0
        self._need_crlf = self._trailers = False
        self._trailer_bytes = 0

    def feed(self, data: bytes) -> None:
        if self.state == HEAD:
            data = self._parse_head(data)
        if self.state == BODY and data:
            if self.framing == CHUNKED:
                self._parse_chunks(data)
            elif self.framing == LENGTH:
                self._take_length(data)
            else:
                self.push(data)
        elif self.state == DONE and data:
            raise EngineConnectionError("the engine sent bytes after its answer")

    def closed(self) -> bool:
        """The connection closed: whether the answer is whole (one framed by the close is
        whole now)."""
        if self.state == BODY and self.framing == UNTIL_CLOSE:
            self.state = DONE
        return self.state == DONE

    def at_chunk_start(self) -> bool:
        """A chunked body's parser is between chunks, with nothing held back."""
        return (self.state == BODY and self.framing == CHUNKED and not self._left
                and not self._buffer and not self._need_crlf and not self._trailers)

    def whole_chunk(self, data: bytes) -> int:
        """The data's size if data is exactly one whole chunk, framing and all, with its
        size written plainly (lowercase hex, no extension: as llama-server writes them),
        arriving between chunks; else 0. Such a read may go on as it came (the relay's
        fast path); the parser is between chunks again after it."""
        if not self.at_chunk_start():
            return 0
        eol = data.find(b"\r\n", 0, MAX_CHUNK_LINE)
        if eol <= 0:
            return 0
        line = data[:eol]
        try:
            size = int(line, 16)
        except ValueError:   # an extension, or bad: feed() says which
            return 0
        if size > 0 and len(data) == eol + size + 4 and data.endswith(b"\r\n") \
                and b"%x" % size == line:
            return size
        return 0

    def _parse_head(self, data: bytes) -> bytes:
        """Consume the head (skipping 1xx answers); returns the bytes after it."""
        data = self._buffer + data if self._buffer else data
        while True:
            end = data.find(b"\r\n\r\n")
            if end == -1:
                if len(data) > MAX_HEAD:
                    raise BadFraming(f"the engine's answer head is over {MAX_HEAD} bytes")
                self._buffer = data
                return b""
            head, data = data[:end], data[end + 4:]
            status, reason, headers, keep_alive = parse_head(head)
            if 100 <= status < 200:
                continue        # 100 Continue and friends: the real answer follows
            self._buffer = b""
            self.keep_alive = keep_alive
            self.head = (status, reason, headers)
            self.state = BODY
            if self._method == "HEAD" or status in NO_BODY_STATUSES:
                self.state = DONE
            elif "chunked" in headers.get("Transfer-Encoding", "").lower():
                self.framing = CHUNKED
                self._left = 0
                self._trailer_bytes = 0
            elif (length := headers.get("Content-Length")) is not None:
                if not length.isascii() or not length.strip().isdigit():
                    raise BadFraming(f"bad Content-Length {length[:40]!r}")
                self.framing = LENGTH
                self._left = int(length)
                if self._left == 0:
                    self.state = DONE
            else:
                self.framing = UNTIL_CLOSE
                self.keep_alive = False
            return data

    def _take_length(self, data: bytes) -> None:
        if len(data) > self._left:
            raise EngineConnectionError("the engine sent more than its Content-Length")
        self._left -= len(data)
        self.push(data)
        if self._left == 0:
            self.state = DONE

    def _parse_chunks(self, data: bytes) -> None:
        if self._buffer:
            data = self._buffer + data
            self._buffer = b""
        pos, end = 0, len(data)
        while pos < end:
            if self._left:
                take = min(self._left, end - pos)
                self.push(data if take == end else data[pos:pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    self._need_crlf = True
                continue
            if self._need_crlf:
                if end - pos < 2:
                    self._buffer = data[pos:]
                    return
                if data[pos:pos + 2] != b"\r\n":
                    raise EngineConnectionError("bad chunked encoding from the engine")
                pos += 2
                self._need_crlf = False
                continue
            eol = data.find(b"\r\n", pos)
            if eol == -1:
                if end - pos > MAX_CHUNK_LINE:
                    raise BadFraming("bad chunked encoding from the engine: a chunk line "
                                     f"over {MAX_CHUNK_LINE} bytes")
                self._buffer = data[pos:]
                return
            line, pos = data[pos:eol], eol + 2
            if self._trailers:
                if not line:            # the blank line after the last chunk (and trailers)
                    self.state = DONE
                    if pos < end:
                        raise EngineConnectionError("the engine sent bytes after its answer")
                    return
                # dropped, but not without end: an engine writing trailers for ever
                self._trailer_bytes += len(line) + 2
                if self._trailer_bytes > MAX_HEAD:
                    raise BadFraming(f"the engine's trailers are over {MAX_HEAD} bytes")
                continue
            size = chunk_size(line)
            if size is None:
                raise BadFraming("bad chunked encoding from the engine: chunk size "
                                 f"{line[:40]!r} is not up to 15 hex digits")
            if size == 0:
                self._trailers = True
            else:
                self._left = size
