"""The call records as a time series (GET /admin/series): the SQL over records.db.

Two steps, in one read transaction (so that the second sees the rows the first counted,
while the writer thread goes on appending):

1. One GROUP BY over the frame's calls: per (bucket, model, latency bin, TTFT bin), the
   count, errors, rejected, tokens and generation time. The bins are a CASE over the
   bounds (a binary search), so rows never come into Python one by one: what comes is a
   row per bucket, model and pair of bins (tens of thousands for a busy day, not its
   million calls), folded here into each (bucket, model)'s two histograms. Grouping by
   the bins beat counting each of the 62 bins in its own sum() per (bucket, model):
   SQLite steps every aggregate for every row (docs/benchmarks.md, "Figures behind
   choices in the code").
2. The exact percentiles of each model's latency and TTFT: its histogram says which bins
   hold them (core.series.rank_plan), so SQLite sorts only those bins' values and picks
   the ranks, instead of ranking the whole window.

The definitions (rejected, errors, tokens/s ...) are in core.series's docstring;
tests/unit/test_series.py computes them again record by record and holds this SQL to them.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

from gatewayd.core import series
from gatewayd.core.series import LATENCY_BOUNDS_MS, Cell, Frame, Ranked

MEASURES = {"latency": "latency_ms", "ttft": "ttft_ms"}


def _bin_sql(column: str, lo: int = 0, hi: int = len(LATENCY_BOUNDS_MS)) -> str:
    """The histogram bin of column as SQL, a binary search over the bounds (five
    comparisons a row, not up to thirty): bins lo..hi, column known to be in them."""
    if lo == hi:
        return str(lo)
    mid = (lo + hi) // 2
    return (f"CASE WHEN {column} <= {LATENCY_BOUNDS_MS[mid]} THEN {_bin_sql(column, lo, mid)}"
            f" ELSE {_bin_sql(column, mid + 1, hi)} END")


_REJECTED = f"status IN ({', '.join(map(str, series.REJECTED_STATUSES))})"
_COUNTS_TOKENS = "status = 200 AND completion_tokens > 0"
# (the constants are the core's: nothing from a request is formatted into SQL)
_CELLS = f"""
    SELECT CAST((ts - :start) / :step AS INTEGER) AS bucket, model,
           {_bin_sql("latency_ms")} AS latency_bin,
           CASE WHEN ttft_ms IS NOT NULL THEN {_bin_sql("ttft_ms")} END AS ttft_bin,
           count(*),
           sum(NOT {_REJECTED} AND (status >= 400 OR outcome != 'ok')),
           sum({_REJECTED}),
           sum(CASE WHEN {_COUNTS_TOKENS} THEN completion_tokens ELSE 0 END),
           sum(CASE WHEN {_COUNTS_TOKENS} THEN latency_ms - coalesce(ttft_ms, 0) ELSE 0 END)
    FROM calls
    WHERE ts >= :start AND ts < :end {{model}}
    GROUP BY bucket, model, latency_bin, ttft_bin"""


def read(path: Path, frame: Frame, model: str | None = None) -> dict[str, Any]:
    """GET /admin/series's answer for frame (model: that model's calls only). Blocking:
    on the loop, load() runs it in a thread. No records file yet: an empty series."""
    if not path.exists():
        return series.answer(frame, [], {})
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        db.execute("BEGIN")   # one snapshot for both steps
        cells = _cells(db, frame, model)
        ranked = _ranked(db, frame, cells)
    finally:
        db.close()
    return series.answer(frame, cells, ranked)


async def load(path: Path, frame: Frame, model: str | None = None) -> dict[str, Any]:
    """read(), in a thread: the event loop never waits on the database."""
    return await asyncio.to_thread(read, path, frame, model)


def _cells(db: sqlite3.Connection, frame: Frame, model: str | None) -> list[Cell]:
    args: dict[str, Any] = {"start": frame.start, "step": frame.step_s, "end": frame.end}
    if model is not None:
        args["model"] = model
    sql = _CELLS.format(model="AND model = :model" if model is not None else "")
    cells: dict[tuple[int, str | None], Cell] = {}
    for (bucket, name, latency_bin, ttft_bin, calls, errors, rejected, tokens,
         gen_ms) in db.execute(sql, args):
        cell = cells.get((bucket, name))
        if cell is None:
            cell = cells[bucket, name] = Cell(name, bucket)
        cell.calls += calls
        cell.errors += errors
        cell.rejected += rejected
        cell.tokens_out += tokens
        cell.gen_ms += gen_ms
        cell.latency[latency_bin] += calls
        if ttft_bin is not None:
            cell.ttft[ttft_bin] += calls
    return list(cells.values())


def _ranked(db: sqlite3.Connection, frame: Frame, cells: list[Cell]) -> Ranked:
    """Per model and measure, the values at core.series.PERCENTILES (exact: nearest rank)."""
    histograms: dict[str | None, dict[str, list[int]]] = {}
    for cell in cells:
        per = histograms.setdefault(cell.model, {m: [0] * series.BINS for m in MEASURES})
        for measure in MEASURES:
            per[measure] = [a + b for a, b in zip(per[measure], getattr(cell, measure),
                                                   strict=True)]
    ranked: Ranked = {}
    for model, per in histograms.items():
        for measure, column in MEASURES.items():
            bins, ranks = series.rank_plan(per[measure])
            if not bins:
                continue
            found = dict(db.execute(
                f"""SELECT rank, value FROM (
                        SELECT {column} AS value, row_number() OVER (ORDER BY {column}) AS rank
                        FROM calls
                        WHERE model IS :model AND ts >= :start AND ts < :end
                          AND ({" OR ".join(_in_bin(column, b) for b in bins)}))
                    WHERE rank IN ({", ".join(map(str, sorted(set(ranks.values()))))})""",
                {"model": model, "start": frame.start, "end": frame.end}))
            ranked.setdefault(model, {})[measure] = {
                percent: found[r] for percent, r in ranks.items() if r in found}
    return ranked


def _in_bin(column: str, i: int) -> str:
    lo, hi = series.bin_range(i)
    return " AND ".join([*([f"{column} > {lo}"] if lo is not None else []),
                         *([f"{column} <= {hi}"] if hi is not None else [])])
