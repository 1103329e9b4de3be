"""OpenAI's Batch API: `/v1/files` and `/v1/batches` (service/batches does the work).

A key sees, reads, deletes and cancels only its own files and batches; a key with the
admin scope, or every caller while keys are off, sees all. Another key's file or batch
is a 404, as one that does not exist.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from gatewayd.core.auth import ADMIN, ApiKey
from gatewayd.core.errors import BodyTooLarge, InvalidRequest
from gatewayd.http.auth import query_of, request_key
from gatewayd.http.openai_api import FRONT, read_body
from gatewayd.service.batches import Batches

BATCHES = web.AppKey("batches", Batches)
FORM_SLACK = 64 * 1024    # a multipart form's own bytes around the file
PURPOSE_MAX = 64
READ_CHUNK = 1024 * 1024


def owner_of(key: ApiKey | None) -> str:
    """Whose a new file or batch is: the key's name ("" while keys are off)."""
    return key.name if key is not None else ""


def seen_by(key: ApiKey | None) -> str | None:
    """Whose files and batches the caller sees (None: everyone's)."""
    return None if key is None or ADMIN in key.scopes else key.name


def _viewer(request: web.Request) -> str | None:
    return seen_by(request_key(request))


async def upload_file(request: web.Request) -> web.Response:
    """POST /v1/files: multipart, `purpose=batch` and `file` (JSONL), checked line by line."""
    batches = request.app[BATCHES]
    limit = batches.config.batch_max_file_bytes
    if request.content_length is not None and request.content_length > limit + FORM_SLACK:
        raise BodyTooLarge(f"the upload ({request.content_length} bytes) is over the limit of "
                           f"{limit} bytes (batches.max_file_mb)", limit=limit)
    purpose, filename, data = await _read_form(request, limit)
    if purpose != "batch":
        raise InvalidRequest("purpose must be \"batch\" (the only files this gateway keeps "
                             "are batch input files)", param="purpose")
    if data is None:
        raise InvalidRequest("the form has no `file` field", param="file")
    stored = await batches.upload(owner_of(request_key(request)), filename, data)
    return web.json_response(stored.describe())


async def _read_form(request: web.Request, limit: int) -> tuple[str | None, str, bytes | None]:
    """(purpose, file name, file bytes) of the form; refuses any other field."""
    purpose: str | None = None
    filename = ""
    data: bytes | None = None
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise InvalidRequest("a nested multipart form is not a batch file upload")
            if part.name == "purpose":
                purpose = (await _read_part(part, PURPOSE_MAX, "purpose")).decode(
                    "utf-8", "replace").strip()
            elif part.name == "file" and data is None:
                filename = part.filename or ""
                data = await _read_part(part, limit, "file")
            else:
                raise InvalidRequest(f"the form has a field {str(part.name)[:40]!r}: it takes "
                                     "`purpose` and one `file`", param=str(part.name)[:40])
    except (ValueError, AssertionError, KeyError, HttpProcessingError) as e:
        # (aiohttp's: a part's header that is no header)
        raise InvalidRequest(f"not a multipart/form-data upload: {str(e)[:120]}") from None
    return purpose, filename, data


async def _read_part(part: BodyPartReader, limit: int, name: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await part.read_chunk(READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"`{name}` is over the limit of {limit} bytes"
                               + (" (batches.max_file_mb)" if name == "file" else ""),
                               param=name, limit=limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def list_files(request: web.Request) -> web.Response:
    query = query_of(request)
    limit = query.get("limit", 10_000)
    found, more = await request.app[BATCHES].files(
        _viewer(request), purpose=query.get("purpose"),
        after=query.get("after"), limit=limit, newest_first=query.get("order") != "asc")
    return web.json_response(_listing([f.describe() for f in found], more))


async def retrieve_file(request: web.Request) -> web.Response:
    stored = await request.app[BATCHES].file(_viewer(request), request.match_info["key"])
    return web.json_response(stored.describe())


async def delete_file(request: web.Request) -> web.Response:
    stored = await request.app[BATCHES].delete_file(_viewer(request), request.match_info["key"])
    return web.json_response({"id": stored.id, "object": "file", "deleted": True})


async def file_content(request: web.Request) -> web.FileResponse:
    path = await request.app[BATCHES].content_path(_viewer(request), request.match_info["key"])
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


async def create_batch(request: web.Request) -> web.Response:
    """POST /v1/batches: a batch of the caller's input file, every line's model checked
    against the caller's key."""
    front = request.app[FRONT]
    payload = await _json_object(request, front.config.max_body_bytes)
    key = request_key(request)
    catalog = front.manager.catalog

    def may_use(model_id: str) -> bool:
        served = catalog.find_served(model_id)
        return key is None or (served is not None and key.may_use(model_id, served.names))
    batch = await request.app[BATCHES].create(
        owner_of(key), input_file_id=_text(payload, "input_file_id"),
        endpoint=_text(payload, "endpoint"),
        completion_window=_text(payload, "completion_window", "24h"),
        metadata=payload.get("metadata"), may_use=may_use)
    return web.json_response(batch.describe())


async def list_batches(request: web.Request) -> web.Response:
    query = query_of(request)
    found, more = await request.app[BATCHES].batches(
        _viewer(request), after=query.get("after"), limit=query.get("limit", 20))
    return web.json_response(_listing([b.describe() for b in found], more))


async def retrieve_batch(request: web.Request) -> web.Response:
    batch = await request.app[BATCHES].batch(_viewer(request), request.match_info["key"])
    return web.json_response(batch.describe())


async def cancel_batch(request: web.Request) -> web.Response:
    batch = await request.app[BATCHES].cancel(_viewer(request), request.match_info["key"])
    return web.json_response(batch.describe())


async def all_batches(request: web.Request) -> web.Response:
    """GET /admin/batches: every key's batches, newest first (`llm-gateway batches`)."""
    found, more = await request.app[BATCHES].batches(
        None, after=None, limit=query_of(request).get("limit", 50))
    return web.json_response(_listing([{**b.describe(), "owner": b.owner} for b in found],
                                      more))


async def cancel_any(request: web.Request) -> web.Response:
    """POST /admin/batches/cancel {"batch": ID}: any key's batch."""
    payload = await _json_object(request, request.app[FRONT].config.max_body_bytes)
    batch = await request.app[BATCHES].cancel(None, _text(payload, "batch"))
    return web.json_response(batch.describe())


def _listing(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """OpenAI's list page."""
    return {"object": "list", "data": data, "has_more": more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


async def _json_object(request: web.Request, limit: int) -> dict[str, Any]:
    body = await read_body(request, limit)
    try:
        payload = json.loads(body) if body else {}
    except (ValueError, RecursionError):
        raise InvalidRequest("the body is not JSON (or nested too deep)") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("the body must be a JSON object")
    return payload


def _text(payload: dict[str, Any], name: str, default: str | None = None) -> str:
    value = payload.get(name, default)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a string", param=name)
    return value
