"""Remote upstreams: OpenAI-compatible servers elsewhere that answer some models. Pure.

An `[upstreams.NAME]` table names a base URL (what an OpenAI SDK is given as
base_url, e.g. `http://gpu-box:8080/v1`) and the models it serves: listed, or
discovered from its `GET /models` and refreshed with every health probe. The
gateway stays the one endpoint its clients know: a remote model is asked for by
name like a local one, through the same relay, into the same records.

Which answers a name (adapters/remote_upstreams.py holds the live state):
- a local model of that name is preferred; it goes remote only when it opted in
  (`spill_over = true`) and cannot take the request within its own wait (queue
  full, no memory, no place, start failed) — then to an upstream serving one of
  its names;
- otherwise the upstreams serving that name, in configuration order: the first
  that is not known to be down and has room for another request.

Health: each upstream is probed (its /models) every `health_interval_s` while up.
A failed probe, or a request that could not connect, marks it down: requests for
it fail at once with 503 upstream_unreachable naming it (no waiting out a
timeout), and probes back off 1, 2, 4 ... s up to the interval until one answers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gatewayd.core.errors import ConfigError

FIRST_BACKOFF_S = 1.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_HEALTH_INTERVAL_S = 10.0
# the OpenAI paths a remote is asked on: our /v1/X goes to its base URL + /X
REMOTE_PREFIX = "/v1/"


@dataclass(frozen=True)
class UpstreamConfig:
    """One `[upstreams.NAME]` table."""

    name: str
    url: str                              # base URL without its trailing slash
    models: tuple[str, ...] | None = None   # None: discovered from GET <url>/models
    api_key_file: Path | None = None
    api_key_credential: str | None = None   # a systemd credential (LoadCredential=)
    tls_verify: bool = True
    ca_file: Path | None = None
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float | None = None   # None: the gateway's read_timeout_s
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S
    max_concurrency: int | None = None    # requests at once; above: the next upstream, or 429
    api_key: str | None = field(default=None, repr=False)   # read by the adapter

    @property
    def discovers(self) -> bool:
        return self.models is None

    @property
    def shown_url(self) -> str:
        """The URL as it may be shown (status, logs, errors): without user:password@."""
        return without_userinfo(self.url)

    def redact(self, text: str) -> str:
        """text with this upstream's credentials taken out (an error's words may quote
        the URL)."""
        if self.url != self.shown_url:
            text = text.replace(self.url, self.shown_url)
            userinfo = urlsplit(self.url).netloc.rpartition("@")[0]
            text = text.replace(userinfo, "***")
        if self.api_key:
            text = text.replace(self.api_key, "***")
        return text

    def url_for(self, path_qs: str) -> str:
        """Our /v1/chat/completions?x → <base>/chat/completions?x."""
        return self.url + path_qs[len(REMOTE_PREFIX) - 1:]


def without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


class UpstreamState(StrEnum):
    UNKNOWN = "unknown"   # not probed yet: requests are tried
    UP = "up"
    DOWN = "down"         # requests refused at once until a probe answers


@dataclass
class Health:
    """One upstream's health, from probes and from requests' connection failures."""

    interval_s: float
    state: UpstreamState = UpstreamState.UNKNOWN
    failures: int = 0              # probes or connections failed in a row
    last_error: str | None = None
    next_probe_at: float = 0.0

    def succeeded(self, now: float) -> None:
        self.state, self.failures, self.last_error = UpstreamState.UP, 0, None
        self.next_probe_at = now + self.interval_s

    def failed(self, now: float, error: str) -> None:
        self.state, self.last_error = UpstreamState.DOWN, error
        self.failures += 1
        self.next_probe_at = now + self.backoff_s()

    def backoff_s(self) -> float:
        if self.failures == 0:
            return self.interval_s
        return min(self.interval_s, FIRST_BACKOFF_S * 2.0 ** (self.failures - 1))

    def retry_after_s(self, now: float) -> float:
        return max(0.0, self.next_probe_at - now)


def discovered_ids(body: Any) -> list[str]:
    """Model ids from an OpenAI `GET /models` answer ({"data": [{"id": ...}]})."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError("not an OpenAI model list (no \"data\" array)")
    return [m["id"] for m in body["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]


@dataclass(frozen=True)
class RemoteModel:
    """A model served by a remote upstream, under the name it knows it by."""
    upstream: str
    id: str          # the name the upstream knows it by (sent as "model")


class RemoteNames:
    """Which upstreams answer which names (casefolded), in configuration order."""

    def __init__(self, served: Iterable[tuple[str, Sequence[str]]] = ()) -> None:
        self._by_name: dict[str, list[RemoteModel]] = {}
        self._order: list[RemoteModel] = []
        for upstream, ids in served:
            for model_id in ids:
                remote = RemoteModel(upstream, model_id)
                self._order.append(remote)
                self._by_name.setdefault(model_id.casefold(), []).append(remote)

    def candidates(self, names: Iterable[str]) -> list[RemoteModel]:
        """Every remote model answering any of names (a name, or a local model's names),
        each upstream once, in configuration order."""
        found: dict[str, RemoteModel] = {}
        for name in names:
            for remote in self._by_name.get(name.casefold(), ()):
                found.setdefault(remote.upstream, remote)
        return sorted(found.values(), key=self._order.index)

    def __iter__(self) -> Any:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


_UPSTREAM_KEYS = {"url", "models", "api_key_file", "api_key_credential", "tls_verify",
                  "ca_file", "connect_timeout_s", "read_timeout_s", "health_interval_s",
                  "max_concurrency"}


def parse_upstreams(tables: Mapping[str, Any], base: Path, where: str
                    ) -> tuple[UpstreamConfig, ...]:
    if not isinstance(tables, dict):
        raise ConfigError(f"{where}: upstreams must be a table of [upstreams.NAME] tables")
    return tuple(_parse_upstream(name, table, base, where) for name, table in tables.items())


def _parse_upstream(name: str, table: Any, base: Path, where: str) -> UpstreamConfig:
    key = f"upstreams.{name}"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [{key}] must be a table")
    unknown = sorted(set(table) - _UPSTREAM_KEYS)
    if unknown:
        raise ConfigError(f"{where}: [{key}]: unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(_UPSTREAM_KEYS))}")
    url = table.get("url")
    if not isinstance(url, str):
        raise ConfigError(f"{where}: [{key}] needs a url (the server's OpenAI base URL, "
                          "e.g. \"http://gpu-box:8080/v1\")")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: {key}.url = {without_userinfo(url)!r} is not an http:// "
                          "or https:// URL")
    if parts.query or parts.fragment:
        raise ConfigError(f"{where}: {key}.url = {without_userinfo(url)!r}: a base URL has "
                          "no ?query or #part")
    models = table.get("models")
    if models is not None and (not isinstance(models, list) or not models
                               or not all(isinstance(m, str) and m.strip() for m in models)):
        raise ConfigError(f"{where}: {key}.models must be a non-empty list of model names "
                          "(or left out: discovered from the upstream's /models)")
    key_file, credential = table.get("api_key_file"), table.get("api_key_credential")
    if key_file is not None and credential is not None:
        raise ConfigError(f"{where}: [{key}] has both api_key_file and api_key_credential; "
                          "give one")
    for option, value in (("api_key_file", key_file), ("api_key_credential", credential),
                          ("ca_file", table.get("ca_file"))):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{where}: {key}.{option} must be a non-empty string")
    if credential is not None and "/" in credential:
        raise ConfigError(f"{where}: {key}.api_key_credential is a credential's name "
                          "(LoadCredential=NAME:...), not a path")
    tls_verify = table.get("tls_verify", True)
    if not isinstance(tls_verify, bool):
        raise ConfigError(f"{where}: {key}.tls_verify must be true or false")
    limit = table.get("max_concurrency")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                              or limit < 1):
        raise ConfigError(f"{where}: {key}.max_concurrency must be a positive integer")
    return UpstreamConfig(
        name=name, url=url.rstrip("/"),
        models=tuple(models) if models is not None else None,
        api_key_file=_file(key_file, base), api_key_credential=credential,
        tls_verify=tls_verify, ca_file=_file(table.get("ca_file"), base),
        connect_timeout_s=_seconds(table, "connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S,
                                   where, key),
        read_timeout_s=_seconds(table, "read_timeout_s", None, where, key),
        health_interval_s=_seconds(table, "health_interval_s", DEFAULT_HEALTH_INTERVAL_S,
                                   where, key),
        max_concurrency=limit)


def _file(value: str | None, base: Path) -> Path | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _seconds(table: Mapping[str, Any], option: str, default: float | None, where: str,
             key: str) -> Any:
    value = table.get(option, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
            or not math.isfinite(value):   # TOML has inf and nan: no timeout at all
        raise ConfigError(f"{where}: {key}.{option} must be a positive number of seconds "
                          "(finite)")
    return float(value)
