"""Server-sent events passing through the gateway. Pure: bytes in, bytes out.

The relay forwards every complete event as soon as it has it (the engine writes
one event per token, so nothing waits), and on the way:
- reads `usage` from the event that carries it (the final one), for the record;
- counts content events, so a stream cut short still has a token estimate;
- drops the usage-only event (`"choices": []`) when the gateway asked for it
  on the client's behalf (stream_options.include_usage), so the client sees
  exactly the stream it asked for.
Only events that mention "usage" are parsed as JSON: a few per stream.
Whether a stream ended properly is read from its last events only (no cost per
token): each format has its own end — `data: [DONE]` (OpenAI chat/completions),
`event: response.completed` / `.failed` / `.incomplete` (the Responses API),
`event: message_stop` (Anthropic messages).
Events the gateway writes itself (the admin event feed, an error that ends a
stream) are framed by `sse_event` and sent with `SSE_HEADERS`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

DONE = b"data: [DONE]"
END_MARKERS = (DONE, b"event: response.completed", b"event: response.failed",
               b"event: response.incomplete", b"event: message_stop",
               b'"type":"message_stop"', b'"type": "message_stop"')
# headers of every event stream the gateway sends; X-Accel-Buffering: no keeps nginx
# from holding events back
SSE_HEADERS: Mapping[str, str] = {
    "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SseRelay:
    def __init__(self, *, drop_usage_event: bool) -> None:
        self.drop_usage_event = drop_usage_event
        self.usage: dict[str, Any] | None = None
        self.content_events = 0
        self._pending = b""
        self._last = b""     # the last complete events passed on: where a stream's end is

    def feed(self, chunk: bytes) -> bytes:
        """Upstream bytes → the bytes to send the client now (complete events only)."""
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        if end == -1:
            self._pending = data
            return b""
        self._pending = data[end + 2:]
        complete = data[:end + 2]
        self._last = complete
        if b'"usage"' not in complete and not self.drop_usage_event:
            self._count(complete)
            return complete  # the common case: forward as is
        kept = [event for event in complete.split(b"\n\n")[:-1] if self._keep(event)]
        return b"".join(event + b"\n\n" for event in kept)

    def flush(self) -> bytes:
        """Whatever is left when the upstream ends (an unterminated last event)."""
        rest, self._pending = self._pending, b""
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
        if payload is not None and isinstance(payload.get("usage"), dict):
            self.usage = payload["usage"]
            if not payload.get("choices"):           # a usage-only event
                return not self.drop_usage_event
        self._count(event)
        return True


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
