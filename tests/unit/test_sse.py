"""The SSE relay: every format's stream ends with its own event, its usage is read
for the record, and an error that ends it is written in its own format."""

from __future__ import annotations

import json
import time

import pytest

from gatewayd.core.errors import EngineFailed, EventTooLarge
from gatewayd.http.sse import (
    SseRelay,
    StreamFormat,
    error_event,
    stream_format,
    token_counts,
)

OPENAI = [b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n', b"data: [DONE]\n\n"]
RESPONSES = [
    b'event: response.created\ndata: {"type":"response.created"}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"delta":"hi"}\n\n',
    b'event: response.completed\ndata: {"type":"response.completed","response":'
    b'{"usage":{"input_tokens":3,"output_tokens":1}}}\n\n']
ANTHROPIC = [
    b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
    b'{"input_tokens":7,"output_tokens":0}}}\n\n',
    b'event: ping\ndata: {"type": "ping"}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":'
    b'{"type":"text_delta","text":"hi"}}\n\n',
    b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":1}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n']

# llama-server's own /completion and /completions: no [DONE]; the last event says stop
# (its shape as llama-server b11434 sends it)
LLAMA = [b'data: {"index":0,"content":"hi","tokens":[],"stop":false,"id_slot":-1}\n\n',
         b'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,'
         b'"model":"tiny","stop_type":"limit","timings":{}}\n\n']


def relay(chunks: list[bytes]) -> tuple[bytes, SseRelay]:
    sse = SseRelay(drop_usage_event=False)
    out = b"".join(sse.feed(c) for c in chunks) + sse.flush()
    return out, sse


@pytest.mark.parametrize("stream", [OPENAI, RESPONSES, ANTHROPIC, LLAMA],
                         ids=["openai", "responses", "anthropic", "llama"])
def test_each_format_ends_with_its_own_event(stream: list[bytes]) -> None:
    out, sse = relay(stream)
    assert out == b"".join(stream) and sse.ended             # passed on as is, and whole
    out, sse = relay(stream[:-1])
    assert not sse.ended                                       # cut short: the engine died


def test_the_end_is_found_in_an_unterminated_last_event_too() -> None:
    _, sse = relay([*RESPONSES[:-1], RESPONSES[-1].rstrip(b"\n")])
    assert sse.ended


@pytest.mark.parametrize(("stream", "counts"), [
    ([b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n',
      b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n',
      b"data: [DONE]\n\n"], (5, 2)),
    (RESPONSES, (3, 1)),
    (ANTHROPIC, (7, 1)),      # input from message_start, output from message_delta
], ids=["openai", "responses", "anthropic"])
def test_usage_is_read_in_every_format(stream: list[bytes],
                                       counts: tuple[int, int]) -> None:
    _, sse = relay(stream)
    assert sse.usage is not None and token_counts(sse.usage) == counts


def test_only_the_usage_only_chunk_is_dropped() -> None:
    sse = SseRelay(drop_usage_event=True)
    usage_only = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
    assert sse.feed(usage_only) == b""
    # a Responses event carries usage but is no usage-only chunk: never dropped
    assert sse.feed(RESPONSES[-1]) == RESPONSES[-1]


def _payload(event: bytes) -> tuple[str | None, dict[str, object]]:
    name, data = None, {}
    for line in event.decode().strip().split("\n"):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
    return name, data


def test_an_error_ends_each_stream_in_its_own_format() -> None:
    assert stream_format("/v1/chat/completions") is StreamFormat.OPENAI
    assert stream_format("/v1/responses") is StreamFormat.RESPONSES
    assert stream_format("/v1/messages") is StreamFormat.ANTHROPIC
    error = EngineFailed("the engine stopped")
    name, data = _payload(error_event(StreamFormat.OPENAI, error))
    assert name is None and data["error"]["code"] == "engine_failed"  # type: ignore[index]
    name, data = _payload(error_event(StreamFormat.RESPONSES, error))
    assert name == "error" and data["type"] == "error" and data["code"] == "engine_failed"
    assert data["message"] == "the engine stopped" and "error" in data  # the SDK raises on it
    name, data = _payload(error_event(StreamFormat.ANTHROPIC, error))
    assert name == "error" and data["type"] == "error"
    assert data["error"] == {"type": "api_error", "message": "the engine stopped",
                             "code": "engine_failed", "source": "gateway"}   # ours


def test_events_without_usage_pass_as_the_very_bytes_read_even_when_usage_is_dropped(
        ) -> None:
    """The hot path of a stream: a chunk that does not name usage is forwarded as it came
    (no split, no re-join, no JSON), also when the gateway hides a usage event it asked for."""
    for drop in (False, True):
        sse = SseRelay(drop_usage_event=drop)
        chunk = b'data: {"choices":[{"delta":{"content":" w"}}]}\n\n' * 2
        assert sse.feed(chunk) is chunk
        assert sse.content_events == 2


def test_framed_events_pass_as_they_are_only_when_feed_would_pass_them_unchanged() -> None:
    """take_framed: whole events in a chunk's framing go on as they are (counted, and the
    stream's end seen in them); anything feed() would change or hold back is refused,
    with nothing changed, so that feed() gets it."""
    event = b'data: {"choices":[{"delta":{"content":" w"}}]}\n\n'
    sse = SseRelay(drop_usage_event=True)
    framed = b"%x\r\n%b\r\n" % (len(event), event)
    assert sse.take_framed(framed, 2) is True
    assert sse.content_events == 1 and not sse.ended
    usage = b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
    assert sse.take_framed(b"%x\r\n%b\r\n" % (len(usage), usage), 2) is False  # feed drops it
    half = b"%x\r\n%b\r\n" % (10, event[:10])
    assert sse.take_framed(half, 2) is False                    # ends mid-event
    assert sse.feed(event[:10]) == b""                           # now something is pending
    assert sse.take_framed(framed, 2) is False
    assert sse.feed(event[10:]) == event
    assert sse.content_events == 2
    done = b"data: [DONE]\n\n"
    assert sse.take_framed(b"%x\r\n%b\r\n" % (len(done), done), 2) is True
    assert sse.flush() == b"" and sse.ended


def test_an_event_past_its_bound_without_its_end_is_refused() -> None:
    """An upstream that never ends an event (no blank line) was held whole: the relay
    refuses it past max_event_bytes; the events before it went on."""
    relay = SseRelay(drop_usage_event=False, max_event_bytes=1000)
    assert relay.feed(OPENAI[0] + b"data: " + b"x" * 500) == OPENAI[0]
    assert relay.feed(b"x" * 400) == b""
    with pytest.raises(EventTooLarge, match="past 1000 bytes"):
        relay.feed(b"x" * 200)
    with pytest.raises(EventTooLarge):   # in one read, and with events before it
        SseRelay(drop_usage_event=False, max_event_bytes=1000).feed(b"data: " + b"x" * 1001)
    relay = SseRelay(drop_usage_event=False, max_event_bytes=1000)
    assert relay.feed(OPENAI[0] + b"x" * 2000) == OPENAI[0]
    with pytest.raises(EventTooLarge):
        relay.flush()
    relay = SseRelay(drop_usage_event=False, max_event_bytes=1000)   # up to it: whole
    event = b"data: " + b"x" * 992 + b"\n\n"
    assert relay.feed(event[:500]) == b"" and relay.feed(event[500:-1]) == b""
    assert relay.feed(event[-1:]) == event


def test_an_event_held_in_many_reads_is_joined_once_not_per_read() -> None:
    """Joined at every read, 4 MB in 16-byte reads is ~250000 copies of up to 4 MB
    (minutes); joined once at its end, well under a second."""
    relay = SseRelay(drop_usage_event=False, max_event_bytes=8 << 20)
    piece = b"y" * 16
    started = time.monotonic()
    assert relay.feed(b"data: ") == b""
    for _ in range(250_000):
        relay.feed(piece)
    assert relay.feed(b"\n\n") == b"data: " + piece * 250_000 + b"\n\n"
    assert time.monotonic() - started < 10
    # an end split between two reads is still found
    assert relay.feed(b"data: 1\n") == b"" and relay.feed(b"\ndata: 2") == b"data: 1\n\n"


@pytest.mark.parametrize("end", [b"response.completed", b"response.failed",
                                 b"response.incomplete"])
def test_a_responses_stream_ends_with_any_of_its_three_final_events(end: bytes) -> None:
    """A Responses stream cut at max_output_tokens ends with response.incomplete, one the
    model failed with response.failed: both are ends, not an engine that died."""
    last = b"event: %s\ndata: {\"type\":\"%s\",\"response\":{}}\n\n" % (end, end)
    out, sse = relay([*RESPONSES[:-1], last])
    assert sse.ended and out.endswith(last)
