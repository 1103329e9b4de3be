"""aiohttp's request parser, as the gateway serves with it: one that tells the body being
read when it refuses bytes part-way through that body.

aiohttp's C parser (llhttp, the one it uses unless AIOHTTP_NO_EXTENSIONS) refuses a chunked
body's trailer section that holds Content-Length or Transfer-Encoding (RFC 9110 6.5.1), or a
broken chunk size after the first chunk, only when those bytes arrive. Where they arrive in
a later read than the request's head, its handler is already waiting for the body: the
parser queues its own 400 behind that handler and drops the body without ending it, so the
handler waits, and the connection with it, until the client leaves (aiohttp 3.14.5,
`_http_parser.pyx` `HttpParser.feed_data`; its Python parser and its C parser's own body
callback do tell the body, with `RequestPayloadError`). Here the parser does the same for
every refusal: the handler's read raises `RequestPayloadError`, the error middleware answers
400 `bad_framing` and closes the connection, and the refusal aiohttp queued is never sent.

aiohttp has no hook for its server's parser: `use()` puts this one in `web_protocol`'s
namespace, where `RequestHandler` finds its parser class, and refuses to start if that name
is not aiohttp's parser any more (pinned: constraints.txt; shown: tests/http/test_fuzz.py).
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web_protocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParser, RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestPayloadError

Messages = tuple[list[tuple[RawRequestMessage, StreamReader]], bool, bytes]


class BodyTellingParser(HttpRequestParser):
    """aiohttp's request parser (its C one where built, else its Python one), and the body
    of the last request it handed over is told when bytes are refused before that body
    ended."""

    _open_body: StreamReader | None = None

    def feed_data(self, data: bytes, *args: Any, **kwargs: Any) -> Messages:
        try:
            messages, upgraded, tail = super().feed_data(data, *args, **kwargs)
        except HttpProcessingError as e:
            body, self._open_body = self._open_body, None
            if body is not None and not body.is_eof() and body.exception() is None:
                refusal = RequestPayloadError(str(e))
                refusal.__cause__ = e
                body.set_exception(refusal)
            raise
        if messages:
            # (a message comes out once its head is read: those before it in this read
            # ended, or it could not have begun)
            self._open_body = messages[-1][1]
        return messages, upgraded, tail


def use() -> None:
    """aiohttp's server makes its connections' parsers with BodyTellingParser from now
    on (this process, every app). Raises RuntimeError where aiohttp's server no longer
    makes them as this knows."""
    made = getattr(web_protocol, "HttpRequestParser", None)
    if made is BodyTellingParser:
        return
    if made is not HttpRequestParser:
        raise RuntimeError(
            "aiohttp.web_protocol no longer makes its parser from aiohttp.http_parser's "
            f"HttpRequestParser (found {made!r}): gatewayd/http/request_parser.py needs "
            "a look for this aiohttp version")
    web_protocol.HttpRequestParser = BodyTellingParser  # type: ignore[attr-defined]


def refusal_reason(error: RequestPayloadError) -> str:
    """The parser's words for a body it refused part-way (their first line: what follows
    quotes the client's bytes): "Invalid character in chunk size", "Can not decode
    content-encoding: gzip"."""
    cause = error.__cause__
    words = cause.message if isinstance(cause, HttpProcessingError) else str(error)
    lines = [line.strip().rstrip(":") for line in str(words).splitlines() if line.strip()]
    if lines and re.fullmatch(r"\d{3}, message", lines[0]):   # str() of aiohttp's error
        del lines[0]
    return lines[0] if lines else "malformed"
