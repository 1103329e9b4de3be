"""API keys at the HTTP edge (the rules are core/auth.py's).

`check_key` runs first in the error middleware (so a refusal is rendered in the
caller's dialect), before routing: with keys off it is one attribute read. The
key found is kept on the request (`request[API_KEY]`) for the handler's model
check and the call record. The keys in force live in `app[KEYS]`, replaced by a
configuration reload.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from gatewayd.core.auth import ADMIN, INFERENCE, ApiKey, KeyRing, presented_key

API_KEY = web.RequestKey("api_key", ApiKey)
OPEN_PATHS = frozenset({"/health", "/favicon.ico"})   # liveness checks carry no key
CREDENTIAL_HEADERS = ("Authorization", "X-Api-Key")


@dataclass
class Keys:
    current: KeyRing | None = None


KEYS = web.AppKey("api_keys", Keys)


def check_key(request: web.Request) -> None:
    """Raises MissingApiKey / InvalidApiKey (401) or ScopeNotAllowed (403)."""
    holder = request.app.get(KEYS)   # (an app built without keys: admin API tests)
    keys = holder.current if holder is not None else None
    if keys is None or request.path in OPEN_PATHS:
        return
    path = request.path
    scope = ADMIN if path == "/admin" or path.startswith("/admin/") else INFERENCE
    headers = request.headers
    request[API_KEY] = keys.identify(
        presented_key(headers.get("Authorization"), headers.get("X-Api-Key")), scope)


def request_key(request: web.Request) -> ApiKey | None:
    return request.get(API_KEY)
