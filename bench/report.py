"""results.json -> results.md (the verdicts against the goals, tables with ratios) and
latency.png; and the verdicts on the medians of several runs:

    python -m bench.report --runs A.json B.json C.json [--readme docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# -- the verdicts ----------------------------------------------------------------------
# Each goal reads its figures (named numbers) off one run's results, or None when the
# section was not run; its judge turns them into a row. The medians over several runs are
# taken of the figures, one by one, and judged the same way.

Figures = dict[str, float]


def _number(r: dict[str, Any], *keys: str) -> float | None:
    v: Any = r
    for k in keys:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _all(**figures: float | None) -> Figures | None:
    """The figures, or None if any is missing (its section was not run)."""
    if any(v is None for v in figures.values()):
        return None
    return {k: float(v) for k, v in figures.items() if v is not None}


def _le(a: float, b: float) -> bool:
    """a <= b; right at the boundary counts as met (the figures are rounded floats)."""
    return a <= b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def _met(figures: Figures, holds: bool) -> bool | None:
    """None when a figure is not a number (nothing measured), else whether the goal holds."""
    if not all(math.isfinite(v) for v in figures.values()):
        return None
    return holds


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b and math.isfinite(a) and math.isfinite(b) else None


def _fmt(x: float | None) -> str:
    """Three or so significant figures: enough to judge a ratio of 1.02 by."""
    if x is None or not math.isfinite(x):
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


@dataclass(frozen=True)
class Goal:
    goal: str
    target: str
    figures: Callable[[dict[str, Any]], Figures | None]
    # figures -> figure, against, compare (the ratio or difference, as shown), met and
    # "ratio" or "difference" (numbers)
    judge: Callable[[Figures], dict[str, Any]]


def _judge_activation(f: Figures) -> dict[str, Any]:
    diff = f["gateway_ms"] - f["bare_ms"]
    return {"figure": f"{_fmt(f['gateway_ms'])} ms", "against": f"bare {_fmt(f['bare_ms'])} ms",
            "difference": round(diff, 3), "compare": f"{diff:+.1f} ms",
            "met": _met(f, _le(diff, 50.0))}


def _judge_ratio(unit: str, rival: str, limit: float, higher_is_better: bool = False
                 ) -> Callable[[Figures], dict[str, Any]]:
    """gateway ≤ limit x rival (or ≥, for rates)."""
    def judge(f: Figures) -> dict[str, Any]:
        g, o = f["gateway"], f[rival]
        holds = _le(limit * o, g) if higher_is_better else _le(g, limit * o)
        ratio = _ratio(g, o)
        return {"figure": f"{_fmt(g)} {unit}", "against": f"{rival} {_fmt(o)} {unit}",
                "ratio": ratio, "compare": _times(ratio), "met": _met(f, holds)}
    return judge


def _judge_swap(f: Figures) -> dict[str, Any]:
    ratios = {p: _ratio(f[f"gateway_{p}"], f[f"router_{p}"]) for p in ("p50", "p95")}
    holds = all(_le(f[f"gateway_{p}"], 1.02 * f[f"router_{p}"]) for p in ("p50", "p95"))
    return {"figure": f"p50 {_fmt(f['gateway_p50'])} ms, p95 {_fmt(f['gateway_p95'])} ms",
            "against": f"router p50 {_fmt(f['router_p50'])} ms, "
                       f"p95 {_fmt(f['router_p95'])} ms",
            "ratio": ratios,
            "compare": f"p50 {_times(ratios['p50'])}, p95 {_times(ratios['p95'])}",
            "met": _met(f, holds)}


def _judge_slots(f: Figures) -> dict[str, Any]:
    g = f["gateway"]
    ratios = {p: _ratio(g, f[p]) for p in ("direct", "router")}
    holds = _le(0.98 * f["direct"], g) and _le(f["router"], g)
    return {"figure": f"{_fmt(g)} tokens/s",
            "against": f"direct {_fmt(f['direct'])}, router {_fmt(f['router'])} tokens/s",
            "ratio": ratios,
            "compare": f"{_times(ratios['direct'])} direct, {_times(ratios['router'])} router",
            "met": _met(f, holds)}


def _judge_added(f: Figures) -> dict[str, Any]:
    diff = f["gateway_added_ms"] - f["bare_added_ms"]
    return {"figure": f"{f['gateway_added_ms']:+.3f} ms",
            "against": f"bare {f['bare_added_ms']:+.3f} ms",
            "difference": round(diff, 3), "compare": f"{diff:+.3f} ms",
            "met": _met(f, _le(f["gateway_added_ms"], f["bare_added_ms"] + 0.1))}


def _judge_parked(f: Figures) -> dict[str, Any]:
    return {"figure": f"4 parked: {_fmt(f['parked_4_ms'])} ms",
            "against": f"none parked: {_fmt(f['parked_0_ms'])} ms",
            "saving_pct": round(f["saving_pct"], 1),
            "compare": f"saving {f['saving_pct']:.1f} %", "met": None}


def _judge_crossover(f: Figures) -> dict[str, Any]:
    at = f["crossover_tokens"]
    measured = f"prefixes {_fmt(f['min_prefix'])}-{_fmt(f['max_prefix'])} tokens"
    return {"figure": f"{at:.0f} tokens" if math.isfinite(at) else "none",
            "against": measured, "compare": "", "met": None}


def _judge_refusals(f: Figures) -> dict[str, Any]:
    """The slowest refusal's rate ≥ 0.8 x the bare proxy's 404."""
    slowest = min((k for k in f if k != "bare"), key=lambda k: f[k])
    ratio = _ratio(f[slowest], f["bare"])
    return {"figure": f"{_fmt(f[slowest])}/s ({slowest}, the slowest)",
            "against": f"bare 404 {_fmt(f['bare'])}/s", "ratio": ratio,
            "compare": _times(ratio), "met": _met(f, _le(0.8 * f["bare"], f[slowest]))}


def _activation(r: dict[str, Any]) -> Figures | None:
    return _all(gateway_ms=_number(r, "footprint", "socket_activation_to_first_answer_ms"),
                bare_ms=_number(r, "footprint", "bare_socket_activation_to_first_answer_ms"))


def _pair(*keys: str, rival: str = "router") -> Callable[[dict[str, Any]], Figures | None]:
    """gateway and rival under keys, as keys/gateway and keys/rival."""
    def figures(r: dict[str, Any]) -> Figures | None:
        return _all(gateway=_number(r, *keys, "gateway"), **{rival: _number(r, *keys, rival)})
    return figures


def _pair_per_path(section: str, key: str, rival: str
                   ) -> Callable[[dict[str, Any]], Figures | None]:
    """section/gateway/key and section/rival/key."""
    def figures(r: dict[str, Any]) -> Figures | None:
        return _all(gateway=_number(r, section, "gateway", key),
                    **{rival: _number(r, section, rival, key)})
    return figures


def _swap(r: dict[str, Any]) -> Figures | None:
    return _all(**{f"{path}_{p}": _number(r, "realistic", key, path)
                   for path in ("gateway", "router")
                   for p, key in (("p50", "swap_first_byte_ms"), ("p95", "swap_p95_ms"))})


def _agent(r: dict[str, Any]) -> Figures | None:
    return _all(gateway=_number(r, "agent_loop", "turn_ms", "gateway", "p50"),
                router=_number(r, "agent_loop", "turn_ms", "router", "p50"))


def _slots(r: dict[str, Any]) -> Figures | None:
    return _all(**{p: _number(r, "slots", "tokens_per_s", p)
                   for p in ("gateway", "direct", "router")})


def _added_c1(r: dict[str, Any]) -> Figures | None:
    p50 = {p: _number(r, "warm", "c1", p, "p50_ms") for p in ("gateway", "direct", "bare")}
    g, d, b = p50["gateway"], p50["direct"], p50["bare"]
    if g is None or d is None or b is None:
        return None
    return {"gateway_added_ms": g - d, "bare_added_ms": b - d}


def _parked(r: dict[str, Any]) -> Figures | None:
    return _all(**{k: _number(r, "realistic", "parked", k)
                   for k in ("parked_0_ms", "parked_4_ms", "saving_pct")})


REFUSALS = ("401", "403", "415", "421", "429")


def _refusals(r: dict[str, Any]) -> Figures | None:
    return _all(**{k: _number(r, "refusals", "rates", k, "per_s") for k in REFUSALS},
                bare=_number(r, "refusals", "rates", "bare_404", "per_s"))


def _flooded_p99(r: dict[str, Any]) -> Figures | None:
    return _all(gateway=_number(r, "refusals", "inference_ms", "flood", "p99"),
                idle=_number(r, "refusals", "inference_ms", "idle", "p99"))


def _crossover(r: dict[str, Any]) -> Figures | None:
    cross = (r.get("agent_loop") or {}).get("crossover")
    if not isinstance(cross, dict):
        return None
    prefixes = [float(p) for p in cross.get("prefix_tokens") or []]
    at = _number(r, "agent_loop", "crossover", "crossover_tokens")
    # null: the lines did not cross over the prefixes measured
    return {"crossover_tokens": math.nan if at is None else at,
            "min_prefix": min(prefixes, default=math.nan),
            "max_prefix": max(prefixes, default=math.nan)}


# -- mixed traffic (bench/mixed.py): the grouped order against fifo and the router, each
# goal judged on every mix (a goal met on one mix and not the other is not met)

MIXES = ("uniform", "skewed")


def _mixed(key: str, *systems: str) -> Callable[[dict[str, Any]], Figures | None]:
    """runs/<mix>/<system>/key for every mix and system, as <mix>_<system>."""
    def figures(r: dict[str, Any]) -> Figures | None:
        return _all(**{f"{mix}_{system}": _number(r, "mixed", "runs", mix, system, key)
                       for mix in MIXES for system in systems})
    return figures


def _per_mix(f: Figures, unit: str, rivals: Sequence[tuple[str, float]],
             higher_is_better: bool) -> dict[str, Any]:
    """grouped against each (rival, limit) on every mix: grouped ≤ limit x rival (≥ for
    rates); the ratios by mix and rival."""
    ratios: dict[str, dict[str, float | None]] = {}
    holds = True
    for mix in MIXES:
        g = f[f"{mix}_grouped"]
        for rival, limit in rivals:
            o = f[f"{mix}_{rival}"]
            holds &= _le(limit * o, g) if higher_is_better else _le(g, limit * o)
            ratios.setdefault(mix, {})[rival] = _ratio(g, o)
    figure = ", ".join(f"{mix} {_fmt(f[f'{mix}_grouped'])}" for mix in MIXES) + f" {unit}"
    against = "; ".join(f"{rival} " + ", ".join(_fmt(f[f"{mix}_{rival}"]) for mix in MIXES)
                        for rival, _ in rivals)
    compare = "; ".join(", ".join(_times(ratios[mix][rival]) for mix in MIXES)
                        + (f" {rival}" if len(rivals) > 1 else "") for rival, _ in rivals)
    return {"figure": figure, "against": against, "ratio": ratios, "compare": compare,
            "met": _met(f, holds)}


def _judge_mixed_swaps(f: Figures) -> dict[str, Any]:
    return _per_mix(f, "swaps/min", [("fifo", 0.25)], higher_is_better=False)


def _judge_mixed_answers(f: Figures) -> dict[str, Any]:
    return _per_mix(f, "answers/min", [("fifo", 2.0), ("router", 1.5)],
                    higher_is_better=True)


def _judge_mixed_p99(f: Figures) -> dict[str, Any]:
    return _per_mix(f, "ms", [("fifo", 1.0)], higher_is_better=False)


def _mixed_wait(r: dict[str, Any]) -> Figures | None:
    return _all(**{f"{mix}_{k}": _number(r, "mixed", "runs", mix, "grouped", key)
                   for mix in MIXES
                   for k, key in (("wait", "longest_wait_s"), ("bound", "bound_s"),
                                  ("unanswered", "unanswered"))})


def _judge_mixed_wait(f: Figures) -> dict[str, Any]:
    """The longest wait (to the first token) within max_wait_s + the longest load + the
    drain, on every mix, and no request left unanswered."""
    holds = all(_le(f[f"{mix}_wait"], f[f"{mix}_bound"]) and f[f"{mix}_unanswered"] == 0
                for mix in MIXES)
    unanswered = sum(f[f"{mix}_unanswered"] for mix in MIXES)
    return {"figure": ", ".join(f"{mix} {_fmt(f[f'{mix}_wait'])}" for mix in MIXES) + " s"
                      + (f" ({unanswered:.0f} unanswered)" if unanswered else ""),
            "against": "bound " + ", ".join(_fmt(f[f"{mix}_bound"]) for mix in MIXES) + " s",
            "difference": {mix: round(f[f"{mix}_wait"] - f[f"{mix}_bound"], 3)
                           for mix in MIXES},
            "compare": ", ".join(f"{f[f'{mix}_wait'] - f[f'{mix}_bound']:+.1f} s"
                                 for mix in MIXES),
            "met": _met(f, holds)}


def _judge_mixed_share(f: Figures) -> dict[str, Any]:
    """The least-served model's share of the answers over its share of the demand ≥ 0.8."""
    return {"figure": ", ".join(f"{mix} {_times(f[f'{mix}_grouped'])}" for mix in MIXES)
                      + " (the least-served model)",
            "against": "its share of the demand", "compare": "",
            "met": _met(f, all(_le(0.8, f[f"{mix}_grouped"]) for mix in MIXES))}


# -- a batch job beside interactive users (bench/batch.py)

def _batch_p99(r: dict[str, Any]) -> Figures | None:
    return _all(beside=_number(r, "batch", "beside", "p99_ms"),
                alone=_number(r, "batch", "alone", "p99_ms"))


def _judge_batch_p99(f: Figures) -> dict[str, Any]:
    ratio = f["beside"] / f["alone"] if f["alone"] else math.nan
    return {"figure": f"{_fmt(f['beside'])} ms", "against": f"alone {_fmt(f['alone'])} ms",
            "ratio": round(ratio, 3) if math.isfinite(ratio) else None,
            "compare": _times(ratio), "met": _met(f, _le(ratio, 1.2))}


def _batch_rate(r: dict[str, Any]) -> Figures | None:
    return _all(beside=_number(r, "batch", "batch_lines_per_min_beside"),
                quiet=_number(r, "batch", "batch_lines_per_min_quiet"))


def _judge_batch_rate(f: Figures) -> dict[str, Any]:
    return {"figure": f"{_fmt(f['beside'])} lines/min beside users",
            "against": f"quiet {_fmt(f['quiet'])} lines/min", "compare": "", "met": None}


INFORMATIONAL = "no goal (informational)"

GOALS = (
    Goal("activation to first answer", "gateway ≤ bare + 50 ms", _activation,
         _judge_activation),
    Goal("cold start, realistic model, page cache", "gateway p50 ≤ 1.02 x router",
         _pair("realistic", "cold_first_byte_ms"), _judge_ratio("ms", "router", 1.02)),
    Goal("swap, realistic model", "p50 and p95 each ≤ 1.02 x router", _swap, _judge_swap),
    Goal("agent-loop turn, 4k prefix", "gateway p50 ≤ 0.2 x router p50", _agent,
         _judge_ratio("ms", "router", 0.2)),
    Goal("parallel slots, 16 streams", "gateway ≥ 0.98 x direct and ≥ 1.0 x router", _slots,
         _judge_slots),
    Goal("256-token stream", "gateway tokens/s ≥ 1.0 x router",
         _pair_per_path("streaming", "tokens_per_s", "router"),
         _judge_ratio("tokens/s", "router", 1.0, higher_is_better=True)),
    Goal("c=1 added p50", "(gateway - direct) ≤ (bare - direct) + 0.1 ms", _added_c1,
         _judge_added),
    Goal("ceiling (instant engine)", "gateway req/s ≥ 0.95 x bare",
         _pair_per_path("ceiling", "req_per_s", "bare"),
         _judge_ratio("req/s", "bare", 0.95, higher_is_better=True)),
    Goal("refusals (401, 403, 415, 421, 429)", "each ≥ 0.8 x bare 404 rate", _refusals,
         _judge_refusals),
    Goal("inference p99 during a refusal flood", "≤ 3 x idle p99", _flooded_p99,
         _judge_ratio("ms", "idle", 3.0)),
    Goal("mixed traffic: swaps", "grouped ≤ 0.25 x fifo (each mix)",
         _mixed("loads_per_min", "grouped", "fifo"), _judge_mixed_swaps),
    Goal("mixed traffic: answers", "grouped ≥ 2 x fifo and ≥ 1.5 x router (each mix)",
         _mixed("answers_per_min", "grouped", "fifo", "router"), _judge_mixed_answers),
    Goal("mixed traffic: p99 latency", "grouped ≤ fifo (each mix)",
         _mixed("p99_ms", "grouped", "fifo"), _judge_mixed_p99),
    Goal("mixed traffic: longest wait", "≤ max_wait_s + longest load + drain, none "
         "unanswered (each mix)", _mixed_wait, _judge_mixed_wait),
    Goal("mixed traffic: each model's share", "answers share ≥ 0.8 x demand share (each "
         "model, each mix)", _mixed("share_ratio_min", "grouped"), _judge_mixed_share),
    Goal("interactive p99 beside a batch job", "≤ 1.2 x without the batch",
         _batch_p99, _judge_batch_p99),
    Goal("a batch job's lines, beside users and quiet", INFORMATIONAL, _batch_rate,
         _judge_batch_rate),
    Goal("parked units, realistic model", INFORMATIONAL, _parked, _judge_parked),
    Goal("agent-loop crossover prefix", INFORMATIONAL, _crossover, _judge_crossover),
)


def _row(goal: Goal, figures: Figures | None) -> dict[str, Any]:
    row: dict[str, Any] = {"goal": goal.goal}
    if figures is None:   # the section was not run
        row.update(figure="-", against="-", compare="", met=None)
    else:
        row.update(goal.judge(figures))
    row["target"] = goal.target
    # the numbers judged; JSON's null for one not measured (NaN is not JSON)
    row["figures"] = None if figures is None else {
        k: v if math.isfinite(v) else None for k, v in figures.items()}
    return row


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per goal: goal, figure (the gateway's, with its unit), against (the floor's
    or the rival's in the same run), ratio or difference, compare (either, as shown),
    target, met (True/False; None when the section was not run, or for a row with no
    goal), figures (the numbers judged)."""
    return [_row(goal, goal.figures(results)) for goal in GOALS]


def median_verdicts(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The verdicts on the medians over runs: each figure (the gateway's, the rival's)
    median'd over the runs that have it, then judged. Each row adds runs (each run's
    figure, "-" where its section was not run) and counted (how many runs had it)."""
    rows = []
    for goal in GOALS:
        per_run = [goal.figures(r) for r in runs]
        present = [f for f in per_run if f is not None]
        medians = None
        if present:
            medians = {}
            for k in present[0]:
                values = [f[k] for f in present if math.isfinite(f[k])]
                medians[k] = statistics.median(values) if values else math.nan
        row = _row(goal, medians)
        row["runs"] = [_row(goal, f)["figure"] for f in per_run]
        row["counted"] = len(present)
        rows.append(row)
    return rows


def _met_cell(row: dict[str, Any]) -> str:
    if row["target"] == INFORMATIONAL:
        return "-" if row["figures"] is not None else "not run"
    if row["met"] is None:
        return "not run" if row["figures"] is None else "not measured"
    return "yes" if row["met"] else "**no**"


def _against_cell(row: dict[str, Any]) -> str:
    return f"{row['against']} ({row['compare']})" if row["compare"] else row["against"]


def verdict_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| goal | figure | floor or rival | target | met |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['goal']} | {row['figure']} | {_against_cell(row)} | "
                     f"{row['target']} | {_met_cell(row)} |")
    return lines


def median_table(rows: Sequence[dict[str, Any]], n_runs: int) -> list[str]:
    runs = " | ".join(f"run {i + 1}" for i in range(n_runs))
    of = f"median of {n_runs} runs" if n_runs > 1 else "1 run"
    lines = [f"| goal | figure ({of}) | {runs} | floor or rival (median) "
             f"| target | met |", "|---|---|" + "---|" * n_runs + "---|---|---|"]
    for row in rows:
        figure = row["figure"]
        if 0 < row["counted"] < n_runs:
            figure += f" ({row['counted']} of {n_runs} runs)"
        lines.append(f"| {row['goal']} | {figure} | {' | '.join(row['runs'])} | "
                     f"{_against_cell(row)} | {row['target']} | {_met_cell(row)} |")
    return lines


def _added(warm: dict[str, Any], path: str, key: str = "p50_ms") -> float:
    return float(warm[path][key] - warm["direct"][key])


def _get(d: Any, *keys: str) -> Any:
    """d[k1][k2]..., or "-" where missing (a section's figures as its author wrote them)."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return "-"
        d = d[k]
    return d


def write_report(r: dict[str, Any], out: Path) -> None:
    """results.md: the verdicts, then each section run (a run limited by --only has the
    others' keys missing: they are left out); latency.png when the tiny section ran."""
    plan, mach = r.get("plan", {}), r.get("machine", {})
    lines = [f"# llm-gateway benchmarks ({plan.get('rounds', '?')} interleaved rounds, "
             f"{mach.get('cores', '?')} cores, {mach.get('cpu', '?')})", ""]
    lines += ["## Verdicts", "", *verdict_table(verdicts(r)), ""]
    lines += _tiny_tables(r)
    lines += _realistic_tables(r)
    lines += _agent_tables(r)
    lines += _crowd_tables(r)
    lines += _refusal_tables(r)
    lines += _mixed_tables(r)
    if r.get("retried"):
        lines += ["", "## Retried once (failed, then measured again)", ""]
        lines += [f"- {x.get('what', '?')}: {x.get('error', '?')}" for x in r["retried"]]
    plot = "warm_raw_c1" in r and "streaming_gaps" in r
    lines += ["", f"Run took {r.get('seconds', '?')} s. Raw numbers: results.json"
              + ("; plot: latency.png." if plot else ".")]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    if plot:
        _plot(r, out / "latency.png")


def _tiny_tables(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if "warm" in r:
        lines += ["## Warm requests (max_tokens=1 chat, tiny model)", "",
                  "| concurrency | path | p50 ms | p99 ms | req/s | added p50 ms |",
                  "|---|---|---|---|---|---|"]
        for c, per in r["warm"].items():
            for path, s in per.items():
                added = "-" if path == "direct" else f"{_added(per, path):+.3f}"
                lines.append(f"| {c} | {path} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | "
                             f"{s['req_per_s']} | {added} |")
        lines += ["", "| concurrency | gateway added ÷ router added (p50) | gateway minus bare "
                  "proxy (p50 ms, what our features cost) |", "|---|---|---|"]
        for c, per in r["warm"].items():
            router = _added(per, "router")
            ratio = _added(per, "gateway") / router if router > 0 else float("nan")
            features = per["gateway"]["p50_ms"] - per["bare"]["p50_ms"]
            lines.append(f"| {c} | {ratio:.2f} | {features:+.3f} |")
    if "ceiling" in r:
        ce = r["ceiling"]
        lines += ["", "## Proxy ceiling (instant fake engine, concurrency 64)", "",
                  "| path | req/s | p50 ms | p99 ms | CPU µs/request |", "|---|---|---|---|---|"]
        for path, s in ce.items():
            lines.append(f"| {path} | {s['req_per_s']} | {s['p50_ms']:.3f} | "
                         f"{s['p99_ms']:.3f} | {s.get('cpu_us_per_req', '-')} |")
        if ce["bare"].get("req_per_s"):
            lines.append(f"\ngateway ÷ bare proxy throughput: "
                         f"{ce['gateway']['req_per_s'] / ce['bare']['req_per_s']:.2f}")
    if "streaming" in r:
        lines += ["", "## Streaming (256 tokens)", "",
                  "tokens/s: from the first token to the last; answer tokens/s: from the "
                  "request to the last token. CPU: the proxy process's own, per event. "
                  "router_engine: the router's child llama-server, read directly (the router's "
                  "hop is router ÷ router_engine; the others' is ÷ direct).", "",
                  "| path | tokens/s | answer tokens/s | first token ms | gap p50 ms | "
                  "gap p99 ms | events per read | CPU µs/event | stalled starts re-run |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for path, s in r["streaming"].items():
            lines.append(f"| {path} | {s['tokens_per_s']} | "
                         f"{s.get('answer_tokens_per_s', '-')} | "
                         f"{s.get('first_token_ms', '-')} | {s['gap_p50_ms']} | "
                         f"{s['gap_p99_ms']} | {s['events_per_read']} | "
                         f"{s.get('cpu_us_per_event', '-')} | "
                         f"{s.get('stalled_starts_rerun', '-')} |")
        hop = r.get("streaming_hop")
        if hop:
            lines.append(f"\nthe hop, tokens/s ÷ the path's own engine read directly: "
                         f"gateway {hop['gateway']:.2f}, router {hop['router']:.2f}, "
                         f"bare {hop['bare']:.2f}")
    if "cold_swap" in r:
        cs = r["cold_swap"]
        lines += ["", "## Cold start and swap (first byte, ms; 2 slots, 3 models)", "",
                  "| | gateway | router |", "|---|---|---|",
                  f"| cold start (stopped model) | {cs['cold_first_byte_ms']['gateway']} | "
                  f"{cs['cold_first_byte_ms']['router']} |",
                  f"| cold start, no KV cache kept (gateway: tiny-cold) | "
                  f"{cs.get('cold_no_kv_cache_first_byte_ms', '-')} | "
                  f"{cs['cold_first_byte_ms']['router']} |",
                  *([f"| (of which the engine's own load, from its log) | "
                     f"{cs['cold_engine_load_ms'].get('gateway', '-')} | "
                     f"{cs['cold_engine_load_ms'].get('router', '-')} |"]
                    if cs.get("cold_engine_load_ms") else []),
                  *([f"| (the gateway's own account: request → wake, wake → ready, ready → "
                     f"first byte) | {phases(cs['cold_gateway_phases_ms'])} | - |"]
                    if cs.get("cold_gateway_phases_ms") else []),
                  f"| swap, every request evicts (p50) | "
                  f"{cs['swap_first_byte_ms']['gateway']} | "
                  f"{cs['swap_first_byte_ms']['router']} |",
                  f"| swap p99 | {cs['swap_p99_ms']['gateway']} | "
                  f"{cs['swap_p99_ms']['router']} |"]
    kv = r.get("kv_restore")
    if kv:
        lines += ["", "## A long prompt (~1460 tokens) again after its engine was stopped "
                  "(gateway, ms)", "",
                  "| KV cache | start (stop → ready) | first byte | both |", "|---|---|---|---|"]
        for label in ("restored", "cold"):
            k = kv[label]
            lines.append(f"| {label} | {k['start_ms']} | {k['first_byte_ms']} | "
                         f"{round(k['start_ms'] + k['first_byte_ms'], 2)} |")
    if "footprint" in r:
        fp = r["footprint"]
        lines += ["", "## Footprint (gateway process)", "",
                  f"- RSS idle: {fp['rss_idle_mib']} MiB; with {fp['open_streams']} open "
                  f"streams: {fp['rss_peak_open_streams_mib']} MiB "
                  f"({fp['open_stream_errors']} errors)",
                  f"- socket activation to the first answer: "
                  f"{fp['socket_activation_to_first_answer_ms']} ms"
                  + (f" (a bare aiohttp proxy, socket-activated the same way: "
                     f"{fp['bare_socket_activation_to_first_answer_ms']} ms, the floor of any "
                     f"aiohttp gateway on this machine)"
                     if "bare_socket_activation_to_first_answer_ms" in fp else "")]
    return lines


def _realistic_tables(r: dict[str, Any]) -> list[str]:
    if "realistic" not in r:
        return []
    re_ = r["realistic"]
    size = _get(re_, "model", "bytes")
    gib = f", {size / 2**30:.2f} GiB" if isinstance(size, int | float) else ""
    lines = ["", f"## Realistic model ({_get(re_, 'model', 'preset')}{gib}): cold start and "
             f"swap (first byte, ms)", "", "| | gateway | router |", "|---|---|---|"]
    for label, key in (("cold start, page cache (p50)", "cold_first_byte_ms"),
                       ("cold start, page cache, p95", "cold_p95_ms"),
                       ("cold start, page cache dropped (p50)", "cold_dropped_first_byte_ms"),
                       ("swap, every request evicts (p50)", "swap_first_byte_ms"),
                       ("swap p95", "swap_p95_ms")):
        if key in re_:
            lines.append(f"| {label} | {_get(re_, key, 'gateway')} | "
                         f"{_get(re_, key, 'router')} |")
    if "cold_dropped_first_byte_ms" not in re_ and re_.get("dropped_note"):
        lines.append(f"\npage cache dropped: not measured ({re_['dropped_note']})")
    if "parked" in re_:
        pk = re_["parked"]
        lines.append(f"\nparked units: cold start p50 {_get(pk, 'parked_0_ms')} ms with none "
                     f"parked, {_get(pk, 'parked_4_ms')} ms with 4 (saving "
                     f"{_get(pk, 'saving_pct')} %)")
    streaming = re_.get("streaming")
    if isinstance(streaming, dict) and streaming:
        lines += ["", "Streams on it (tokens/s summed over the streams at once, median of the "
                  "rounds; gaps between reads, ms):", "",
                  "| streams at once | path | tokens/s | first token ms | gap p50 | gap p99 "
                  "| gateway CPU µs/event |", "|---|---|---|---|---|---|---|"]
        for label, paths in streaming.items():
            for path, v in paths.items():
                lines.append(f"| {label.removeprefix('c')} | {path} | "
                             f"{_get(v, 'tokens_per_s')} | {_get(v, 'first_token_ms')} | "
                             f"{_get(v, 'gap_p50_ms')} | {_get(v, 'gap_p99_ms')} | "
                             f"{v.get('cpu_us_per_event', '-')} |")
    return lines


def _agent_tables(r: dict[str, Any]) -> list[str]:
    if "agent_loop" not in r:
        return []
    ag = r["agent_loop"]
    lines = ["", f"## Agent loop (a turn on a {_get(ag, 'prefix_tokens')}-token prefix, ms)", "",
             "| path | p50 | p95 |", "|---|---|---|"]
    for path in ("gateway", "router"):
        lines.append(f"| {path} | {_get(ag, 'turn_ms', path, 'p50')} | "
                     f"{_get(ag, 'turn_ms', path, 'p95')} |")
    cross = ag.get("crossover")
    if isinstance(cross, dict) and cross.get("prefix_tokens"):
        lines += ["", "| prefix tokens | gateway p50 ms | router p50 ms |", "|---|---|---|"]
        gw, router = cross.get("gateway_p50_ms") or [], cross.get("router_p50_ms") or []
        for i, tokens in enumerate(cross["prefix_tokens"]):
            lines.append(f"| {tokens} | {gw[i] if i < len(gw) else '-'} | "
                         f"{router[i] if i < len(router) else '-'} |")
        at = cross.get("crossover_tokens")
        lines.append(f"\ncrossover: {'none over the prefixes measured' if at is None else at}"
                     + (" tokens" if at is not None else ""))
    return lines


def _crowd_tables(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if "slots" in r:
        sl = r["slots"]
        lines += ["", f"## Parallel slots ({_get(sl, 'parallel')} slots, "
                  f"{_get(sl, 'streams')} concurrent streams), tokens/s", "",
                  "| direct | gateway | router |", "|---|---|---|",
                  f"| {_get(sl, 'tokens_per_s', 'direct')} | "
                  f"{_get(sl, 'tokens_per_s', 'gateway')} | "
                  f"{_get(sl, 'tokens_per_s', 'router')} |"]
    if "many_clients" in r:
        mc = r["many_clients"]
        lines += ["", f"## Many clients ({_get(mc, 'active_streams')} active streams, "
                  f"{_get(mc, 'idle_connections')} idle connections)", "",
                  "| | gateway | bare proxy |", "|---|---|---|"]
        for label, key in (("RSS MiB", "rss_mib"), ("CPU µs/event", "cpu_us_per_event"),
                           ("errors", "errors")):
            lines.append(f"| {label} | {_get(mc, key, 'gateway')} | {_get(mc, key, 'bare')} |")
    return lines


def _refusal_tables(r: dict[str, Any]) -> list[str]:
    if "refusals" not in r:
        return []
    rf = r["refusals"]
    lines = ["", f"## Refusals (instant fake engine, keys on; {_get(rf, 'connections')} "
             f"connections x {_get(rf, 'depth')} pipelined requests)", "",
             "| refusal | per s | spread | ÷ bare 404 | CPU µs/refusal | other statuses |",
             "|---|---|---|---|---|---|"]
    bare = _number(rf, "rates", "bare_404", "per_s")
    for kind in (*REFUSALS, "bare_404"):
        rate = _number(rf, "rates", kind, "per_s")
        spread = _get(rf, "rates", kind, "spread")
        lines.append(
            f"| {kind.replace('_', ' ')} | {_fmt(rate)} | "
            f"{'-'.join(_fmt(x) for x in spread) if isinstance(spread, list) else '-'} | "
            f"{_times(_ratio(rate, bare) if rate is not None and bare else None)} | "
            f"{_get(rf, 'rates', kind, 'cpu_us_per_refusal')} | "
            f"{_get(rf, 'rates', kind, 'other_statuses')} |")
    lines += ["", "| chat (c=1, kept alive); the proxy's own answer on a new connection "
              "(gateway /v1/models, bare /bare/retries), ms | p50 | p99 | max | n |",
              "|---|---|---|---|---|"]
    for key, label in (("inference_ms", "chat"), ("new_connection_ms", "new connection")):
        for phase in ("idle", "flood", "bare_idle", "bare_flood"):
            if phase not in rf.get(key, {}):
                continue
            lines.append(f"| {label}, {phase.replace('_', ' ')} | {_get(rf, key, phase, 'p50')} | "
                         f"{_get(rf, key, phase, 'p99')} | {_get(rf, key, phase, 'max')} | "
                         f"{_get(rf, key, phase, 'n')} |")
    lines += ["", f"the flood meanwhile: {_get(rf, 'flood_during_inference', 'per_s')} "
              f"refusals/s; the load generator took {_get(rf, 'generator', 'cores')} of a "
              f"core ({_get(rf, 'generator', 'cpu_us_per_answer')} µs per answer); journal "
              f"follows held for the 429s: {_get(rf, 'follows_held')} "
              f"({_get(rf, 'follows_held_at_end')} still open at the end)"]
    return lines


def _mixed_tables(r: dict[str, Any]) -> list[str]:
    if "mixed" not in r:
        return []
    mx = r["mixed"]
    size = _get(mx, "model", "bytes")
    gib = f", {size / 2**30:.2f} GiB" if isinstance(size, int | float) else ""
    lines = ["", f"## Mixed traffic ({_get(mx, 'clients')} clients, 3 models "
             f"({_get(mx, 'model', 'preset')}{gib}) over {_get(mx, 'places')} places, "
             f"{_get(mx, 'answer_tokens')}-token answers, {_get(mx, 'seconds')} s per system "
             f"and mix; grouped: max_wait_s {_get(mx, 'max_wait_s')})", "",
             "| mix | system | answers/min | swaps/min | swaps per 100 answers | p50 ms | "
             "p99 ms | longest wait s | longest load s | errors | unanswered |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    runs = mx.get("runs") or {}
    for mix, systems in runs.items():
        for system, f in systems.items():
            lines.append(f"| {mix} | {system} | {_get(f, 'answers_per_min')} | "
                         f"{_get(f, 'loads_per_min')} | {_get(f, 'loads_per_100_answers')} | "
                         f"{_get(f, 'p50_ms')} | {_get(f, 'p99_ms')} | "
                         f"{_get(f, 'longest_wait_s')} | {_get(f, 'longest_load_s')} | "
                         f"{_get(f, 'errors')} | {_get(f, 'unanswered')} |")
    lines += ["", "each model's share of the answers (within the window) / of the demand "
              "(requests asked), and their ratio", "",
              "| mix | system | " + " | ".join(_mixed_models(runs)) + " |",
              "|---|---|" + "---|" * len(_mixed_models(runs))]
    for mix, systems in runs.items():
        for system, f in systems.items():
            cells = []
            for name in _mixed_models(runs):
                sh = _get(f, "share", name)
                ratio = _number(f, "share", name, "ratio")
                cells.append("-" if not isinstance(sh, dict) else
                              f"{_fmt(_number(sh, 'answers'))} / {_fmt(_number(sh, 'demand'))}"
                              f" ({_times(ratio)})")
            lines.append(f"| {mix} | {system} | {' | '.join(cells)} |")
    bounds = [f"{mix} {_get(systems['grouped'], 'longest_wait_s')} s against "
              f"{_get(systems['grouped'], 'max_wait_s')} + "
              f"{_get(systems['grouped'], 'longest_load_s')} (load) + "
              f"{_get(systems['grouped'], 'longest_drain_s')} (drain) = "
              f"{_get(systems['grouped'], 'bound_s')} s"
              for mix, systems in runs.items() if "grouped" in systems]
    if bounds:
        lines += ["", "grouped's longest wait (to the first token) against its bound: "
                  + "; ".join(bounds)]
    for system, why in (mx.get("not_run") or {}).items():
        lines.append(f"\n{system}: {why}")
    return lines


def _mixed_models(runs: dict[str, Any]) -> list[str]:
    names: dict[str, None] = {}
    for systems in runs.values():
        for f in systems.values():
            names.update(dict.fromkeys(f.get("share") or {}))
    return list(names)


def _plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in r["warm_raw_c1"].items():
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        left.plot(xs, ys, label=name)
    left.set_xscale("log")
    left.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xticks([1, 2, 3, 5, 10, 20, 50, 100])
    left.set_xlabel("latency, ms (max_tokens=1, sequential)")
    left.set_ylabel("fraction of requests")
    left.set_title("warm request latency (CDF)")
    left.legend()
    for name, gaps in r["streaming_gaps"].items():
        if gaps:
            right.hist(gaps, bins=50, histtype="step", label=name)
    right.set_xlabel("gap between reads, ms (256-token stream)")
    right.set_ylabel("reads")
    right.set_yscale("log")
    right.set_title("streaming: gaps between chunks")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def phases(ms: dict[str, float]) -> str:
    return " / ".join(str(ms.get(k, "-"))
                      for k in ("to_loading", "loading_to_ready", "ready_to_first_byte"))


# -- the medians of several runs, and docs/benchmarks.md's summary -----------------------------

START, END = "<!-- bench-summary:start -->", "<!-- bench-summary:end -->"


class Refused(Exception):
    """What was asked cannot be done as asked (exit 2, said)."""


def _machine(r: dict[str, Any]) -> str:
    m = r.get("machine") or {}
    return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
            f"Python {m.get('python', '?')}")


def summary(runs: Sequence[dict[str, Any]], names: Sequence[str], command: str) -> list[str]:
    """The verdict table on the medians of runs, each run's figure beside the median, and
    the line that says where it came from."""
    if not runs:
        raise Refused("no runs: give at least one results.json")
    machines = list(dict.fromkeys(_machine(r) for r in runs))
    return [*median_table(median_verdicts(runs), len(runs)), "",
            f"Machine: {' / '.join(machines)}; {len(runs)} run{'s' if len(runs) > 1 else ''}: "
            + ", ".join(f"run {i + 1} `{n}`" for i, n in enumerate(names))
            + f"; generated by `{command}`; do not edit by hand."]


def replace_block(text: str, block: Sequence[str]) -> str:
    """text with what lies between the summary markers replaced by block (the markers and
    everything outside them kept as they were)."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise Refused(f"the README has no {START} ... {END} block (each marker once, in "
                      f"that order): add them where the summary goes")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + START + "\n" + "\n".join(block) + "\n" + END + tail


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.report",
        description="the verdicts on the medians of several runs' figures "
                    "(bench/results/runs/*.json)")
    ap.add_argument("--runs", nargs="+", type=Path, required=True, metavar="RESULTS.json")
    ap.add_argument("--readme", type=Path,
                    help="replace the summary between its markers in this README.md")
    a = ap.parse_args(argv)
    command = "python -m bench.report --runs " + " ".join(str(p) for p in a.runs) + (
        f" --readme {a.readme}" if a.readme else "")
    try:
        runs = []
        for path in a.runs:
            try:
                run = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise Refused(f"{path}: not a results.json ({e})") from e
            if not isinstance(run, dict):
                raise Refused(f"{path}: not a results.json (no object)")
            runs.append(run)
        block = summary(runs, [p.name for p in a.runs], command)
        if a.readme:
            try:
                text = a.readme.read_text()
            except OSError as e:
                raise Refused(f"{a.readme}: {e}") from e
            a.readme.write_text(replace_block(text, block))
    except Refused as e:
        print(f"bench.report: {e}", file=sys.stderr)
        return 2
    print("\n".join(block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
