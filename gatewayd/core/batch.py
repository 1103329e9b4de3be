"""Batch jobs as OpenAI's Batch API defines them: an input file's lines, a batch's states,
and the objects and output lines the API answers with. Pure.

An input file is JSONL, one request per line:
`{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`.
Every line is checked when the file is uploaded, and the upload is refused with the
line number and why of each bad line (the first MAX_PROBLEMS of them); nothing of a
refused file is kept. A batch runs its file's lines against one endpoint (`url` of every
line), each line's `body.model` a model the caller's key may use.

A batch's states, as OpenAI's (`validating` is not one the gateway shows: a batch is
checked before it is created):

    in_progress ─► finalizing ─► completed
        │    └──────────────────► expired      (completion_window passed: done lines kept)
        └─► cancelling ─► cancelled            (in-flight lines end, done lines kept)
    failed: the batch could not run at all (its input file gone)

A line is `pending`, `sent` (its request on its way: a line sent when the gateway stopped
is sent again once, then failed), `done` (answered: by the engine, any status) or
`failed` (no answer: the gateway's own error). Only done and failed lines reach the
output and error files, each exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gatewayd.core.errors import BatchFileInvalid, BatchInvalid

# what a line may ask (OpenAI's batch endpoints that the gateway's engines answer)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOWS = {"24h": 24 * 3600}     # completion_window: OpenAI's one value
MAX_PROBLEMS = 20                # bad lines named in one refusal
MAX_CUSTOM_ID = 512
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})
ATTEMPTS = 2                     # a line is sent at most this often (once again after a crash)

PENDING, SENT, DONE, FAILED = "pending", "sent", "done", "failed"
IN_PROGRESS, FINALIZING, COMPLETED = "in_progress", "finalizing", "completed"
FAILED_BATCH, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
ENDED = frozenset({COMPLETED, FAILED_BATCH, EXPIRED, CANCELLED})
STAMPS = {IN_PROGRESS: "in_progress_at", FINALIZING: "finalizing_at",
          COMPLETED: "completed_at", FAILED_BATCH: "failed_at", EXPIRED: "expired_at",
          CANCELLING: "cancelling_at", CANCELLED: "cancelled_at"}


# Line, Problem and StoredFile are named tuples, not dataclasses: their classes are made
# at the socket-activated start (the route table's handlers import this module), where a
# dataclass costs several times as much to make (as core/config_schema's Key and Bound)
class Line(NamedTuple):
    """One request of an input file, as checked."""

    number: int          # 1-based, as an editor shows it
    custom_id: str
    url: str
    model: str
    body: bytes          # the request's body, as it will be sent (JSON)


class Problem(NamedTuple):
    line: int
    message: str
    param: str | None = None

    def describe(self) -> dict[str, Any]:
        """In OpenAI's batch error shape (`errors.data[]`)."""
        return {"code": "invalid_line", "line": self.line, "message": self.message,
                "param": self.param}


def read_lines(data: bytes, *, max_lines: int) -> list[Line]:
    """The file's lines, every one checked; BatchFileInvalid naming the bad ones."""
    lines: list[Line] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for number, raw in _numbered(data):
        if len(lines) + len(problems) >= max_lines:
            problems.append(Problem(number, f"the file has more than {max_lines} lines "
                                            "(batches.max_lines)"))
            break
        try:
            line = _line(number, raw)
        except _Bad as e:
            problems.append(Problem(number, str(e), e.param))
        else:
            if (first := seen.get(line.custom_id)) is not None:
                problems.append(Problem(number, f"custom_id {line.custom_id!r} is also on "
                                                f"line {first}: each must be unique",
                                        "custom_id"))
            else:
                seen[line.custom_id] = number
                lines.append(line)
        if len(problems) >= MAX_PROBLEMS:
            break
    if problems:
        shown = "; ".join(f"line {p.line}: {p.message}" for p in problems[:5])
        raise BatchFileInvalid(
            f"{len(problems)}{'+' if len(problems) >= MAX_PROBLEMS else ''} bad line(s), "
            f"nothing was kept: {shown}", param="file",
            errors=[p.describe() for p in problems])
    if not lines:
        raise BatchFileInvalid("the file has no requests (one JSON object per line)",
                               param="file")
    return lines


class _Bad(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _numbered(data: bytes) -> Iterator[tuple[int, bytes]]:
    """Each line with its number; blank lines at the end (the file's final newline) are
    no lines, and a blank line elsewhere is one (refused: a request was expected)."""
    parts = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")   # a UTF-8 BOM is no byte of it
    while parts and not parts[-1].strip():
        parts.pop()
    for number, raw in enumerate(parts, 1):
        yield number, raw.rstrip(b"\r")


def _line(number: int, raw: bytes) -> Line:
    if not raw.strip():
        raise _Bad("an empty line: each line is one request")
    try:
        # decoded first: json.loads would take UTF-16 and UTF-32 bytes as well
        item = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _Bad("not UTF-8") from None
    except ValueError as e:
        raise _Bad(f"not JSON ({_clip(str(e))})") from None
    except RecursionError:
        raise _Bad("JSON nested too deep") from None
    if not isinstance(item, dict):
        raise _Bad("not a JSON object")
    unknown = sorted(set(item) - LINE_KEYS)
    if unknown:
        raise _Bad(f"unknown field(s) {', '.join(map(repr, unknown[:5]))}: a line has "
                   "custom_id, method, url and body", unknown[0])
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise _Bad(f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters",
                   "custom_id")
    if item.get("method") != "POST":
        raise _Bad("method must be \"POST\"", "method")
    url = item.get("url")
    if url not in ENDPOINTS:
        raise _Bad(f"url must be one of {', '.join(ENDPOINTS)}", "url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise _Bad("body must be a JSON object (the request's body)", "body")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise _Bad("body.model must name a model", "body.model")
    if body.get("stream") not in (None, False):
        raise _Bad("body.stream: a batch's answers are whole, not streamed", "body.stream")
    return Line(number, custom_id, str(url), model,
                json.dumps(body, separators=(",", ":")).encode())


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def check_metadata(metadata: object) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs (keys ≤ 64, values ≤ 512 characters)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= 64
            and len(v) <= 512 for k, v in metadata.items()):
        raise BatchInvalid("metadata is up to 16 string keys (≤ 64 characters) with string "
                           "values (≤ 512 characters)", param="metadata")
    return dict(metadata)


@dataclass
class Batch:
    """A batch as kept: OpenAI's fields, and whose it is."""

    id: str
    owner: str                  # the key's name ("": keys are off)
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = IN_PROGRESS
    metadata: dict[str, str] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    stamps: dict[str, int] = field(default_factory=dict)   # STAMPS' fields that happened

    def describe(self) -> dict[str, Any]:
        """The OpenAI Batch object."""
        out: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window, "status": self.status,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "expires_at": self.expires_at,
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed},
            "metadata": self.metadata}
        for stamp in STAMPS.values():
            out[stamp] = self.stamps.get(stamp)
        return out

    def move(self, status: str, now: int) -> None:
        """To status, stamped (its `*_at` field) when it first gets there."""
        self.status = status
        self.stamps.setdefault(STAMPS[status], now)


class StoredFile(NamedTuple):
    """An uploaded or written file, as OpenAI's File object describes it."""

    id: str
    owner: str
    purpose: str            # batch (uploaded), batch_output (written by a batch)
    filename: str
    bytes: int
    created_at: int

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


def answer_line(request_id: str, custom_id: str, status: int,
                body: Mapping[str, Any] | str) -> dict[str, Any]:
    """An output (or error) file's line for a line the engine answered."""
    ok = 200 <= status < 300
    return {"id": request_id, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None if ok else {"code": _code_of(body),
                                      "message": _message_of(body, status)}}


def error_line(request_id: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """An error file's line for a line that got no answer (the gateway's own error)."""
    return {"id": request_id, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _code_of(body: Mapping[str, Any] | str) -> str:
    error = body.get("error") if isinstance(body, Mapping) else None
    code = error.get("code") if isinstance(error, Mapping) else None
    return code if isinstance(code, str) else "request_failed"


def _message_of(body: Mapping[str, Any] | str, status: int) -> str:
    error = body.get("error") if isinstance(body, Mapping) else None
    message = error.get("message") if isinstance(error, Mapping) else None
    return message if isinstance(message, str) else f"the engine answered {status}"
