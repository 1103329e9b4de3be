"""Call records as a time series for the status page's charts: the pure part.

A window (15m, 1h, 24h) is cut into buckets of step_s seconds; the records adapter
(adapters/record_series) groups the calls of each (bucket, model) in SQL, and this module
turns its cells into the answer of GET /admin/series. The definitions below are what the
SQL says; tests/unit/test_series.py computes them again record by record and holds the
SQL to them. The page merges the histograms
itself (over models, over buckets) and reads percentiles from them, so each cell carries
counts per latency bin, not percentiles; the window's own percentiles (`totals`) are exact,
ranked in SQL.

What the page shows, word for word:

- calls: every record.
- rejected: answered 429 or 503, the gateway refusing to admit the call (queue full, no
  engine place, not enough memory, the model still downloading ...).
- errors: any other status >= 400, and calls that did not end well with a status below
  400 (the client disconnected, the engine failed mid-stream).
- tokens_out: completion tokens of the calls answered 200 with completion_tokens > 0;
  gen_ms: over those same calls, the generation time, latency minus time to first token
  (minus nothing where there was no first event: a whole answer at once);
  tokens/s = tokens_out / (gen_ms / 1000).
- latency: arrival to last byte; ttft: arrival to the first streamed event (calls that
  had one). A histogram's bin i counts the values in (bounds[i-1], bounds[i]]: a value on a
  bound is in that bound's bin; the last bin is above the last bound.
- Records without a model (a request refused before its model was known) are the cells
  of model null, not listed in `models`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gatewayd.core.errors import InvalidRequest

# 1-2-3-5-7 per decade up to 100 ms (short answers, errors), then coarser up to 5 min
# (long generations): 31 bins, a few hundred bytes per cell
LATENCY_BOUNDS_MS: tuple[int, ...] = (
    1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100, 150, 200, 300, 500, 700, 1000, 1500, 2000,
    3000, 5000, 7000, 10000, 15000, 20000, 30000, 60000, 120000, 300000)
BINS = len(LATENCY_BOUNDS_MS) + 1
REJECTED_STATUSES: tuple[int, ...] = (429, 503)
PERCENTILES: tuple[int, ...] = (50, 95)   # the totals' exact ones, in percent


@dataclass(frozen=True)
class Window:
    name: str
    span_s: int
    step_s: int


# each about 60-70 buckets: enough points for a line, few enough cells to send
WINDOWS: dict[str, Window] = {w.name: w for w in (
    Window("15m", 15 * 60, 15), Window("1h", 3600, 60), Window("24h", 86400, 1200))}
DEFAULT_WINDOW = "1h"


def window(name: str | None) -> Window:
    """The window a query names (None: the default); InvalidRequest for any other."""
    chosen = WINDOWS.get(DEFAULT_WINDOW if name is None else name)
    if chosen is None:
        raise InvalidRequest(f"window must be one of {', '.join(WINDOWS)}, not {name!r}",
                             param="window")
    return chosen


@dataclass(frozen=True)
class Frame:
    """A window placed in time: buckets of step_s from start (a multiple of step_s, so
    that the same bucket keeps its edges from one refresh to the next); the last bucket
    holds now and is partial."""
    window: Window
    start: int
    buckets: int
    now: float

    @property
    def step_s(self) -> int:
        return self.window.step_s

    @property
    def end(self) -> int:
        """The end of the last bucket: the calls in [start, end) are in the frame."""
        return self.start + self.buckets * self.step_s


def frame(w: Window, now: float) -> Frame:
    start = math.floor((now - w.span_s) / w.step_s) * w.step_s
    # floor + 1, not ceil: where now falls on a bucket's edge, the bucket it opens is
    # the frame's last, so a call that arrives at now has a bucket
    return Frame(w, start, bucket_index(now, start, w.step_s) + 1, now)


def bucket_index(ts: float, start: int, step_s: int) -> int:
    return math.floor((ts - start) / step_s)


def rank(percent: int, n: int) -> int:
    """The nearest rank (1-based) of a percentile among n sorted values: ceil(p * n),
    in integers (0.95 * n in floats can land a hair above a whole number)."""
    return max(1, -(-percent * n // 100))


def rank_plan(counts: list[int], percents: tuple[int, ...] = PERCENTILES
              ) -> tuple[list[int], dict[int, int]]:
    """Where the exact percentiles of a model's values are, from their histogram: the
    bins that hold them, and each percentile's rank among the values of those bins
    sorted (the ranker sorts only those, not the whole window). Empty: ([], {})."""
    n = sum(counts)
    if n == 0:
        return [], {}
    at: dict[int, tuple[int, int]] = {}   # percent: (its bin, its rank within the bin)
    for percent in percents:
        wanted, below = rank(percent, n), 0
        for i, count in enumerate(counts):
            if below + count >= wanted:
                at[percent] = (i, wanted - below)
                break
            below += count
    bins = sorted({b for b, _ in at.values()})
    return bins, {percent: sum(counts[b] for b in bins if b < i) + r
                  for percent, (i, r) in at.items()}


def bin_range(i: int, bounds: tuple[int, ...] = LATENCY_BOUNDS_MS
              ) -> tuple[int | None, int | None]:
    """Bin i's values: above the first (None: no lower end), at most the second (None:
    no upper end)."""
    return (bounds[i - 1] if i > 0 else None, bounds[i] if i < len(bounds) else None)


def tokens_per_s(tokens: int, gen_ms: float) -> float | None:
    if tokens <= 0 or gen_ms <= 0:
        return None
    return tokens / (gen_ms / 1000)


@dataclass
class Cell:
    """One (bucket, model)'s calls, as the page gets them."""
    model: str | None
    bucket: int
    calls: int = 0
    errors: int = 0
    rejected: int = 0
    tokens_out: int = 0
    gen_ms: float = 0.0
    latency: list[int] = field(default_factory=lambda: [0] * BINS)
    ttft: list[int] = field(default_factory=lambda: [0] * BINS)

    def add_counts(self, other: Cell) -> None:
        """Another cell's counts and generation figures added to these (not its bins)."""
        self.calls += other.calls
        self.errors += other.errors
        self.rejected += other.rejected
        self.tokens_out += other.tokens_out
        self.gen_ms += other.gen_ms

    def as_json(self) -> dict[str, Any]:
        return {"model": self.model, "bucket": self.bucket, "calls": self.calls,
                "errors": self.errors, "rejected": self.rejected,
                "tokens_out": self.tokens_out, "gen_ms": round(self.gen_ms, 1),
                "latency": self.latency, "ttft": self.ttft}


# per model, per measure ("latency", "ttft"): the value at each percentile of PERCENTILES
Ranked = dict[str | None, dict[str, dict[int, float]]]


def answer(f: Frame, cells: list[Cell], ranked: Ranked) -> dict[str, Any]:
    """GET /admin/series's answer: the cells in (bucket, model) order, and per model the
    whole frame's figures (its counts are the cells' sums; its percentiles are ranked)."""
    def order(model: str | None) -> tuple[bool, str]:
        return (model is None, model or "")   # the calls without a model last

    cells = sorted(cells, key=lambda c: (c.bucket, order(c.model)))
    per_model: dict[str | None, Cell] = {}
    for c in cells:
        per_model.setdefault(c.model, Cell(c.model, -1)).add_counts(c)
    totals = []
    for model in sorted(per_model, key=order):
        t = per_model[model]
        values = ranked.get(model, {})
        totals.append({
            "model": model, "calls": t.calls, "errors": t.errors, "rejected": t.rejected,
            **{f"{measure}_p{p}_ms": _ms(values.get(measure, {}).get(p))
               for measure in ("latency", "ttft") for p in PERCENTILES},
            "tokens_per_s": _round(tokens_per_s(t.tokens_out, t.gen_ms))})
    return {
        "window": f.window.name, "start": f.start, "step_s": f.step_s, "buckets": f.buckets,
        "now": round(f.now, 3), "latency_bounds_ms": list(LATENCY_BOUNDS_MS),
        "models": sorted(m for m in per_model if m is not None),
        "series": [c.as_json() for c in cells],
        "totals": totals}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
