"""Relaying a request to an engine over its unix socket (or to a remote upstream), and
the answer back.

The hot path. What it costs is paid per request, so:
- local engines are spoken to by adapters/engine_wire (keep-alive pool per socket, a
  connection of its own for a stream: llama-server closes the connection after every
  SSE answer although it says keep-alive); remote upstreams by their aiohttp session;
  both answer as an `Answer`, so one relay serves both;
- non-streamed answers are read whole and sent as one web.Response (cheaper
  than a StreamResponse);
- streamed answers go through SseRelay event by event, each written (and so
  flushed) the moment it is complete;
- media answers (audio, images, video, octet-stream: MEDIA_TYPES) are passed on
  byte for byte as they arrive, never held whole (speech is played as it comes);
- timeouts: connecting must be quick (a dead socket fails at once), reading
  may take as long as the model needs, up to read_timeout_s between bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict

from gatewayd.adapters.answer import Answer
from gatewayd.adapters.engine_wire.client import EngineClient, EngineResponse
from gatewayd.adapters.engine_wire.errors import AnswerTooLarge as EngineAnswerTooLarge
from gatewayd.adapters.engine_wire.errors import (
    ConnectionsBusy,
    ConnectionsQueueFull,
    EngineConnectionError,
)
from gatewayd.adapters.records import CallRecord
from gatewayd.adapters.remote_client import REMOTE_ERRORS, AnswerPastLimit
from gatewayd.core.config import GatewayConfig
from gatewayd.core.errors import (
    ERROR_SOURCE_HEADER,
    AnswerTooLarge,
    EngineBusy,
    EngineFailed,
    EngineUnavailable,
    ErrorSource,
    EventTooLarge,
    GatewayError,
    InvalidRequest,
    QueueFull,
    UpstreamFailed,
    UpstreamTimeout,
    UpstreamUnavailable,
    anthropic_error_body,
)
from gatewayd.core.routing import speaks_anthropic
from gatewayd.http.middleware import SHUTDOWN, shutdown_error
from gatewayd.http.sse import SSE_HEADERS, SseRelay, error_event, stream_format, token_counts

# The headers that cross the gateway, by allow-list. A client's request reaches an
# engine or a third-party upstream with what describes its body and the API version it
# speaks, never its cookies, credentials, OpenAI-Organization/-Project or proxy headers
# (the upstream gets the gateway's own key); framing (length, chunking) is the
# gateway's own on each hop.
REQUEST_HEADERS = frozenset({"content-type", "accept", "user-agent", "openai-beta",
                             "anthropic-version", "anthropic-beta"})
# An answer reaches the client with what describes it and the server's advice, never an
# engine's or upstream's cookies or CORS headers (llama-server allows any origin), nor
# the gateway's own headers (ERROR_SOURCE_HEADER: the relay sets it, an engine cannot).
ANSWER_HEADERS = frozenset({"content-type", "content-language", "retry-after", "x-request-id",
                            "request-id", "openai-processing-ms", "openai-version"})
ANSWER_HEADER_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")

# Answers relayed piece by piece as they arrive, unchanged (speech, an image file): by
# allow-list, so JSON and text (read whole: usage, error codes, whisper's trim) stay so.
MEDIA_TYPES = ("audio/", "image/", "video/", "application/octet-stream")


# what sending a request or reading its answer raises when the other side is not there,
# breaks off or is silent for too long
TRANSPORT_ERRORS = (TimeoutError, EngineConnectionError, *REMOTE_ERRORS, OSError)


@dataclass
class Outgoing:
    """What to send the engine (or a remote upstream), and how."""

    send: Callable[[], Awaitable[Answer]]   # sends it; returns once the answer's head is in
    stream: bool              # the client asked for a stream
    drop_usage_event: bool    # we added include_usage: hide the usage event again
    upstream: str | None = None   # a remote upstream's name (None: a local engine)
    # longest a stream's client may take no bytes while the gateway has some for it; then
    # it is dropped and what it held (the engine) let go
    stall_timeout_s: float = 600.0
    # what the relay holds of an answer: a whole one (max_answer_mb), one streamed event
    # not yet ended (max_event_mb)
    max_answer_bytes: int = GatewayConfig.max_answer_bytes
    max_event_bytes: int = GatewayConfig.max_event_bytes
    # takes an upstream's credentials out of an error's words (a library's error may
    # quote the URL): UpstreamConfig.redact
    redact: Callable[[str], str] = str
    # a whisper-server answers: its transcription's padding is trimmed
    whisper: bool = False
    # a stream's answer already begun (http/waiting: lines told its client of the wait):
    # its 200 and SSE head are out, the events go on in it, and an answer that is no
    # stream can only be told as the stream's error event
    response: web.StreamResponse | None = None

    @property
    def source(self) -> ErrorSource:
        """Whose an error answer relayed as it was said is (ERROR_SOURCE_HEADER)."""
        return ErrorSource.ENGINE if self.upstream is None else ErrorSource.UPSTREAM

    def unavailable(self, e: BaseException, while_: str = "did not take the request"
                    ) -> GatewayError:
        if self.upstream is None:
            error = EngineUnavailable(f"the engine {while_}: {e}")
            error.reached_no_process = isinstance(e, EngineConnectionError) and e.connect
            return error
        if isinstance(e, TimeoutError):
            return UpstreamTimeout(f"upstream {self.upstream!r} {while_}: no answer in time "
                                   f"({type(e).__name__})", upstream=self.upstream)
        return UpstreamUnavailable(f"upstream {self.upstream!r} {while_}: "
                                   f"{self.redact(str(e) or type(e).__name__)}",
                                   upstream=self.upstream)

    def broke_off(self, e: BaseException) -> GatewayError:
        why = str(e) or type(e).__name__
        if self.upstream is None:
            return EngineFailed(f"the engine stopped in the middle of the answer: {why}")
        return UpstreamFailed(f"upstream {self.upstream!r} stopped in the middle of the "
                              f"answer: {self.redact(why)}", upstream=self.upstream)


def to_engine(client: EngineClient, socket: str, method: str, target: str,
              headers: CIMultiDict[str], body: bytes, *, stream: bool
              ) -> Callable[[], Awaitable[Answer]]:
    """Outgoing.send for a local engine. A stream's connection is its own: llama-server
    closes the connection after every SSE answer although it says keep-alive."""
    return lambda: client.request(socket, method, target, headers.items(), body,
                                  reuse=not stream)


BUSY_RETRY_S = 5   # Retry-After of an engine_busy answer


def request_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """What of a client's request headers an engine or upstream is sent."""
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        if key.lower() in REQUEST_HEADERS:
            out.add(key, value)
    return out


def answer_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """What of an engine's or upstream's answer headers the client is sent."""
    return CIMultiDict((k, v) for k, v in headers.items()
                       if (name := k.lower()) in ANSWER_HEADERS
                       or name.startswith(ANSWER_HEADER_PREFIXES))


async def relay(request: web.Request, out: Outgoing, record: CallRecord,
                t0: float) -> web.StreamResponse:
    try:
        answer = await out.send()
    except ConnectionsQueueFull as e:
        raise QueueFull(f"the engine is busy: {e}; try again", retry_after=BUSY_RETRY_S,
                        model=record.model) from e
    except ConnectionsBusy as e:
        raise EngineBusy(f"the engine is busy: {e}; try again", retry_after=BUSY_RETRY_S,
                         model=record.model) from e
    except TRANSPORT_ERRORS as e:
        raise out.unavailable(e) from e
    try:
        content_type = answer.headers.get("Content-Type", "")
        if content_type.startswith("text/event-stream"):
            return await _relay_stream(request, answer, out, record, t0)
        if out.response is not None:
            raise await _not_a_stream(answer, out)
        if answer.status < 400 and is_media(content_type):
            return await _relay_media(request, answer, out, record)
        try:
            data = await answer.read(out.max_answer_bytes)
        except (AnswerPastLimit, EngineAnswerTooLarge) as e:
            who = "the engine" if out.upstream is None else f"upstream {out.upstream!r}"
            raise AnswerTooLarge(f"{who} answered with more than {out.max_answer_bytes} "
                                 "bytes (max_answer_mb): refused") from e
        except TRANSPORT_ERRORS as e:
            raise out.unavailable(e, "failed while answering") from e
        if answer.status == 200 and out.whisper:
            data = normalise_transcription(data, content_type)
        record.status = answer.status
        record.bytes_out = len(data)
        _usage_from_body(record, data, content_type)
        headers = answer_headers(answer.headers)
        headers.pop("Content-Encoding", None)
        if answer.status >= 400:
            record.outcome = "error"
            record.error_code = _error_code(data)
            record.error_source = out.source.value
            headers[ERROR_SOURCE_HEADER] = out.source.value   # (theirs dropped: ANSWER_HEADERS)
            if speaks_anthropic(request.path):
                data = _as_anthropic_error(data, answer.status)
                headers["Content-Type"] = "application/json"
        return web.Response(body=data, status=answer.status, headers=headers)
    finally:
        answer.release()


async def _relay_stream(request: web.Request, answer: Answer,
                        out: Outgoing, record: CallRecord, t0: float) -> web.StreamResponse:
    record.stream = True
    chunked = request.version >= aiohttp.HttpVersion11
    response = out.response   # begun already (its 200 told the client of a wait), or:
    if response is None:
        record.status = answer.status
        headers = dict(SSE_HEADERS)
        if answer.status >= 400:   # an engine's (upstream's) error, told as a stream
            record.error_source = headers[ERROR_SOURCE_HEADER] = out.source.value
        response = web.StreamResponse(status=answer.status, headers=headers)
        if chunked:
            response.enable_chunked_encoding()   # what relay_pushed frames by hand relies on
    writer = await response.prepare(request)
    sse = SseRelay(drop_usage_event=out.drop_usage_event, max_event_bytes=out.max_event_bytes)
    delivered = False  # the engine's answer ended and all of it was written to the client
    sent = _Sent()
    try:
        try:
            if isinstance(answer, EngineResponse) and writer is not None \
                    and request.method != "HEAD":
                # a local engine's stream: every event pushed from the engine connection's
                # callback, framed by hand after the head (aiohttp's prepare() sent it; this
                # holds if a later aiohttp keeps it for the first write)
                writer.send_headers()
                await _relay_pushed(request, answer, writer, sse, record, chunked,
                                    out.stall_timeout_s, sent, t0)
            else:   # an upstream's (aiohttp's client), or HEAD: pulled
                while chunk := await answer.read_some():
                    data = sse.feed(chunk)
                    if data:
                        if record.ttft_ms is None:
                            record.ttft_ms = (time.monotonic() - t0) * 1000
                        await _write(request, response, data, record, out.stall_timeout_s,
                                     sent)
            tail = sse.flush()
            if tail:
                await _write(request, response, tail, record, out.stall_timeout_s, sent)
            if not sse.ended:
                raise StreamCut("the stream ended without its final event")
            delivered = True
        except (*TRANSPORT_ERRORS, StreamCut, EventTooLarge) as e:
            # The engine died mid-stream, or went past a bound. The status is sent: end
            # with an error event.
            if isinstance(e, EventTooLarge):
                answer.close()   # the rest of the answer is not read
                error: GatewayError = e
                record.outcome = "error"
            else:
                error = out.broke_off(e)
                record.outcome = error.code
            record.error_code = error.code
            record.error_source = ErrorSource.GATEWAY.value   # the event is ours
            event = error_event(stream_format(request.path), error)
            await _write(request, response, event, record, out.stall_timeout_s)
        await _write_eof(request, response, record, out.stall_timeout_s)
    except _ClientGone:
        if not delivered:
            if sent.all_of(sse):
                answer.close()   # delivered; the engine's end still to come: not reused
            else:
                _client_left(record, answer)
    except asyncio.CancelledError:  # aiohttp cancels the handler when the client goes,
        if delivered:               # or when the gateway's drain time has run out
            raise
        if sent.all_of(sse):
            answer.close()
            raise
        if not request.app[SHUTDOWN].expired:
            _client_left(record, answer)
            raise
        # the gateway cancelled us at its drain deadline: the client is still there and
        # is told why its answer ends here (the stream is done, so it is not re-raised)
        answer.close()
        error = shutdown_error()
        record.outcome, record.error_code = "error", error.code
        record.error_source = ErrorSource.GATEWAY.value
        with contextlib.suppress(_ClientGone, ConnectionError):
            event = error_event(stream_format(request.path), error)
            await _write(request, response, event, record, out.stall_timeout_s)
            await _write_eof(request, response, record, out.stall_timeout_s)
    finally:
        _stream_usage(record, sse)
    return response


async def _not_a_stream(answer: Answer, out: Outgoing) -> GatewayError:
    """An answer that is no event stream (an engine's error, as a rule) to a stream whose
    200 is out: the error its event will say, with the engine's (or upstream's) words."""
    try:
        data = await answer.read(out.max_answer_bytes)
    except (AnswerPastLimit, EngineAnswerTooLarge, *TRANSPORT_ERRORS):
        data = b""
    who = "the engine" if out.upstream is None else f"upstream {out.upstream!r}"
    said = json.loads(_as_anthropic_error(data, answer.status))["error"]["message"]
    message = (f"{who} answered {answer.status} instead of a stream: "
               f"{out.redact(said)[:1000]}")
    if 400 <= answer.status < 500:
        return InvalidRequest(message)
    if out.upstream is None:
        return EngineFailed(message)
    return UpstreamFailed(message, upstream=out.upstream)


def is_media(content_type: str) -> bool:
    """An answer relayed as it arrives, byte for byte (MEDIA_TYPES)."""
    return content_type.partition(";")[0].strip().lower().startswith(MEDIA_TYPES)


async def _relay_media(request: web.Request, answer: Answer, out: Outgoing,
                       record: CallRecord) -> web.StreamResponse:
    """A media answer, each piece written to the client as it arrives: nothing is held but
    the piece in hand, so no max_answer_mb applies. Its end cannot be told in-band as a
    stream's is (no error event in audio): an engine that breaks off, or the drain
    deadline, closes the client's connection before the body's end, which a chunked
    body shows (no last chunk). HTTP/1.0 has no chunks: the body ends with the
    connection (middleware.close_unframed)."""
    record.status = answer.status
    response = web.StreamResponse(status=answer.status,
                                  headers=answer_headers(answer.headers))
    if request.version >= aiohttp.HttpVersion11:
        response.enable_chunked_encoding()   # (HTTP/1.0: ended by the close, close_unframed)
    await response.prepare(request)
    try:
        try:
            while chunk := await answer.read_some():
                await _write(request, response, chunk, record, out.stall_timeout_s)
        except TRANSPORT_ERRORS as e:
            error = out.broke_off(e)
            record.outcome = record.error_code = error.code   # as a stream's (_relay_stream)
            record.error_source = ErrorSource.GATEWAY.value   # (told by the cut, no event)
            answer.close()
            _end_unfinished(request, response)
            return response
        await _write_eof(request, response, record, out.stall_timeout_s)
    except _ClientGone:
        _client_left(record, answer)
    except asyncio.CancelledError:   # the client went, or the gateway's drain time ran out
        if not request.app[SHUTDOWN].expired:
            _client_left(record, answer)
            raise
        answer.close()
        error = shutdown_error()
        record.outcome, record.error_code = "error", error.code
        record.error_source = ErrorSource.GATEWAY.value
        _end_unfinished(request, response)   # (done: not re-raised, as _relay_stream)
    return response


def _end_unfinished(request: web.Request, response: web.StreamResponse) -> None:
    """Closes the client's connection after what was written, without the body's end."""
    response.force_close()
    if request.transport is not None:
        request.transport.close()


class StreamCut(Exception):
    """A stream's answer ended (whole as HTTP) without the final event of its format."""


class _ClientGone(Exception):
    pass


class _Sent:
    """Whether a stream's client was sent everything the relay let through. A client may
    close as soon as it has the final event (the OpenAI SDK does, at [DONE], without
    waiting for the chunked body's end): the answer was delivered, not cut short."""

    __slots__ = ("dropped",)

    def __init__(self) -> None:
        self.dropped = False   # events passed by the relay and not written (client gone)

    def all_of(self, sse: SseRelay) -> bool:
        """The stream's final event, and everything before it, went to the client."""
        return not self.dropped and sse.ended


PUSH_HIGH_WATER = 64 * 1024   # bytes unsent to a slow client before the engine is held


async def _relay_pushed(request: web.Request, answer: EngineResponse,
                        writer: AbstractStreamWriter, sse: SseRelay, record: CallRecord,
                        chunked: bool, stall_timeout_s: float, sent: _Sent, t0: float
                        ) -> None:
    """A local engine's stream, each event written to the client from the engine
    connection's data_received (EngineResponse.relay_to): no task wakes up per event, the
    relay's CPU per event is ~a third less. The bytes go straight to the client's
    transport, framed as the chunks aiohttp would write (the response was made chunked
    for it: write_eof then ends it as usual). A client that stops reading holds the engine
    until its buffer drains; one that left ends the engine's answer (_ClientGone)."""
    transport = request.transport
    if transport is None:
        raise _ClientGone()
    feed, write, buffered = sse.feed, transport.write, transport.get_write_buffer_size
    take_framed = sse.take_framed
    gone = False

    def push(piece: bytes) -> None:
        nonlocal gone
        data = feed(piece)
        if not data or gone:
            if data:
                sent.dropped = True
            return
        if transport.is_closing():
            gone = sent.dropped = True
            answer.close()   # the engine stops generating for nobody
            return
        write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
        wrote(len(data))

    def push_chunk(chunk: bytes, size: int) -> bool:
        # the engine's chunk, one event in it as a rule, goes on with its framing as is
        if gone or transport.is_closing() or not take_framed(chunk, 2):
            return False   # push() takes it apart (and sees to a client that left)
        write(chunk)
        wrote(size)
        return True

    def wrote(size: int) -> None:   # events of `size` bytes of data went to the client
        if record.ttft_ms is None:
            record.ttft_ms = (time.monotonic() - t0) * 1000
        record.bytes_out += size
        if buffered() > PUSH_HIGH_WATER:
            answer.hold()

    answer.relay_to(push, push_chunk if chunked else None)
    try:
        while not await answer.wait_end():   # held: let the client catch up
            try:
                await _to_client(writer.drain(), request, record, stall_timeout_s)
            except _ClientGone:
                sent.dropped = True   # what was buffered for it never went out
                raise
            if transport.is_closing():
                raise _ClientGone()
            answer.resume()
    except TRANSPORT_ERRORS as e:
        if gone:
            raise _ClientGone() from None
        if isinstance(e.__cause__, EventTooLarge):   # push's feed refused it: said as such
            raise e.__cause__ from None
        raise
    if gone:
        raise _ClientGone()


def _client_left(record: CallRecord, answer: Answer) -> None:
    record.disconnected = True
    record.outcome = "disconnected"
    answer.close()  # drop the engine connection: it stops generating for nobody


async def _write(request: web.Request, response: web.StreamResponse, data: bytes,
                 record: CallRecord, stall_timeout_s: float, sent: _Sent | None = None
                 ) -> None:
    try:
        await _to_client(response.write(data), request, record, stall_timeout_s)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, _ClientGone) as e:
        if sent is not None:
            sent.dropped = True
        if isinstance(e, _ClientGone):
            raise
        raise _ClientGone() from e
    record.bytes_out += len(data)


async def _write_eof(request: web.Request, response: web.StreamResponse, record: CallRecord,
                     stall_timeout_s: float) -> None:
    await _to_client(response.write_eof(), request, record, stall_timeout_s)


async def _to_client(sending: Awaitable[None], request: web.Request, record: CallRecord,
                     stall_timeout_s: float) -> None:
    """Waits for bytes to go to a stream's client, for at most stall_timeout_s. A client
    that took nothing for that long is cut off, its bytes unsent, so that the engine it
    held serves others; the record says why (_ClientGone)."""
    try:
        async with asyncio.timeout(stall_timeout_s):
            await sending
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        record.error_code = "client_stalled"
        raise _ClientGone() from None


def _stream_usage(record: CallRecord, sse: SseRelay) -> None:
    usage = sse.usage
    if usage is not None:
        record.prompt_tokens, record.completion_tokens = token_counts(usage)
    elif record.completion_tokens is None:
        record.completion_tokens = sse.content_events  # cut short: an estimate


def _usage_from_body(record: CallRecord, data: bytes, content_type: str) -> None:
    """Token counts from a JSON answer, without parsing all of a large one."""
    if not content_type.startswith("application/json"):
        return
    at = data.rfind(b'"usage"')  # inside strings quotes are escaped: this is a key
    if at == -1:
        return
    start = data.find(b"{", at)
    if start == -1:
        return
    try:
        usage, _ = json.JSONDecoder().raw_decode(data[start:].decode(errors="replace"))
    except ValueError:
        return
    if isinstance(usage, dict):
        record.prompt_tokens, record.completion_tokens = token_counts(usage)


def _as_anthropic_error(data: bytes, status: int) -> bytes:
    """An engine's OpenAI-shaped error, retold in Anthropic's shape for /v1/messages: its
    words, not the gateway's (no `source` in it: the relay's ERROR_SOURCE_HEADER says)."""
    message = data.decode(errors="replace").strip() or f"HTTP {status}"
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("type") == "error":
        return data     # already Anthropic's
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        message = error["message"]
    return json.dumps(anthropic_error_body(status, message, source=None)).encode()


def _error_code(data: bytes) -> str | None:
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        return str(code) if code is not None else None
    return None


WHISPER_INFERENCE_PATH = "/v1/audio/transcriptions"   # the engine's --inference-path


def as_whisper_translation(body: bytes, boundary: str) -> bytes:
    """A /v1/audio/translations request for whisper-server, which has one inference path:
    the same form with `translate=true` put first (whisper-server reads the first value
    of a field, so a client's own `translate` cannot turn it off)."""
    part = (f'--{boundary}\r\nContent-Disposition: form-data; name="translate"\r\n\r\n'
            "true\r\n").encode()
    return part + body


def normalise_transcription(data: bytes, content_type: str) -> bytes:
    """whisper-server pads `text` (" hello\\n"); OpenAI's has no such whitespace."""
    if content_type.startswith("application/json"):
        try:
            body = json.loads(data)
        except ValueError:
            return data
        if isinstance(body, dict) and isinstance(body.get("text"), str):
            body["text"] = body["text"].strip()
            return json.dumps(body, ensure_ascii=False).encode()
        return data
    if content_type.startswith("text/plain"):
        return data.strip()
    return data
