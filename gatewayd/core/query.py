"""The query parameters of the gateway's own routes: one typed layer, deny by default. Pure.

Each admin route the gateway answers itself (and each other route that says so: the
Batch API's) names the parameters it takes and what each
is (`QUERIES`): a bounded integer, a finite number in a range, a flag, one of a few
words, or a short line of printable text. A parameter not listed, one given twice, or a
value out of its type or bounds is a 400 naming it, before the handler runs, so no value
reaches SQLite, the hub client or journalctl's argv unparsed (a number past SQLite's
integer range was a 500). A route not in `QUERIES` takes no parameters at all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gatewayd.core.errors import InvalidRequest
from gatewayd.core.series import WINDOWS

MAX_LOG_LINES = 10_000
FOLLOW_LINES = 50      # a follow's last lines before the new ones, unless ?lines= says
MAX_TEXT = 256
EPOCH_MAX = 1e11       # seconds: the year 5138, past any record's time


class Param(Protocol):
    def parse(self, name: str, raw: str) -> Any: ...


@dataclass(frozen=True)
class Int:
    low: int
    high: int

    def parse(self, name: str, raw: str) -> int:
        # ASCII digits only: int() would take " 7", "+7", "7_0" and other scripts' digits too
        text = raw[1:] if raw.startswith("-") else raw
        if not (text.isascii() and text.isdigit()) or len(raw) > 20 or \
                not self.low <= (value := int(raw)) <= self.high:
            raise InvalidRequest(f"{name} must be a whole number {self.low}..{self.high}",
                                 param=name)
        return value


@dataclass(frozen=True)
class Number:
    low: float
    high: float

    def parse(self, name: str, raw: str) -> float:
        try:
            value = float(raw) if raw.isascii() and len(raw) <= 32 else math.nan
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and self.low <= value <= self.high):
            raise InvalidRequest(f"{name} must be a number {self.low:g}..{self.high:g}",
                                 param=name)
        return value


@dataclass(frozen=True)
class Flag:
    def parse(self, name: str, raw: str) -> bool:
        if raw not in ("0", "1", "true", "false"):
            raise InvalidRequest(f"{name} is 1 or 0", param=name)
        return raw in ("1", "true")


@dataclass(frozen=True)
class OneOf:
    words: tuple[str, ...]

    def parse(self, name: str, raw: str) -> str:
        if raw not in self.words:
            raise InvalidRequest(f"{name} must be one of {', '.join(self.words)}",
                                 param=name)
        return raw


@dataclass(frozen=True)
class Text:
    """A model's name, a filter's words: printable, one line, bounded."""
    max_len: int = MAX_TEXT

    def parse(self, name: str, raw: str) -> str:
        if not raw or len(raw) > self.max_len or not raw.isprintable():
            raise InvalidRequest(f"{name} must be 1..{self.max_len} printable characters "
                                 "on one line", param=name)
        return raw


EPOCH = Number(0, EPOCH_MAX)
LOG_QUERY: Mapping[str, Param] = {"follow": Flag(), "lines": Int(1, MAX_LOG_LINES),
                                  "grep": Text(200)}
# the routes the gateway answers itself that take parameters (others take none)
QUERIES: Mapping[str, Mapping[str, Param]] = {
    "/admin/records": {"model": Text(), "endpoint": Text(), "outcome": Text(32),
                       "since": EPOCH, "until": EPOCH, "status": Int(0, 999),
                       "limit": Int(1, 10_000)},
    "/admin/series": {"window": OneOf(tuple(WINDOWS)), "model": Text()},
    "/admin/events/history": {"since": EPOCH, "limit": Int(1, 1_000_000)},
    "/admin/engines/logs": {"model": Text(), **LOG_QUERY},
    "/admin/logs": LOG_QUERY,
    "/admin/metrics": {"engines": Flag()},
    "/v1/files": {"purpose": OneOf(("batch", "batch_output")), "limit": Int(1, 10_000),
                  "after": Text(64), "order": OneOf(("asc", "desc"))},
    "/v1/batches": {"limit": Int(1, 100), "after": Text(64)},
    "/admin/batches": {"limit": Int(1, 1000)},
}


def parse_query(path: str, pairs: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """The parameters of a request to `path` (a route's path), typed; InvalidRequest (400)
    for any parameter the route does not take, given twice, or out of its type."""
    allowed = QUERIES.get(path, {})
    out: dict[str, Any] = {}
    for name, raw in pairs:
        param = allowed.get(name)
        if param is None:
            takes = ", ".join(allowed) or "none"
            raise InvalidRequest(f"{path} takes no parameter {name[:40]!r} (it takes: "
                                 f"{takes})", param=name[:40])
        if name in out:
            raise InvalidRequest(f"{name} is given twice", param=name)
        out[name] = param.parse(name, raw)
    return out
