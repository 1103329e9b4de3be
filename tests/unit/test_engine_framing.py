"""The one parser of engines' answers (adapters/engine_wire/framing.py), on its own: no
socket, so every way an answer can be cut into reads is tried, and hostile bytes are fed
to it until it either reads an answer or refuses it — never hangs, never raises anything
else, never holds more than its bounds."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.adapters.engine_wire.errors import BadFraming, EngineConnectionError
from gatewayd.adapters.engine_wire.framing import (
    DONE,
    MAX_CHUNK_LINE,
    MAX_HEAD,
    AnswerParser,
    parse_head,
    request_head,
)


def read(pieces: list[bytes], method: str = "GET", *, closed: bool = True
         ) -> tuple[int, bytes, bool]:
    """(status, body, keep-alive) of an answer fed in these pieces; EngineConnectionError
    if refused or cut short."""
    parts: list[bytes] = []
    parser = AnswerParser(parts.append)
    parser.begin(method)
    for piece in pieces:
        parser.feed(piece)
    if (closed and not parser.closed()) or parser.head is None or parser.state != DONE:
        raise EngineConnectionError("the answer ends in the middle")
    return parser.head[0], b"".join(parts), parser.keep_alive


def cut(data: bytes, at: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(i % (len(data) + 1) for i in at)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = [], 0
    for size in sizes:
        piece = body[at:at + size]
        if piece:
            out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        at += size
    if at < len(body):
        out.append(b"%x\r\n%s\r\n" % (len(body) - at, body[at:]))
    return b"".join(out) + b"0\r\n\r\n"


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=300), framing=st.sampled_from(["length", "chunked", "close"]),
       sizes=st.lists(st.integers(1, 40), max_size=8),
       at=st.lists(st.integers(0, 10_000), max_size=12), interim=st.booleans())
def test_an_answer_reads_the_same_however_it_is_cut_into_reads(
        body: bytes, framing: str, sizes: list[int], at: list[int], interim: bool) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
    if framing == "length":
        answer = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    elif framing == "chunked":
        answer = head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body, sizes)
    else:
        answer = head + b"\r\n" + body
    if interim:   # a 100 Continue first: skipped
        answer = b"HTTP/1.1 100 Continue\r\n\r\n" + answer
    status, got, keep_alive = read(cut(answer, at), closed=framing == "close")
    assert (status, got) == (200, body)
    assert keep_alive is (framing != "close")


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), at=st.lists(st.integers(0, 1000), max_size=6),
       prefix=st.sampled_from([b"", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                               b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"]))
def test_hostile_bytes_are_read_or_refused_never_anything_else(
        data: bytes, at: list[int], prefix: bytes) -> None:
    with contextlib.suppress(EngineConnectionError):
        read(cut(prefix + data, at))


@pytest.mark.parametrize("size", [b"-6", b"-5", b"-0", b"+5", b"0x5", b"5_0", b" 5", b"",
                                  b"g", b"1" * 16, b"5\x00"])
def test_a_chunk_size_that_is_not_plain_hex_is_refused_as_framing(size: bytes) -> None:
    with pytest.raises(BadFraming, match="hex digits"):
        read([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size
              + b"\r\nhello\r\n0\r\n\r\n"])


def test_what_it_holds_before_passing_on_is_bounded() -> None:
    parser = AnswerParser(lambda data: None)
    parser.begin("GET")
    with pytest.raises(BadFraming, match="head is over"):
        for _ in range(MAX_HEAD // 1000 + 2):
            parser.feed(b"X-Long: " + b"a" * 990 + b"\r\n")
    parser.begin("GET")
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(BadFraming, match="chunk line over"):
        parser.feed(b"5" * (MAX_CHUNK_LINE + 10))
    parser.begin("GET")
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n")
    with pytest.raises(BadFraming, match="trailers are over"):
        for _ in range(MAX_HEAD // 1000 + 2):
            parser.feed(b"X-Trailer: " + b"t" * 990 + b"\r\n")


def test_no_body_where_http_says_none_and_nothing_after_the_answer() -> None:
    assert read([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"], "HEAD") == (200, b"", True)
    assert read([b"HTTP/1.1 204 No Content\r\n\r\n"]) == (204, b"", True)
    assert read([b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"])[2] is False  # 1.0: closes
    with pytest.raises(EngineConnectionError, match="after its answer"):
        read([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"EXTRA"])
    with pytest.raises(EngineConnectionError, match="more than its Content-Length"):
        read([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA"])
    with pytest.raises(BadFraming, match="Content-Length"):
        read([b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"])


def test_status_line_parsing() -> None:
    assert parse_head(b"HTTP/1.1 200 OK")[0] == 200
    assert parse_head(b"HTTP/1.0 503")[:2] == (503, "")
    for bad in (b"", b"HTTP/1.1 2000 OK", b"HTTP/2 200", b"SSH-2.0-OpenSSH", b"HTTP/1.1 \xb200 X"):
        with pytest.raises(BadFraming):
            parse_head(bad)
    with pytest.raises(BadFraming, match="header line"):
        parse_head(b"HTTP/1.1 200 OK\r\nno colon here")


def test_a_whole_chunk_is_offered_only_between_chunks_and_only_written_plainly() -> None:
    parser = AnswerParser(lambda data: None)
    parser.begin("GET")
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    event = b"data: {}\n\n"
    assert parser.whole_chunk(b"%x\r\n%s\r\n" % (len(event), event)) == len(event)
    assert parser.whole_chunk(b"%X\r\n%s\r\n" % (len(event), event)) == 0     # (10 is "a")
    assert parser.whole_chunk(b"%x;e=1\r\n%s\r\n" % (len(event), event)) == 0
    assert parser.whole_chunk(b"%x\r\n%s" % (len(event), event)) == 0        # not whole
    parser.feed(b"%x\r\ndata" % len(event))                                     # mid-chunk
    assert parser.whole_chunk(b"%x\r\n%s\r\n" % (len(event), event)) == 0


def test_a_request_head_carries_no_line_break_a_header_could_smuggle() -> None:
    head = request_head("POST", "/v1/x", [("A", "1"), ("B", "2\r\nX-Evil: 1")], 3,
                        body_expected=True)
    assert head == b"POST /v1/x HTTP/1.1\r\nHost: engine\r\nA: 1\r\nContent-Length: 3\r\n\r\n"
