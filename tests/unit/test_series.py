"""The call-record time series: core/series.py (pure), and adapters/record_series.py's SQL
over a real records file written by the records module's own writer."""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from pathlib import Path
from typing import Any

import pytest

from gatewayd.adapters import record_series, records
from gatewayd.adapters.records import CallRecord
from gatewayd.core import series
from gatewayd.core.errors import InvalidRequest
from gatewayd.core.series import BINS, LATENCY_BOUNDS_MS, Frame

HOUR = series.WINDOWS["1h"]


# --- the definitions (core/series.py's docstring), one call at a time: the reference the
# SQL is held to, written here from the words, not from the code they check

def bin_index(value_ms: float) -> int:
    """The histogram bin of a value: the first bound >= it (len(bounds) above them all)."""
    return bisect_left(LATENCY_BOUNDS_MS, value_ms)


def is_rejected(status: int) -> bool:
    return status in (429, 503)


def is_error(status: int, outcome: str) -> bool:
    return not is_rejected(status) and (status >= 400 or outcome != "ok")


def counts_tokens(status: int, completion_tokens: int | None) -> bool:
    """Whether a call's tokens and generation time go into tokens/s."""
    return status == 200 and (completion_tokens or 0) > 0


def generation_ms(latency_ms: float, ttft_ms: float | None) -> float:
    return latency_ms - (ttft_ms or 0.0)


# --- the pure part ---------------------------------------------------------------------

def test_the_three_windows_and_nothing_else() -> None:
    assert {n: (w.span_s, w.step_s) for n, w in series.WINDOWS.items()} == {
        "15m": (900, 15), "1h": (3600, 60), "24h": (86400, 1200)}
    assert series.window(None) is HOUR
    for bad in ("2h", "", "1H", "3600"):
        with pytest.raises(InvalidRequest) as e:
            series.window(bad)
        assert e.value.status == 400 and e.value.body()["error"]["param"] == "window"


@pytest.mark.parametrize(("name", "now", "start", "buckets"), [
    ("15m", 1000.5, 90, 61),          # floor((1000.5 - 900) / 15) * 15; the last is partial
    ("1h", 36_000.0, 32_400, 61),     # now on a bucket's edge opens the last bucket
    ("1h", 36_059.9, 32_400, 61),
    ("24h", 200_000.0, 112_800, 73),       # (200000 - 86400) // 1200 * 1200
])
def test_a_frame_starts_on_a_multiple_of_its_step_and_ends_with_now(
        name: str, now: float, start: int, buckets: int) -> None:
    f = series.frame(series.WINDOWS[name], now)
    assert (f.start, f.buckets, f.step_s) == (start, buckets, series.WINDOWS[name].step_s)
    assert f.start % f.step_s == 0 and f.start <= now - f.window.span_s < f.start + f.step_s
    assert series.bucket_index(now, f.start, f.step_s) == f.buckets - 1
    assert f.end > now and series.bucket_index(f.start, f.start, f.step_s) == 0
    assert series.bucket_index(f.start + f.step_s - 0.001, f.start, f.step_s) == 0
    assert series.bucket_index(f.start + f.step_s, f.start, f.step_s) == 1


def test_tokens_per_second() -> None:
    assert series.tokens_per_s(50, 1000.0) == 50.0
    assert series.tokens_per_s(0, 1000.0) is None and series.tokens_per_s(5, 0.0) is None


def test_nearest_rank_is_ceil_p_n_in_integers() -> None:
    assert [series.rank(50, n) for n in (1, 2, 3, 10, 11)] == [1, 1, 2, 5, 6]
    assert [series.rank(95, n) for n in (1, 19, 20, 21, 60, 100)] == [1, 19, 19, 20, 57, 95]
    for n in range(1, 500):
        for p in (50, 95):
            assert series.rank(p, n) == math.ceil(p * n / 100 - 1e-9)


def test_the_rank_plan_names_the_bins_and_the_ranks_within_them() -> None:
    counts = [0] * BINS
    counts[2], counts[5], counts[9] = 10, 5, 5      # 20 values: p50 the 10th, p95 the 19th
    assert series.rank_plan(counts) == ([2, 9], {50: 10, 95: 10 + 4})
    counts[2] = 3                                   # 13 values: the 7th (bin 5), the 13th
    assert series.rank_plan(counts) == ([5, 9], {50: 4, 95: 5 + 5})
    assert series.rank_plan([0] * BINS) == ([], {})
    one = [0] * BINS
    one[30] = 1
    assert series.rank_plan(one) == ([30], {50: 1, 95: 1})


# --- the SQL over a real records file ----------------------------------------------------

T0 = 1_800_000_000      # a multiple of 60 and of 1200


def write(path: Path, rows: list[CallRecord]) -> None:
    """Through the records module's own writer (outside a loop: handed over at once)."""
    writer = records.RecordWriter(path)
    for r in rows:
        writer.add(r)
    writer.close()


def call(ts: float, model: str | None = "a", status: int = 200, outcome: str = "ok",
         latency_ms: float = 100.0, ttft_ms: float | None = None,
         completion_tokens: int | None = None) -> CallRecord:
    return CallRecord(ts=ts, method="POST", endpoint="/v1/chat/completions", model=model,
                      status=status, outcome=outcome, latency_ms=latency_ms, ttft_ms=ttft_ms,
                      completion_tokens=completion_tokens)


def hist(**at: int) -> list[int]:
    """A histogram: hist(b3=2) has 2 in bin 3."""
    counts = [0] * BINS
    for key, n in at.items():
        counts[int(key[1:])] = n
    return counts


def test_calls_land_in_their_bucket_and_bin(tmp_path: Path) -> None:
    f = series.frame(HOUR, T0 + 0.5)               # start T0 - 3600, 61 buckets
    start = T0 - 3600
    assert (f.start, f.buckets) == (start, 61)
    path = tmp_path / "records.db"
    write(path, [
        call(start - 0.001, latency_ms=5),                      # before the frame: out
        call(start, latency_ms=5, ttft_ms=5),                   # bucket 0, both on bound 5
        call(start + 59.999, latency_ms=5.001, ttft_ms=0.2),    # bucket 0, bins 4 and 0
        call(start + 60, status=429, outcome="error", latency_ms=0.3),     # bucket 1
        call(start + 61, status=503, outcome="error", latency_ms=1),       # bucket 1
        call(start + 62, status=404, outcome="error", latency_ms=1.0001),  # bucket 1
        call(start + 63, status=200, outcome="disconnected", latency_ms=400_000),
        call(T0 + 0.25, model=None, status=400, outcome="error", latency_ms=2),  # the last
    ])
    out = record_series.read(path, f)
    assert (out["window"], out["start"], out["step_s"], out["buckets"]) == (
        "1h", start, 60, 61)
    assert out["now"] == T0 + 0.5 and out["latency_bounds_ms"] == list(LATENCY_BOUNDS_MS)
    assert out["models"] == ["a"]                   # the calls without a model: not listed
    cells = {(c["bucket"], c["model"]): c for c in out["series"]}
    assert list(cells) == [(0, "a"), (1, "a"), (60, None)]
    assert cells[0, "a"] == {"model": "a", "bucket": 0, "calls": 2, "errors": 0,
                             "rejected": 0, "tokens_out": 0, "gen_ms": 0.0,
                             "latency": hist(b3=1, b4=1), "ttft": hist(b3=1, b0=1)}
    c1 = cells[1, "a"]
    assert (c1["calls"], c1["errors"], c1["rejected"]) == (4, 2, 2)
    assert c1["latency"] == hist(b0=2, b1=1, b30=1) and c1["ttft"] == hist()
    assert cells[60, None]["latency"] == hist(b1=1) and cells[60, None]["errors"] == 1
    assert [t["model"] for t in out["totals"]] == ["a", None]
    assert out["totals"][0] == {
        "model": "a", "calls": 6, "errors": 2, "rejected": 2,
        "latency_p50_ms": 1.0, "latency_p95_ms": 400_000.0,     # of 0.3 1 1.0001 5 5.001 4e5
        "ttft_p50_ms": 0.2, "ttft_p95_ms": 5.0, "tokens_per_s": None}
    assert out["totals"][1]["ttft_p50_ms"] is None and out["totals"][1]["calls"] == 1
    # one model only
    only = record_series.read(path, f, "a")
    assert only["models"] == ["a"] and {c["model"] for c in only["series"]} == {"a"}
    assert record_series.read(path, f, "nobody")["series"] == []


def test_a_value_on_a_bound_is_in_that_bounds_bin(tmp_path: Path) -> None:
    assert len(LATENCY_BOUNDS_MS) == 30 and BINS == 31
    assert list(LATENCY_BOUNDS_MS) == sorted(set(LATENCY_BOUNDS_MS))
    assert series.bin_range(0) == (None, 1) and series.bin_range(30) == (300_000, None)
    f = series.frame(HOUR, T0)
    values = [v for bound in LATENCY_BOUNDS_MS for v in (bound, bound + 0.001)]
    values += [0, 0.5, 1e9]
    path = tmp_path / "records.db"   # one model per value: its own histogram
    write(path, [call(T0 - 1, model=str(i), latency_ms=v) for i, v in enumerate(values)])
    bins = {int(c["model"]): c["latency"].index(1) for c in record_series.read(path, f)["series"]}
    assert [bins[i] for i in range(len(values))] == [bin_index(v) for v in values]
    for i, bound in enumerate(LATENCY_BOUNDS_MS):
        assert bins[2 * i] == i and bins[2 * i + 1] == i + 1 and series.bin_range(i)[1] == bound


CASES = [   # (status, outcome): (rejected, error)
    ((200, "ok"), (False, False)),
    ((200, "disconnected"), (False, True)),     # a stream the client left
    ((200, "engine_failed"), (False, True)),    # an engine that failed mid-stream
    ((0, "disconnected"), (False, True)),       # left before any answer
    ((429, "error"), (True, False)),            # over max_concurrency
    ((503, "error"), (True, False)),            # queue full, no place, downloading ...
    ((503, "disconnected"), (True, False)),
    ((404, "error"), (False, True)),
    ((400, "error"), (False, True)),
    ((502, "engine_failed"), (False, True)),
    ((500, "error"), (False, True)),
]


def test_rejected_and_errors_are_apart(tmp_path: Path) -> None:
    path = tmp_path / "records.db"   # one model per case
    write(path, [call(T0 - 1, model=str(i), status=status, outcome=outcome)
                 for i, ((status, outcome), _) in enumerate(CASES)])
    cells = {int(c["model"]): c for c in record_series.read(path, series.frame(HOUR, T0))
             ["series"]}
    assert [(bool(cells[i]["rejected"]), bool(cells[i]["errors"]))
            for i in range(len(CASES))] == [want for _, want in CASES]
    assert [(is_rejected(st), is_error(st, out)) for (st, out), _ in CASES] == \
        [want for _, want in CASES]   # the reference says the same


def test_tokens_per_second_and_exact_percentiles_on_a_known_set(tmp_path: Path) -> None:
    f = series.frame(series.WINDOWS["15m"], T0)
    path = tmp_path / "records.db"
    rows = [call(T0 - 10 - i * 0.001, latency_ms=float(v), ttft_ms=float(v) / 10)
            for i, v in enumerate(random.Random(3).sample(range(1, 101), 100))]
    rows += [   # tokens: 200 answers with tokens count; the others do not
        call(T0 - 30, model="b", latency_ms=1200, ttft_ms=200, completion_tokens=50),
        call(T0 - 30, model="b", latency_ms=600, completion_tokens=30),   # no first event
        call(T0 - 30, model="b", status=200, outcome="disconnected", latency_ms=900,
             ttft_ms=100, completion_tokens=7),        # counted: a 200 with tokens
        call(T0 - 30, model="b", status=500, outcome="error", latency_ms=999,
             completion_tokens=99),
        call(T0 - 30, model="b", latency_ms=50, completion_tokens=0),
    ]
    write(path, rows)
    out = record_series.read(path, f)
    totals = {t["model"]: t for t in out["totals"]}
    a = totals["a"]
    assert (a["latency_p50_ms"], a["latency_p95_ms"]) == (50.0, 95.0)   # 1..100 ms
    assert (a["ttft_p50_ms"], a["ttft_p95_ms"]) == (5.0, 9.5)
    b = totals["b"]
    assert b["tokens_per_s"] == round((50 + 30 + 7) / ((1000 + 600 + 800) / 1000), 2)
    cell = next(c for c in out["series"] if c["model"] == "b")
    assert (cell["tokens_out"], cell["gen_ms"]) == (87, 2400.0)
    assert cell["bucket"] == out["buckets"] - 3    # T0 - 30: two whole buckets before T0's
    assert (b["latency_p50_ms"], b["latency_p95_ms"]) == (900.0, 1200.0)
    assert (b["ttft_p50_ms"], b["ttft_p95_ms"]) == (100.0, 200.0)


def test_a_missing_records_file_is_an_empty_series(tmp_path: Path) -> None:
    f = series.frame(HOUR, T0)
    out = record_series.read(tmp_path / "absent.db", f)
    assert (out["series"], out["totals"], out["models"]) == ([], [], [])
    assert out["buckets"] == 61 and out["start"] == T0 - 3600


def reference(rows: list[CallRecord], f: Frame) -> dict[str, Any]:
    """The answer computed record by record from the definitions above."""
    cells: dict[tuple[int, str | None], series.Cell] = {}
    values: dict[str | None, dict[str, list[float]]] = {}
    for r in rows:
        if not f.start <= r.ts < f.end:
            continue
        key = (series.bucket_index(r.ts, f.start, f.step_s), r.model)
        c = cells.setdefault(key, series.Cell(r.model, key[0]))
        c.calls += 1
        c.errors += is_error(r.status, r.outcome)
        c.rejected += is_rejected(r.status)
        if counts_tokens(r.status, r.completion_tokens):
            c.tokens_out += r.completion_tokens or 0
            c.gen_ms += generation_ms(r.latency_ms, r.ttft_ms)
        c.latency[bin_index(r.latency_ms)] += 1
        v = values.setdefault(r.model, {"latency": [], "ttft": []})
        v["latency"].append(r.latency_ms)
        if r.ttft_ms is not None:
            c.ttft[bin_index(r.ttft_ms)] += 1
            v["ttft"].append(r.ttft_ms)
    ranked: series.Ranked = {
        model: {m: {p: sorted(xs)[series.rank(p, len(xs)) - 1] for p in series.PERCENTILES}
                for m, xs in per.items() if xs}
        for model, per in values.items()}
    return series.answer(f, list(cells.values()), ranked)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_sql_says_what_the_definitions_say(tmp_path: Path, seed: int) -> None:
    """Random calls (values on the bounds among them) read through SQL equal the answer
    the core's definitions give record by record."""
    rnd = random.Random(seed)
    f = series.frame(series.WINDOWS["15m"], T0 + rnd.random() * 15)
    rows = []
    for _ in range(1500):
        status = rnd.choice([200] * 6 + [0, 400, 404, 429, 500, 502, 503])
        # in eighths of a ms: sums come out the same in any order, SQL's or ours
        latency = round(8 * rnd.choice([rnd.choice(LATENCY_BOUNDS_MS),
                                         rnd.lognormvariate(6, 2), rnd.random() * 3])) / 8
        rows.append(call(
            f.start - 60 + rnd.random() * (f.end - f.start + 120),
            model=rnd.choice(["a", "b", "c", None]), status=status,
            outcome=rnd.choice(["ok"] * 5 + ["error", "disconnected", "engine_failed"]),
            latency_ms=latency,
            ttft_ms=rnd.choice([None, round(8 * latency * rnd.random()) / 8,
                                 float(rnd.choice((1, 5, 70)))]),
            completion_tokens=rnd.choice([None, 0, rnd.randint(1, 900)])))
    path = tmp_path / "records.db"
    write(path, rows)
    assert record_series.read(path, f) == reference(rows, f)
    assert record_series.read(path, f, "b") == reference([r for r in rows if r.model == "b"],
                                                         f)
