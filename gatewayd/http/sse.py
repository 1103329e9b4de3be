"""Server-sent events passing through the gateway. Pure: bytes in, bytes out.

The relay forwards every complete event as soon as it has it (the engine writes
one event per token, so nothing waits), and on the way:
- reads the usage from the events that carry it, for the record: `usage` of
  the final chunk (OpenAI), `response.usage` of response.completed (Responses),
  `message.usage` of message_start and `usage` of message_delta (Anthropic);
- counts content events, so a stream cut short still has a token estimate;
- drops the usage-only event (`"choices": []`) when the gateway asked for it
  on the client's behalf (stream_options.include_usage), so the client sees
  exactly the stream it asked for.
Only events that mention "usage" are parsed as JSON: a few per stream.
Lines may end in CRLF or CR as well as LF (the SSE spec allows all three; some servers
and proxies send "\r\n\r\n" between events): they are passed on ending in LF, the
same events, so that one rule (an event ends at "\n\n") finds them all.
Whether a stream ended properly is read from its last events only (no cost per
token): each format has its own end — `data: [DONE]` (OpenAI chat/completions),
`event: response.completed` / `.failed` / `.incomplete` (the Responses API),
`event: message_stop` (Anthropic messages).
Events the gateway writes itself (the admin event feed, an error that ends a
stream) are framed by `sse_event` and sent with `SSE_HEADERS`; an error that
ends a relayed stream is written in that stream's own format (`error_event`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

from gatewayd.core.config import GatewayConfig
from gatewayd.core.errors import EventTooLarge, GatewayError
from gatewayd.core.routing import speaks_anthropic

DONE = b"data: [DONE]"
END_MARKERS = (DONE, b"event: response.completed", b"event: response.failed",
               b"event: response.incomplete", b"event: message_stop",
               b'"type":"message_stop"', b'"type": "message_stop"',
               # llama-server's own /completion(s): no [DONE], its last event says stop
               b'"stop":true')
# headers of every event stream the gateway sends; X-Accel-Buffering: no keeps nginx
# from holding events back
SSE_HEADERS: Mapping[str, str] = {
    "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class StreamFormat(enum.Enum):
    OPENAI = "openai"          # chat/completions: data-only events, `data: [DONE]` last
    RESPONSES = "responses"    # typed events; response.completed / .failed / .incomplete
    ANTHROPIC = "anthropic"    # message_start … message_stop, ping, error


def stream_format(path: str) -> StreamFormat:
    if speaks_anthropic(path):
        return StreamFormat.ANTHROPIC
    if path.startswith(("/v1/responses", "/responses")):
        return StreamFormat.RESPONSES
    return StreamFormat.OPENAI


def error_event(fmt: StreamFormat, error: GatewayError) -> bytes:
    """The event that ends a stream with error, in the stream's format. The SDKs raise on
    each: openai on a data object with an `error` member, anthropic on `event: error`."""
    if fmt is StreamFormat.ANTHROPIC:
        return b"event: error\ndata: " + json.dumps(error.anthropic_body()).encode() + b"\n\n"
    if fmt is StreamFormat.RESPONSES:   # the Responses API's own `error` event, plus the
        body = {"type": "error", "code": error.code, "message": error.message,  # envelope
                "param": error.param, "error": error.body()["error"]}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    return sse_event(error.body())


def token_counts(usage: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens of a usage object in any dialect: OpenAI's
    prompt_/completion_tokens or the Responses and Anthropic input_/output_tokens."""
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    return _int(prompt), _int(completion)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class SseRelay:
    def __init__(self, *, drop_usage_event: bool,
                 max_event_bytes: int = GatewayConfig.max_event_bytes) -> None:
        self.drop_usage_event = drop_usage_event
        self.usage: dict[str, Any] | None = None
        self.content_events = 0
        self.max_event_bytes = max_event_bytes
        # an incomplete event's pieces, joined once when its end comes: joined at every
        # read, an upstream that never ends an event cost a copy of all of it per read
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._last = b""     # the last complete events passed on: where a stream's end is
        self._cr = False     # the last read ended in CR: the next may begin with its LF

    def feed(self, chunk: bytes) -> bytes:
        """Upstream bytes → the bytes to send the client now (complete events only).
        Raises EventTooLarge when an event goes past max_event_bytes without its end."""
        if self._cr or b"\r" in chunk:
            chunk = self._lf(chunk)
            if not chunk:
                return b""
        pending = self._pending
        if pending:
            self._check()
            if b"\n\n" not in chunk and not (chunk[:1] == b"\n" and pending[-1][-1:] == b"\n"):
                self._hold(chunk)    # still no end (nor one split between two reads)
                self._check()
                return b""
            data = b"".join(pending) + chunk
            pending.clear()
            self._pending_size = 0
        else:
            data = chunk
        end = data.rfind(b"\n\n")
        if end == -1:
            self._hold(data)
            self._check()
            return b""
        if end + 2 < len(data):
            self._hold(data[end + 2:])   # (checked at the next read: these events go first)
        complete = data[:end + 2]
        self._last = complete
        if b'"usage"' not in complete:
            # the common case, whether or not a usage event is to be dropped (only an event
            # that names usage can be one): forward as is
            self._count(complete)
            return complete
        kept = [event for event in complete.split(b"\n\n")[:-1] if self._keep(event)]
        return b"".join(event + b"\n\n" for event in kept)

    def take_framed(self, data: bytes, tail: int) -> bool:
        """Instead of feed(), for events in transport framing (an HTTP chunk) that the
        client is to get framed the same way; tail: the framing's bytes after the events.
        True if they may go exactly as they are, and they then count as passed on; False,
        with nothing changed, if they must go through feed: something is pending, they
        name usage, or they end in the middle of an event."""
        if self._pending or self._cr or b'"usage"' in data \
                or not data.endswith(b"\n\n", 0, len(data) - tail):
            return False
        self._last = data
        self._count(data)
        return True

    def _lf(self, chunk: bytes) -> bytes:
        """chunk with its CRLF and CR line ends as LF; a CR that ends it is held back (the
        next read's first byte says whether it was half of a CRLF)."""
        if self._cr:
            chunk = b"\r" + chunk
        self._cr = chunk.endswith(b"\r")
        if self._cr:
            chunk = chunk[:-1]
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _hold(self, piece: bytes) -> None:
        self._pending.append(piece)
        self._pending_size += len(piece)

    def _check(self) -> None:
        if self._pending_size > self.max_event_bytes:
            self._pending.clear()   # (never sent: the stream ends here)
            self._pending_size = 0
            raise EventTooLarge(f"an event of the stream went past {self.max_event_bytes} "
                                "bytes without its end (max_event_mb): the stream ends here")

    def flush(self) -> bytes:
        """Whatever is left when the upstream ends (an unterminated last event)."""
        if self._cr:   # the stream's last byte ended a line
            self._cr = False
            self._hold(b"\n")
        self._check()
        rest = b"".join(self._pending)
        self._pending.clear()
        self._pending_size = 0
        if rest:
            self._last += rest
            if self._keep(rest.rstrip(b"\n")):
                return rest
        return b""

    @property
    def ended(self) -> bool:
        """The stream's own end event came (call after flush): anything else means the
        engine stopped in the middle."""
        return any(marker in self._last for marker in END_MARKERS)

    def _count(self, events: bytes) -> None:
        self.content_events += events.count(b"data: {")

    def _keep(self, event: bytes) -> bool:
        if event.startswith(DONE):
            return True
        if b'"usage"' not in event:
            self._count(event)
            return True
        payload = _data_json(event)
        usage = _usage_in(payload) if payload is not None else None
        if usage is not None:
            # Anthropic splits it: input in message_start, output in message_delta
            self.usage = {**self.usage, **usage} if self.usage else usage
            if payload is not None and payload.get("choices") == []:  # usage-only chunk
                return not self.drop_usage_event
        self._count(event)
        return True


def _usage_in(payload: dict[str, Any]) -> dict[str, Any] | None:
    usage = payload.get("usage")
    if isinstance(usage, dict):             # OpenAI's final chunk, Anthropic message_delta
        return usage
    for outer in ("response", "message"):   # response.completed, Anthropic message_start
        inner = payload.get(outer)
        if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
            return inner["usage"]  # type: ignore[no-any-return]
    return None


def _data_json(event: bytes) -> dict[str, Any] | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                value = json.loads(line[5:])
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying payload as JSON."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
