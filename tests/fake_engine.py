"""A fake engine speaking llama-server's HTTP on a unix socket: for speed and fault injection.

It imitates what the gateway must cope with: /health, chat and completions
(plain and streamed, one event per token, usage as llama-server sends it, the
connection closed after every stream), the Responses API and Anthropic messages
(plain and streamed, in their own event formats), embeddings refused with llama-server's
501, a whisper-style transcription answer padded with whitespace. Behaviour is
chosen by the prompt text: "die after N" drops the connection mid-stream,
"slow N" waits N ms between tokens, "pad N" makes each token N bytes longer, "linger N"
waits N ms between the stream's final event and its end, "split N" sends the first
token's chunk in two writes N ms apart, "refuse N" answers llama-server's refusal of a
prompt past its context with status N (chat and messages). A hostile engine too:
"chunk size X" answers with a chunk of size line X, "endless event N" streams an event
of N KiB with no end (a blank line; "endless event N!": after a whole event), "huge N"
answers N KiB of JSON.
An OpenAI media server too: /v1/images/generations (a tiny PNG as b64_json),
/v1/images/edits and /variations (what the upload held, told back), /v1/audio/speech
(bytes made from the input, `speech_pieces`, streamed in pieces; "die after N" in the
input breaks off after N pieces; `speech_gate`, when set, holds the last piece until
the test lets it go). It never replaces the real engine in the end-to-end tests.

Run standalone: python -m tests.fake_engine SOCKET_PATH
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import MultipartReader, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.streams import StreamReader

MARK = "X-Request-Id"   # which fake engine answered
# a 1x1 PNG: what every image answer holds
TINY_PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
                            "/5+hHgAHggJ/PchI7wAAAABJRU5ErkJggg==")
SPEECH_TYPES = {"mp3": "audio/mpeg", "opus": "audio/opus", "aac": "audio/aac",
                "flac": "audio/flac", "wav": "audio/wav", "pcm": "audio/pcm"}


def speech_pieces(text: str, pieces: int = 4, size: int = 3000) -> list[bytes]:
    """The "audio" the fake speaks for text, as the pieces it writes: bytes made from the
    text alone, so a test knows what must arrive unchanged."""
    out = []
    for i in range(pieces):
        seed = hashlib.sha256(f"{i}:{text}".encode()).digest()
        out.append((seed * (size // len(seed) + 1))[:size])
    return out


SLOT_CTX = 1024      # each slot's n_ctx in the fake's GET /slots
SLOT_TOKENS = 256    # what a request being answered holds of it


@dataclass
class Seen:
    path: str
    body: bytes
    headers: dict[str, str]


@dataclass
class FakeEngine:
    name: str
    requests: list[Seen] = field(default_factory=list)
    disconnects: int = 0      # streams whose reader (the gateway) went away mid-way
    events_sent: int = 0
    slots: int = 4            # /props total_slots (llama-server's default: 4)
    in_flight: int = 0        # chat and completions requests being answered
    peak_in_flight: int = 0
    runner: web.AppRunner | None = None
    speech_gate: asyncio.Event | None = None   # set: the last speech piece waits for it
    speech_delay_s: float = 0.02               # between speech pieces

    def app(self, *, catch_all: bool = True) -> web.Application:
        """catch_all: every other path answered by `anything` (routes added after it
        would never be reached: leave it to the caller that adds some)."""
        app = web.Application(client_max_size=1024**3)
        app.router.add_get("/health", self.health)
        app.router.add_get("/props", self.props)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/slots", self.slot_list)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/audio/transcriptions", self.transcribe)
        app.router.add_post("/v1/audio/translations", self.transcribe)   # (an openai server's)
        app.router.add_post("/v1/audio/speech", self.speech)
        app.router.add_post("/v1/images/generations", self.image_generation)
        app.router.add_post("/v1/images/edits", self.image_upload)
        app.router.add_post("/v1/images/variations", self.image_upload)
        if catch_all:
            app.router.add_route("*", "/{tail:.*}", self.anything)   # the witness of the rest
        app.on_response_prepare.append(self._mark)
        return app

    async def anything(self, request: web.Request) -> web.Response:
        """Any other path (llama-server's /slots, /load, ...): seen, then llama-server's
        404, so a test can tell what reached an engine that should not have."""
        await self._seen(request)
        return web.json_response({"error": {"code": 404, "message": "File Not Found",
                                            "type": "not_found_error"}}, status=404)

    async def _mark(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer says it came from this engine (tests tell relayed from own), in a
        header the gateway passes on (engines' own headers are dropped: proxy.py)."""
        response.headers[MARK] = self.name

    async def start(self, socket: str) -> None:
        Path(socket).parent.mkdir(parents=True, exist_ok=True)
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.UnixSite(self.runner, socket)
        await site.start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _seen(self, request: web.Request) -> bytes:
        body = await request.read()
        if request.headers.get("User-Agent") != "llm-gateway":   # a client's, relayed
            self.requests.append(Seen(request.path_qs, body, dict(request.headers)))
        return body

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(self, request: web.Request) -> web.Response:
        await self._seen(request)
        return web.json_response({"model_path": f"/models/{self.name}.gguf", "fake": self.name,
                                  "total_slots": self.slots})

    async def metrics(self, request: web.Request) -> web.Response:
        await self._seen(request)
        return web.Response(text=f"llamacpp:requests_processing{{fake=\"{self.name}\"}} 0\n")

    async def slot_list(self, request: web.Request) -> web.Response:
        """llama-server's GET /slots as its build here writes it: each request being
        answered holds a slot with SLOT_TOKENS of its SLOT_CTX."""
        await self._seen(request)
        slots: list[dict[str, Any]] = [
            {"id": i, "n_ctx": SLOT_CTX, "speculative": False,
             "is_processing": i < self.in_flight} for i in range(self.slots)]
        for slot in slots[:self.in_flight]:
            slot.update({"id_task": 1, "n_prompt_tokens": SLOT_TOKENS,
                         "n_prompt_tokens_processed": SLOT_TOKENS, "n_prompt_tokens_cache": 0,
                         "next_token": [{"has_next_token": True, "has_new_line": False,
                                         "n_remain": 10, "n_decoded": 5}]})
        return web.json_response(slots)

    async def embeddings(self, request: web.Request) -> web.Response:
        await self._seen(request)
        return web.json_response({"error": {"code": 501, "message": "This server does not "
                                  "support embeddings. Start it with `--embeddings`",
                                  "type": "not_supported_error"}}, status=501)

    async def transcribe(self, request: web.Request) -> web.Response:
        body = await self._seen(request)
        del body
        return web.json_response({"text": " hello from " + self.name + "\n"})

    async def image_generation(self, request: web.Request) -> web.Response:
        payload = json.loads(await self._seen(request))
        n = int(payload.get("n", 1))
        return web.json_response({"created": int(time.time()), "data": [
            {"b64_json": base64.b64encode(TINY_PNG).decode(),
             "revised_prompt": str(payload.get("prompt", ""))} for _ in range(n)]})

    async def image_upload(self, request: web.Request) -> web.Response:
        """An edit or a variation: the image, told back by what the form held."""
        form = await _form(request, await self._seen(request))
        got = {name: len(value) if isinstance(value, bytes) else value
               for name, value in form.items()}
        return web.json_response({"created": int(time.time()), "got": got, "data": [
            {"b64_json": base64.b64encode(TINY_PNG).decode()}]})

    async def speech(self, request: web.Request) -> web.StreamResponse:
        """speech_pieces(input), written one by one speech_delay_s apart (chunked)."""
        payload = json.loads(await self._seen(request))
        text = str(payload.get("input", ""))
        kind = SPEECH_TYPES.get(str(payload.get("response_format", "mp3")), "audio/mpeg")
        response = web.StreamResponse(headers={"Content-Type": kind})
        await response.prepare(request)
        die = re.search(r"die after (\d+)", text)
        pieces = speech_pieces(text)
        for i, piece in enumerate(pieces):
            if die and i == int(die.group(1)):
                assert request.transport is not None
                request.transport.abort()   # the engine "crashes" mid-answer
                return response
            if i == len(pieces) - 1 and self.speech_gate is not None:
                await self.speech_gate.wait()
            elif i:
                await asyncio.sleep(self.speech_delay_s)
            try:
                await response.write(piece)
            except ConnectionResetError:
                self.disconnects += 1
                raise
        await response.write_eof()
        return response

    async def chat(self, request: web.Request) -> web.StreamResponse:
        payload = json.loads(await self._seen(request))
        prompt = " ".join(str(m.get("content")) for m in payload.get("messages", []))
        if hostile := re.search(r"(chunk size|endless event|huge) (\S+)", prompt):
            return await self._hostile(request, hostile.group(1), hostile.group(2))
        if refused := _refusal(prompt):
            return refused
        return await self._counted(self._answer(request, payload, prompt, chat=True))

    async def _hostile(self, request: web.Request, how: str, arg: str) -> web.StreamResponse:
        if how == "huge":   # one JSON answer of arg KiB
            return web.json_response({"choices": [], "pad": "x" * (int(arg) * 1024)})
        if how == "endless event":   # an event's bytes with no blank line, then silence
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            try:
                if arg != arg.rstrip("!"):   # "endless event N!": one whole event first
                    await response.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
                await response.write(b"data: ")
                for _ in range(int(arg.rstrip("!")) // 64):
                    await response.write(b"x" * 65536)
                    self.events_sent += 1
                for _ in range(600):   # until the gateway lets go (30 s at most)
                    if request.transport is None or request.transport.is_closing():
                        raise ConnectionResetError
                    await asyncio.sleep(0.05)
            except ConnectionError:
                self.disconnects += 1   # the gateway let go of the answer
            return response
        # a chunk whose size line is arg, written raw, then the connection closed
        assert request.transport is not None
        request.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n" + arg.encode()
                                + b"\r\n{}\r\n0\r\n\r\n")
        request.transport.close()
        raise asyncio.CancelledError   # (no answer of aiohttp's after ours)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        payload = json.loads(await self._seen(request))
        return await self._counted(self._answer(request, payload,
                                                str(payload.get("prompt", "")), chat=False))

    async def _counted(self, answer: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await answer
        finally:
            self.in_flight -= 1

    async def responses(self, request: web.Request) -> web.StreamResponse:
        payload = json.loads(await self._seen(request))
        prompt, n = str(payload.get("input", "")), int(payload.get("max_output_tokens", 4))
        usage = {"input_tokens": len(prompt.split()) + 10, "output_tokens": n,
                 "total_tokens": len(prompt.split()) + 10 + n}
        done = {"id": "resp-1", "object": "response", "status": "completed",
                "model": self.name, "usage": usage, "output": [{
                    "type": "message", "role": "assistant", "content": [
                        {"type": "output_text", "text": "".join(self._words(n))}]}]}
        if not payload.get("stream"):
            return web.json_response(done)
        events = [("response.created", {"type": "response.created", "response": {
            **done, "status": "in_progress", "usage": None}})]
        events += [("response.output_text.delta",
                    {"type": "response.output_text.delta", "delta": w})
                   for w in self._words(n)]
        events.append(("response.completed", {"type": "response.completed", "response": done}))
        return await self._typed_stream(request, prompt, events)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        payload = json.loads(await self._seen(request))
        prompt = " ".join(str(m.get("content")) for m in payload.get("messages", []))
        if refused := _refusal(prompt):
            return refused
        n = int(payload.get("max_tokens", 4))
        message = {"id": "msg-1", "type": "message", "role": "assistant", "model": self.name,
                   "content": [{"type": "text", "text": "".join(self._words(n))}],
                   "stop_reason": "max_tokens", "stop_sequence": None,
                   "usage": {"input_tokens": len(prompt.split()) + 10, "output_tokens": n}}
        if not payload.get("stream"):
            return web.json_response(message)
        start = {**message, "content": [], "stop_reason": None,
                 "usage": {"input_tokens": len(prompt.split()) + 10, "output_tokens": 0}}
        events: list[tuple[str, dict[str, Any]]] = [
                  ("message_start", {"type": "message_start", "message": start}),
                  ("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}),
                  ("ping", {"type": "ping"})]
        events += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": w}})
                   for w in self._words(n)]
        events += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                   ("message_delta", {"type": "message_delta", "delta": {
                       "stop_reason": "max_tokens", "stop_sequence": None},
                       "usage": {"output_tokens": n}}),
                   ("message_stop", {"type": "message_stop"})]
        return await self._typed_stream(request, prompt, events)

    @staticmethod
    def _words(n: int) -> list[str]:
        return [f" w{i}" for i in range(n)]

    async def _typed_stream(self, request: web.Request, prompt: str,
                            events: list[tuple[str, dict[str, Any]]]) -> web.StreamResponse:
        """Named events (`event:` + `data:`), the Responses and Anthropic way; "die after N"
        breaks off after N events."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        die = re.search(r"die after (\d+)", prompt)
        for i, (name, data) in enumerate(events):
            if die and i == int(die.group(1)):
                assert request.transport is not None
                request.transport.abort()
                return response
            await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
            self.events_sent += 1
        await response.write_eof()
        if request.transport is not None:
            request.transport.close()
        return response

    async def _answer(self, request: web.Request, payload: dict[str, Any], prompt: str,
                      chat: bool) -> web.StreamResponse:
        n = int(payload.get("max_tokens", 4))
        pad = re.search(r"pad (\d+)", prompt)    # "pad N": each token N bytes longer
        words = [f" w{i}" + ("x" * int(pad.group(1)) if pad else "") for i in range(n)]
        usage = {"prompt_tokens": len(prompt.split()) + 10, "completion_tokens": n,
                 "total_tokens": len(prompt.split()) + 10 + n}
        base = {"id": "fake-1", "created": int(time.time()), "model": self.name}
        if not payload.get("stream"):
            if chat:
                choice = {"index": 0, "finish_reason": "length",
                          "message": {"role": "assistant", "content": "".join(words)}}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "finish_reason": "length", "text": "".join(words)}
                obj = "text_completion"
            return web.json_response({**base, "object": obj, "choices": [choice],
                                      "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Keep-Alive": "timeout=5, max=100"})
        await response.prepare(request)
        die = re.search(r"die after (\d+)", prompt)
        slow = re.search(r"slow (\d+)", prompt)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def event(data: dict[str, Any]) -> None:
            try:
                await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")
            except ConnectionResetError:
                self.disconnects += 1   # the gateway closed the connection: stop generating
                raise
            self.events_sent += 1

        if chat:
            await event({**base, "object": obj, "choices": [
                {"index": 0, "finish_reason": None,
                 "delta": {"role": "assistant", "content": None}}]})
        if split := re.search(r"split (\d+)", prompt):
            # the next token's chunk arrives in two writes, split (N-th byte) ms apart: a
            # reader is in the middle of a chunk meanwhile
            word, words = words[0], words[1:]
            data = b"data: " + json.dumps({**base, "object": obj, "choices": [
                {"index": 0, "finish_reason": None, "delta": {"content": word}}]}).encode()
            framed = b"%x\r\n%b\n\n\r\n" % (len(data) + 2, data)
            assert request.transport is not None
            request.transport.write(framed[:20])
            await asyncio.sleep(int(split.group(1)) / 1000)
            request.transport.write(framed[20:])
            self.events_sent += 1
        for i, word in enumerate(words):
            if die and i == int(die.group(1)):
                assert request.transport is not None
                request.transport.abort()   # the engine "crashes" mid-stream
                return response
            if slow:
                await asyncio.sleep(int(slow.group(1)) / 1000)
            delta = {"delta": {"content": word}} if chat else {"text": word}
            await event({**base, "object": obj, "choices": [
                {"index": 0, "finish_reason": None, **delta}]})
        include = (payload.get("stream_options") or {}).get("include_usage")
        final: dict[str, Any] = {"index": 0, "finish_reason": "length",
                                 **({"delta": {}} if chat else {"text": ""})}
        if chat:
            await event({**base, "object": obj, "choices": [final]})
            if include:
                await event({**base, "object": obj, "choices": [], "usage": usage})
        else:
            await event({**base, "object": obj, "choices": [final], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        if linger := re.search(r"linger (\d+)", prompt):   # the stream's end comes late
            await asyncio.sleep(int(linger.group(1)) / 1000)
        await response.write_eof()
        # like llama-server: the connection is closed after a stream
        if request.transport is not None:
            request.transport.close()
        return response


def _refusal(prompt: str) -> web.Response | None:
    """"refuse N": llama-server's answer to a prompt past its context, with status N."""
    if not (refused := re.search(r"refuse (\d{3})", prompt)):
        return None
    status = int(refused.group(1))
    return web.json_response({"error": {
        "code": status, "message": "the request exceeds the available context size, try "
        "increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 9000,
        "n_ctx": 4096}}, status=status)


async def _form(request: web.Request, body: bytes) -> dict[str, str | bytes]:
    """A multipart body already read: text fields as text, files as their bytes."""
    loop = asyncio.get_running_loop()
    stream = StreamReader(BaseProtocol(loop), 2**16, loop=loop)
    stream.feed_data(body)
    stream.feed_eof()
    form: dict[str, str | bytes] = {}
    reader = MultipartReader(request.headers, stream)
    while (part := await reader.next()) is not None:
        data = await part.read()  # type: ignore[union-attr]
        name = getattr(part, "name", None) or ""
        form[name] = bytes(data) if getattr(part, "filename", None) else data.decode()
    return form


async def _main(socket: str) -> None:
    engine = FakeEngine(Path(socket).parent.name)
    await engine.start(socket)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1]))
