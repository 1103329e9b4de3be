"""API keys: who may call which model, and the admin API. Pure.

Off unless the configuration names a keys file (`[auth] keys_file`): then every
request but the gateway's own `/health` needs a key, given as
`Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic
clients). The file holds no key, only its SHA-256 (keys are 256-bit random
tokens, so a fast hash is enough: there is nothing to guess from it), per key a
name, the models it may use (ids or aliases; "*" for all) and its scopes:
`inference` (the OpenAI/Anthropic API) and/or `admin` (`/admin/*`).

    [keys.alice]
    sha256 = "5e88…"          # `llm-gateway key new alice` prints a key and this table
    models = ["*"]
    scopes = ["inference"]

A missing or unknown key is 401; a key without the scope, or without the model,
is 403. The key's name goes into the call record.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gatewayd.core.errors import (
    ConfigError,
    InvalidApiKey,
    MissingApiKey,
    ModelNotAllowed,
    ScopeNotAllowed,
)
from gatewayd.core.priority import CLASSES, parse_class

INFERENCE, ADMIN = "inference", "admin"
SCOPES = frozenset({INFERENCE, ADMIN})
KEY_PREFIX = "sk-llmgw-"
ALL_MODELS = "*"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """One API key: its name, its digest (never the key) and what it may do."""
    name: str
    sha256: str
    models: frozenset[str]      # ids or aliases, casefolded as the catalog's names; "*": all
    scopes: frozenset[str]
    priority: int | None = None  # its requests' class (core/priority); None: the model's

    def may_use(self, model_id: str, names: frozenset[str] = frozenset()) -> bool:
        """names: every name the model answers to (the catalog's, casefolded)."""
        return ALL_MODELS in self.models or model_id.casefold() in self.models \
            or not self.models.isdisjoint(names)


@dataclass(frozen=True)
class KeyRing:
    """The configured API keys; identifies the one a request presents."""
    keys: tuple[ApiKey, ...]

    def identify(self, presented: str | None, scope: str) -> ApiKey:
        """The key presented, if it is known and has the scope; else the error to answer."""
        if not presented:
            raise MissingApiKey("this gateway needs an API key: send it as "
                                "'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        wanted = digest(presented)
        for key in self.keys:   # compare_digest: the time taken says nothing of the key
            if hmac.compare_digest(key.sha256, wanted):
                if scope not in key.scopes:
                    raise ScopeNotAllowed(
                        f"the API key {key.name!r} has no {scope!r} scope (it has: "
                        f"{', '.join(sorted(key.scopes)) or 'none'})", key=key.name)
                return key
        raise InvalidApiKey("the API key is not valid")


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key from `Authorization: Bearer KEY`, else from `x-api-key`."""
    if authorization:
        kind, _, value = authorization.strip().partition(" ")
        if kind.lower() == "bearer" and value.strip():
            return value.strip()
    return x_api_key.strip() if x_api_key and x_api_key.strip() else None


def check_model(key: ApiKey | None, model_id: str, names: frozenset[str]) -> None:
    if key is not None and not key.may_use(model_id, names):
        raise ModelNotAllowed(f"the API key {key.name!r} may not use the model {model_id!r}",
                              param="model", key=key.name)


def parse_keys(data: Mapping[str, Any], where: str) -> KeyRing:
    """The keys file's TOML, validated whole."""
    unknown = set(data) - {"keys"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; the file "
                          "holds [keys.NAME] tables")
    table = data.get("keys", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: keys must be a table of [keys.NAME] tables")
    keys, seen = [], set()
    for name, entry in table.items():
        at = f"{where} [keys.{name}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at}: must be a table")
        if unknown := set(entry) - {"sha256", "models", "scopes", "priority"}:
            raise ConfigError(f"{at}: unknown key(s) {', '.join(sorted(unknown))}")
        sha = entry.get("sha256")
        if not isinstance(sha, str) or len(sha) != 64 or \
                any(c not in "0123456789abcdef" for c in sha):
            raise ConfigError(f"{at}: sha256 must be the key's SHA-256 as 64 lowercase hex "
                              "digits (`llm-gateway key new NAME` prints it)")
        if sha in seen:
            raise ConfigError(f"{at}: the same key is listed twice")
        seen.add(sha)
        models = entry.get("models", [ALL_MODELS])
        scopes = entry.get("scopes", [INFERENCE])
        for value, what in ((models, "models"), (scopes, "scopes")):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{at}: {what} must be a list of strings")
        if bad := set(scopes) - SCOPES:
            raise ConfigError(f"{at}: unknown scope(s) {', '.join(sorted(bad))}; scopes are "
                              f"{' and '.join(sorted(SCOPES))}")
        priority = None
        if "priority" in entry and (priority := parse_class(entry["priority"])) is None:
            raise ConfigError(f"{at}: priority must be one of {', '.join(CLASSES)}")
        keys.append(ApiKey(name, sha, frozenset(m.strip().casefold() for m in models),
                           frozenset(scopes), priority))
    return KeyRing(tuple(keys))
