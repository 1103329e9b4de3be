"""The SSE relay: every format's stream ends with its own event."""

from __future__ import annotations

import pytest

from gatewayd.http.sse import SseRelay

OPENAI = [b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n', b"data: [DONE]\n\n"]
RESPONSES = [
    b'event: response.created\ndata: {"type":"response.created"}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"delta":"hi"}\n\n',
    b'event: response.completed\ndata: {"type":"response.completed","response":'
    b'{"usage":{"input_tokens":3,"output_tokens":1}}}\n\n']
ANTHROPIC = [
    b'event: message_start\ndata: {"type":"message_start"}\n\n',
    b'event: ping\ndata: {"type": "ping"}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":'
    b'{"type":"text_delta","text":"hi"}}\n\n',
    b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":1}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n']


def relay(chunks: list[bytes]) -> tuple[bytes, SseRelay]:
    sse = SseRelay(drop_usage_event=False)
    out = b"".join(sse.feed(c) for c in chunks) + sse.flush()
    return out, sse


@pytest.mark.parametrize("stream", [OPENAI, RESPONSES, ANTHROPIC],
                         ids=["openai", "responses", "anthropic"])
def test_each_format_ends_with_its_own_event(stream: list[bytes]) -> None:
    out, sse = relay(stream)
    assert out == b"".join(stream) and sse.ended             # passed on as is, and whole
    out, sse = relay(stream[:-1])
    assert not sse.ended                                       # cut short: the engine died


def test_the_end_is_found_in_an_unterminated_last_event_too() -> None:
    _, sse = relay([*RESPONSES[:-1], RESPONSES[-1].rstrip(b"\n")])
    assert sse.ended
