"""`llm-gateway chat`, `embed` and `transcribe`: the console's playground from a terminal.
Ordinary /v1 calls through the gateway (recorded like any other): a chat streams its
answer to stdout and says its time to first token and tokens/s on stderr, as the page
does; an embedding says its vector's size; a transcription prints the text.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TextIO

# (method, path, body, content type) -> the gateway's answer, open
Open = Callable[[str, str, bytes, str], AbstractContextManager[http.client.HTTPResponse]]


class PlayError(Exception):
    pass


def add_commands(sub: Any) -> None:
    p = sub.add_parser("chat", help="ask a model, the answer streamed (with time to first "
                                    "token and tokens/s on stderr)")
    p.add_argument("model")
    p.add_argument("prompt", nargs="?", help="default: standard input")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None)
    p = sub.add_parser("embed", help="an embedding model's vector of a text (its size; "
                                     "--json: the vector)")
    p.add_argument("model")
    p.add_argument("text")
    p = sub.add_parser("transcribe", help="an audio model's transcription of a file")
    p.add_argument("model")
    p.add_argument("file", type=Path)


def stream_figures(t0: float, first: float | None, last: float | None,
                   usage_tokens: int | None, chunks: int) -> dict[str, float | int | None]:
    """As the page's ConsoleCore.streamFigures: time to first token (ms), the tokens (the
    engine's count where it said, else the content chunks) and the decode rate after the
    first token."""
    tokens = usage_tokens if usage_tokens is not None else chunks
    gen = None if first is None or last is None else last - first
    return {"ttft_ms": None if first is None else (first - t0) * 1000, "tokens": tokens,
            "tokens_per_s": (tokens - 1) / gen if gen and tokens > 1 else None}


def run(args: argparse.Namespace, open_: Open, out: TextIO | None = None,
        err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr   # (as they are now, not at import)
    if args.command == "chat":
        prompt = args.prompt if args.prompt is not None else sys.stdin.read()
        body: dict[str, Any] = {
            "model": args.model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": args.max_tokens, "messages": [{"role": "user", "content": prompt}]}
        if args.temperature is not None:
            body["temperature"] = args.temperature
        figures = chat(open_, body, out)
        err.write(figures_line(figures) + "\n")
        return 0
    if args.command == "embed":
        answer = _json(open_, "/v1/embeddings", json.dumps(
            {"model": args.model, "input": args.text}).encode(), "application/json")
        vector = answer["data"][0]["embedding"]
        if args.json:
            out.write(json.dumps(vector) + "\n")
        else:
            head = ", ".join(f"{v:.4f}" for v in vector[:8])
            out.write(f"{len(vector)} dimensions: [{head}{', …' if len(vector) > 8 else ''}]\n")
        return 0
    data, content_type = multipart({"model": args.model}, "file", args.file)
    answer = _json(open_, "/v1/audio/transcriptions", data, content_type)
    out.write(json.dumps(answer) + "\n" if args.json else str(answer.get("text", "")) + "\n")
    return 0


def chat(open_: Open, body: dict[str, Any], out: TextIO) -> dict[str, float | int | None]:
    """Stream one chat's answer to out as it comes; its figures."""
    t0 = time.monotonic()
    first = last = None
    chunks, usage = 0, None
    with open_("POST", "/v1/chat/completions", json.dumps(body).encode(),
               "application/json") as resp:
        if resp.status >= 400:
            raise PlayError(_message(resp.read(), resp.status))
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:   # the stream began, then failed: its error event
                out.write("\n")
                raise PlayError(_message(json.dumps(chunk).encode(), resp.status))
            usage = chunk.get("usage") or usage
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if text := delta.get("content") or delta.get("reasoning_content"):
                last = time.monotonic()
                first = first or last
                chunks += 1
                out.write(text)
                out.flush()
    out.write("\n")
    return stream_figures(t0, first, last, (usage or {}).get("completion_tokens"), chunks)


def figures_line(f: dict[str, float | int | None]) -> str:
    ttft = "-" if f["ttft_ms"] is None else f"{f['ttft_ms']:.0f} ms"
    rate = "-" if f["tokens_per_s"] is None else f"{f['tokens_per_s']:.1f}"
    return f"time to first token {ttft}, {f['tokens']} tokens, {rate} tokens/s"


def multipart(fields: dict[str, str], file_field: str, path: Path) -> tuple[bytes, str]:
    """A multipart/form-data body: the fields, then the file (its name, its bytes)."""
    boundary = uuid.uuid4().hex
    try:
        content = path.read_bytes()
    except OSError as e:
        raise PlayError(f"{path}: {e.strerror or e}") from None
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
             .encode() for k, v in fields.items()]
    name = path.name.replace('"', "_")
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; '
                 f'filename="{name}"\r\nContent-Type: application/octet-stream\r\n\r\n'
                 .encode() + content + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), \
        f"multipart/form-data; boundary={boundary}"


def _json(open_: Open, path: str, data: bytes, content_type: str) -> Any:
    with open_("POST", path, data, content_type) as resp:
        body = resp.read()
        if resp.status >= 400:
            raise PlayError(_message(body, resp.status))
    return json.loads(body)


def _message(body: bytes, status: int) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return f"{status}: {json.loads(body)['error']['message']}"
    return f"HTTP {status}"
