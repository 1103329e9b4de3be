"""The admin API for getting and removing models: pull from a hub, follow, cancel, rm.
Thin handlers: parse, one call into service/pulls or service/model_removal, render.

A pull answers as soon as its files are chosen and known to fit (202, or 200 when the
model is already here); its progress is on /admin/events (`pull` events) and
/admin/pulls. Model names travel in the body, never in the path (admin_api's rule).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from gatewayd.core.errors import InvalidRequest
from gatewayd.http.admin_api import ENGINES, PULLER, RELOADER
from gatewayd.service.model_removal import remove_model


async def pull(request: web.Request) -> web.Response:
    body = await _body(request)
    source = _required(body, "source")
    state = await request.app[PULLER].pull(
        source, name=_optional(body, "name"), mmproj=_flag(body, "mmproj"))
    return web.json_response({"pull": state.describe()},
                             status=200 if state.state == "done" else 202)


async def list_pulls(request: web.Request) -> web.Response:
    return web.json_response({"pulls": [p.describe() for p in request.app[PULLER].pulls()]})


async def cancel_pull(request: web.Request) -> web.Response:
    name = _required(await _body(request), "model")
    state = await request.app[PULLER].cancel(name)
    if state is None:
        raise InvalidRequest(f"no pull of {name!r} is running", param="model")
    return web.json_response({"pull": state.describe()})


async def remove(request: web.Request) -> web.Response:
    body = await _body(request)
    removed = await remove_model(
        _required(body, "model"), force=_flag(body, "force"),
        engines=request.app[ENGINES], puller=request.app[PULLER],
        rescan=request.app[RELOADER].rescan_models)
    return web.json_response(removed.as_json())


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json() if request.can_read_body else {}
    except json.JSONDecodeError:
        raise InvalidRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body is a JSON object")
    return body


def _optional(body: dict[str, Any], key: str) -> str | None:
    return None if body.get(key) is None else _required(body, key)


def _required(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f'give {key} as a string ({{"{key}": "..."}})', param=key)
    return value.strip()


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} is true or false", param=key)
    return value
