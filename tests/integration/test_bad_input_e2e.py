"""Hostile or broken requests end to end: the real gateway (a service of the container's
systemd) with real llama-server and whisper-server engines on the generated tiny models.
Each bad request gets a clear 4xx in OpenAI's envelope ({"error": {"message", "type",
"code"}}), never a traceback (in the answer or the gateway's journal), and the gateway and
its engines serve a normal request right after it.

(tests/http/test_fuzz.py and test_front_door.py send such bytes to fake engines; here
they meet the real parsers on the way: aiohttp's, the gateway's own, the engines'.)"""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.conftest import write_config
from tests.integration.gateway_helpers import (
    GatewayService,
    journal_until,
    speech_wav,
    stop_all_engine_units,
    whisper_model_config,
)

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

CHAT = "/v1/chat/completions"
TRANSCRIBE = "/v1/audio/transcriptions"


@dataclass
class Served:
    gw: GatewayService
    wav: bytes
    pids: dict[str, int]     # the engines' main PIDs once started: never restarted


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, llama_server: Path,
           tiny_models: dict[str, Path], whisper_server: Path,
           tiny_whisper: Path) -> Iterator[Served]:
    """One gateway, tiny-alpha (llama-server) and whisper-tiny (whisper-server) ready."""
    tmp = tmp_path_factory.mktemp("bad-input")
    config, port = write_config(tmp, llama_server, tiny_models,
                                extra=whisper_model_config(whisper_server, tiny_whisper))
    gw = GatewayService(config, port)
    gw.start()
    try:
        for model in ("tiny-alpha", "whisper-tiny"):
            proc = gw.cli("start", model)
            assert proc.returncode == 0, proc.stderr
        pids = {m: e["pid"] for m, e in gw.engines().items() if e["state"] == "ready"}
        assert pids.keys() == {"tiny-alpha", "whisper-tiny"}, pids
        wav = speech_wav(tmp / "speech.wav").read_bytes()
        yield Served(gw, wav, pids)
    finally:
        gw.stop()
        stop_all_engine_units()


def send(gw: GatewayService, method: str, path: str, body: bytes = b"",
         headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """One request on a connection of its own: (status, Content-Type, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    finally:
        conn.close()


def refused(answer: tuple[int, str, bytes], status: int, code: str) -> dict[str, Any]:
    """answer is status in OpenAI's envelope with code, and tells nothing of our insides."""
    got, content_type, data = answer
    assert (got, content_type) == (status, "application/json; charset=utf-8"), answer
    assert b"Traceback" not in data and b'File "' not in data, data
    error = json.loads(data)["error"]
    assert error["code"] == code and error["message"], error
    assert error["type"] == "invalid_request_error", error
    return dict(error)


def still_serving(served: Served, *, transcription: bool = False) -> None:
    """A normal chat (and transcription) answered by the same engines, and no traceback
    in the gateway's journal."""
    sdk = openai.OpenAI(base_url=served.gw.url + "/v1", api_key="unused", max_retries=0,
                        timeout=60)
    answer = sdk.chat.completions.create(model="tiny-alpha", max_tokens=2,
                                         messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None and answer.usage.completion_tokens == 2
    if transcription:
        text = sdk.audio.transcriptions.create(model="whisper-tiny",
                                               file=("speech.wav", served.wav, "audio/wav"))
        assert isinstance(text.text, str)
    engines = served.gw.engines()
    assert {m: engines[m]["pid"] for m in served.pids} == served.pids   # never restarted
    assert "Traceback" not in served.gw.journal()


def multipart(*parts: tuple[str, bytes, str | None], boundary: str) -> bytes:
    """A multipart/form-data body: (field name, value, filename or None) each."""
    out = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (
            f'; filename="{filename}"' if filename else "")
        out += (f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
                + ("Content-Type: audio/wav\r\n" if filename else "") + "\r\n").encode()
        out += value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def test_json_nested_100k_deep_is_a_400(served: Served) -> None:
    for deep in (b"[" * 100_000 + b"]" * 100_000,
                 b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        body = b'{"model": "tiny-alpha", "messages": ' + deep + b"}"
        error = refused(send(served.gw, "POST", CHAT, body,
                             {"Content-Type": "application/json"}), 400, "invalid_request")
        assert "nested too deeply" in error["message"], error
    still_serving(served)


def test_a_truncated_multipart_upload_is_a_400(served: Served) -> None:
    """The model field whole, the audio cut off in the middle (the body's length is
    what was sent, its closing boundary never came): the gateway says the body is
    broken, instead of passing the half to whisper-server."""
    boundary = uuid.uuid4().hex
    whole = multipart(("model", b"whisper-tiny", None),
                      ("file", served.wav, "speech.wav"), boundary=boundary)
    for cut in (len(whole) // 2, len(whole) - 5):
        error = refused(send(served.gw, "POST", TRANSCRIBE, whole[:cut], {
            "Content-Type": f"multipart/form-data; boundary={boundary}"}),
            400, "invalid_request")
        assert "multipart" in error["message"], error
    still_serving(served, transcription=True)


def test_a_multipart_upload_without_a_boundary_is_a_400(served: Served) -> None:
    body = multipart(("model", b"whisper-tiny", None), ("file", served.wav, "speech.wav"),
                     boundary="b0undary")
    error = refused(send(served.gw, "POST", TRANSCRIBE, body,
                         {"Content-Type": "multipart/form-data"}), 400, "invalid_request")
    assert "multipart" in error["message"] and "boundary" in error["message"], error
    still_serving(served, transcription=True)


def test_oversized_headers_are_a_431(served: Served) -> None:
    """A field over 8 KiB, or a head over 32 KiB in all (http/auth: the bounds the
    gateway answers itself, up to the parser's 64 KiB)."""
    body = json.dumps({"model": "tiny-alpha", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    json_type = {"Content-Type": "application/json"}
    one_big = {**json_type, "X-Big": "a" * 16_000}
    many = {**json_type, **{f"X-Pad-{i}": "b" * 2_000 for i in range(20)}}
    huge_cookie = {**json_type, "Cookie": "c=" + "d" * 60_000}
    for headers in (one_big, many, huge_cookie):
        error = refused(send(served.gw, "POST", CHAT, body, headers), 431,
                        "request_header_fields_too_large")
        assert "bytes" in error["message"], error
    error = refused(send(served.gw, "GET", "/v1/models?q=" + "e" * 9_000), 431,
                    "request_header_fields_too_large")
    assert "request line" in error["message"]
    # past the parser's own 64 KiB it answers itself (a plain 400: no hook for its words),
    # and the journal gets one line for it, not a traceback (still_serving checks)
    status, _, _ = send(served.gw, "POST", CHAT, body, {**json_type, "X-Big": "a" * 70_000})
    assert status == 400
    journal_until("refused by the HTTP parser", "-u", served.gw.unit)
    still_serving(served)


def test_invalid_utf8_in_the_model_is_a_4xx(served: Served) -> None:
    json_type = {"Content-Type": "application/json"}
    # bytes that are not UTF-8: the body is not JSON
    error = refused(send(served.gw, "POST", CHAT, b'{"model": "tiny-\xff\xfe", "messages": '
                         b'[{"role": "user", "content": "hi"}]}', json_type),
                    400, "invalid_request")
    assert "not valid JSON" in error["message"], error
    # valid JSON naming a lone surrogate (no UTF-8 spells it): a name no model has
    error = refused(send(served.gw, "POST", CHAT, b'{"model": "tiny-\\udcff", "messages": '
                         b'[{"role": "user", "content": "hi"}]}', json_type),
                    404, "model_not_found")
    # the multipart field and the query string
    boundary = uuid.uuid4().hex
    error = refused(send(served.gw, "POST", TRANSCRIBE, multipart(
        ("model", b"whisper-\xff", None), ("file", served.wav, "speech.wav"),
        boundary=boundary), {"Content-Type": f"multipart/form-data; boundary={boundary}"}),
        400, "invalid_request")
    assert "multipart" in error["message"], error
    refused(send(served.gw, "GET", "/props?model=tiny-%FF%FE"), 404, "model_not_found")
    still_serving(served, transcription=True)
