"""bench/report.py: the verdicts against the goals, their medians over several runs,
README.md's summary block, and results.md for a run limited to some sections."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import report

GOALS = [g.goal for g in report.GOALS]
(ACTIVATION, COLD, SWAP, AGENT, SLOTS, STREAM, ADDED, CEILING, REFUSALS, FLOODED,
 MIXED_SWAPS, MIXED_ANSWERS, MIXED_P99, MIXED_WAIT, MIXED_SHARE, BATCH_P99, BATCH_RATE,
 PARKED, CROSSOVER) = GOALS


def full() -> dict[str, Any]:
    """A run of every section, every goal met with room to spare."""
    warm = {p: {"p50_ms": v, "p99_ms": 2 * v, "req_per_s": 100.0}
            for p, v in (("direct", 1.0), ("gateway", 1.2), ("router", 1.5), ("bare", 1.25))}
    return {
        "plan": {"rounds": 5}, "machine": {"cpu": "Test CPU", "cores": 2, "python": "3.11.2"},
        "retried": [],
        "warm": {"c1": warm},
        "warm_raw_c1": {"direct": [1.0, 1.1], "gateway": [1.2, 1.3]},
        "ceiling": {p: {"req_per_s": v, "p50_ms": 1.0, "p99_ms": 2.0}
                    for p, v in (("direct", 9000.0), ("gateway", 4000.0), ("bare", 4000.0))},
        "streaming": {p: {"tokens_per_s": v, "gap_p50_ms": 1.0, "gap_p99_ms": 2.0,
                          "events_per_read": 1.0}
                      for p, v in (("direct", 100.0), ("gateway", 99.0), ("router", 97.0),
                                   ("bare", 99.0), ("router_engine", 99.0))},
        "streaming_gaps": {"gateway": [1.0, 2.0]},
        "cold_swap": {"cold_first_byte_ms": {"gateway": 400.0, "router": 380.0},
                      "swap_first_byte_ms": {"gateway": 500.0, "router": 510.0},
                      "swap_p99_ms": {"gateway": 700.0, "router": 690.0}},
        "footprint": {"rss_idle_mib": 40.0, "rss_peak_open_streams_mib": 60.0,
                      "open_streams": 1000, "open_stream_errors": 0,
                      "socket_activation_to_first_answer_ms": 430.0,
                      "bare_socket_activation_to_first_answer_ms": 410.0},
        "realistic": {"model": {"preset": "realistic", "bytes": 1_181_116_006},
                      "cold_first_byte_ms": {"gateway": 980.0, "router": 1000.0},
                      "cold_p95_ms": {"gateway": 1100.0, "router": 1150.0},
                      "cold_dropped_first_byte_ms": {"gateway": 3000.0, "router": 3100.0},
                      "swap_first_byte_ms": {"gateway": 1180.0, "router": 1200.0},
                      "swap_p95_ms": {"gateway": 1250.0, "router": 1300.0},
                      "parked": {"parked_0_ms": 900.0, "parked_4_ms": 800.0,
                                 "saving_pct": 11.1}},
        "agent_loop": {"prefix_tokens": 4096,
                       "turn_ms": {"gateway": {"p50": 100.0, "p95": 120.0},
                                   "router": {"p50": 900.0, "p95": 1000.0}},
                       "crossover": {"prefix_tokens": [256, 1024, 4096],
                                     "gateway_p50_ms": [50.0, 60.0, 100.0],
                                     "router_p50_ms": [40.0, 200.0, 900.0],
                                     "crossover_tokens": 1024}},
        "slots": {"parallel": 4, "streams": 16,
                  "tokens_per_s": {"direct": 300.0, "gateway": 299.0, "router": 290.0}},
        "many_clients": {"active_streams": 256, "idle_connections": 2000,
                         "rss_mib": {"gateway": 80.0, "bare": 70.0},
                         "cpu_us_per_event": {"gateway": 30.0, "bare": 28.0},
                         "errors": {"gateway": 0, "bare": 0}},
        "refusals": refusals(),
        "mixed": mixed(),
        "batch": {"alone": {"answers": 100, "p50_ms": 500.0, "p99_ms": 1000.0},
                  "beside": {"answers": 95, "p50_ms": 520.0, "p99_ms": 1100.0},
                  "p99_ratio": 1.1, "p50_ratio": 1.04, "batch_lines_per_min_beside": 20.0,
                  "batch_lines_per_min_quiet": 80.0},
        "seconds": 300.0}


def mixed() -> dict[str, Any]:
    """bench/mixed.py's figures: grouped well within every goal on both mixes."""
    def run(answers: float, loads: float, p99: float, **more: Any) -> dict[str, Any]:
        share = {name: {"weight": w, "asked": 100, "answered": 90, "demand": w,
                        "answers": w, "ratio": 1.0}
                 for name, w in (("mix-a", 0.7), ("mix-b", 0.2), ("mix-c", 0.1))}
        return {"seconds": 180.0, "answers": answers * 3, "answers_per_min": answers,
                "loads": loads * 3, "loads_per_min": loads,
                "loads_per_100_answers": round(100 * loads / answers, 2),
                "p50_ms": round(p99 / 3, 1),
                "p99_ms": p99, "longest_wait_s": 30.0, "longest_load_s": 1.0,
                "longest_drain_s": 1.0, "unanswered": 0, "errors": 0, "error_kinds": {},
                "share": share, "share_ratio_min": 0.95, **more}

    def grouped(answers: float, loads: float, p99: float, wait: float, share: float
                ) -> dict[str, Any]:
        return run(answers, loads, p99, longest_wait_s=wait, longest_load_s=1.5,
                   longest_drain_s=0.5, max_wait_s=20.0, bound_s=22.0, share_ratio_min=share)

    return {"model": {"preset": "realistic", "bytes": 1_181_116_006}, "clients": 16,
            "answer_tokens": 8, "places": 2, "seconds": 180.0, "max_wait_s": 20.0,
            "mixes": {"uniform": [1 / 3] * 3, "skewed": [0.7, 0.2, 0.1]},
            "order": [["grouped", "fifo", "router"], ["fifo", "router", "grouped"]],
            "not_run": {},
            "runs": {"uniform": {"grouped": grouped(400.0, 2.0, 3000.0, 15.0, 0.9),
                                 "fifo": run(150.0, 40.0, 8000.0),
                                 "router": run(200.0, 30.0, 9000.0)},
                     "skewed": {"grouped": grouped(500.0, 1.0, 2500.0, 18.0, 0.85),
                                "fifo": run(160.0, 20.0, 6000.0),
                                "router": run(250.0, 25.0, 7000.0)}}}


def refusals() -> dict[str, Any]:
    """bench/refusals.py's figures: every refusal above 0.8x the bare 404, p99 flooded
    under 3x idle."""
    rates = {k: {"per_s": v, "spread": [v - 100, v + 100], "cpu_us_per_refusal": 90.0,
                 "other_statuses": 0, "reopened": 0}
             for k, v in (("401", 4500.0), ("403", 4600.0), ("415", 4400.0), ("421", 4700.0),
                          ("429", 4300.0), ("bare_404", 5000.0))}
    return {"connections": 32, "depth": 32, "follows_held": 8, "follows_held_at_end": 8,
            "rates": rates,
            "generator": {"cores": 0.3, "cpu_us_per_answer": 40.0},
            "inference_ms": {"idle": {"n": 900, "p50": 1.0, "p99": 2.0, "max": 3.0},
                             "flood": {"n": 300, "p50": 3.0, "p99": 5.0, "max": 9.0}},
            "new_connection_ms": {"idle": {"n": 200, "p50": 1.5, "p99": 3.0, "max": 4.0},
                                  "flood": {"n": 100, "p50": 4.0, "p99": 8.0, "max": 12.0}},
            "flood_during_inference": {"per_s": 4200.0, "statuses": {"401": 100}}}


def rows(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["goal"]: row for row in report.verdicts(results)}


def test_every_goal_met() -> None:
    got = rows(full())
    assert list(got) == GOALS
    assert {g: got[g]["met"] for g in GOALS} == {**dict.fromkeys(GOALS, True),
                                                PARKED: None, CROSSOVER: None,
                                                BATCH_RATE: None}
    assert got[BATCH_P99]["figure"] == "1100 ms" and got[BATCH_P99]["ratio"] == 1.1
    assert got[COLD]["figure"] == "980 ms" and got[COLD]["against"] == "router 1000 ms"
    assert got[COLD]["ratio"] == 0.98
    assert got[ACTIVATION]["difference"] == 20.0
    assert got[SWAP]["ratio"] == {"p50": round(1180 / 1200, 3), "p95": round(1250 / 1300, 3)}
    assert got[ADDED]["figure"] == "+0.200 ms" and got[ADDED]["against"] == "bare +0.250 ms"
    assert got[PARKED]["saving_pct"] == 11.1 and got[PARKED]["figure"] == "4 parked: 800 ms"
    assert got[CROSSOVER]["figure"] == "1024 tokens"
    json.dumps(report.verdicts(full()), allow_nan=False)   # stored in results.json


def put(*keys: str, value: float) -> Callable[[dict[str, Any]], None]:
    def change(r: dict[str, Any]) -> None:
        d = r
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return change


def both(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def change(r: dict[str, Any]) -> None:
        for c in changes:
            c(r)
    return change


# (goal, a change to full(), met after it): each threshold right at its boundary (met),
# and just past it (not met)
BOUNDARIES = [
    (ACTIVATION, put("footprint", "socket_activation_to_first_answer_ms", value=460.0), True),
    (ACTIVATION, put("footprint", "socket_activation_to_first_answer_ms", value=460.1), False),
    (COLD, put("realistic", "cold_first_byte_ms", "gateway", value=1020.0), True),
    (COLD, put("realistic", "cold_first_byte_ms", "gateway", value=1020.1), False),
    (SWAP, both(put("realistic", "swap_first_byte_ms", "gateway", value=1224.0),
                put("realistic", "swap_p95_ms", "gateway", value=1326.0)), True),
    (SWAP, put("realistic", "swap_first_byte_ms", "gateway", value=1224.1), False),
    (SWAP, put("realistic", "swap_p95_ms", "gateway", value=1326.1), False),   # p50 fine
    (AGENT, put("agent_loop", "turn_ms", "gateway", "p50", value=180.0), True),
    (AGENT, put("agent_loop", "turn_ms", "gateway", "p50", value=180.1), False),
    (SLOTS, both(put("slots", "tokens_per_s", "gateway", value=294.0),
                 put("slots", "tokens_per_s", "router", value=294.0)), True),
    (SLOTS, put("slots", "tokens_per_s", "gateway", value=293.9), False),      # < 0.98 direct
    (SLOTS, put("slots", "tokens_per_s", "router", value=299.1), False),       # < router
    (STREAM, put("streaming", "gateway", "tokens_per_s", value=97.0), True),
    (STREAM, put("streaming", "gateway", "tokens_per_s", value=96.9), False),
    # 1.35 - 1.0 is 0.3500000000000001 in floats: right at the boundary all the same
    (ADDED, put("warm", "c1", "gateway", "p50_ms", value=1.35), True),
    (ADDED, put("warm", "c1", "gateway", "p50_ms", value=1.351), False),
    (CEILING, put("ceiling", "gateway", "req_per_s", value=3800.0), True),
    (CEILING, put("ceiling", "gateway", "req_per_s", value=3799.9), False),
    # each refusal on its own: the slowest is judged, whichever it is
    (REFUSALS, put("refusals", "rates", "429", "per_s", value=4000.0), True),
    (REFUSALS, put("refusals", "rates", "429", "per_s", value=3999.9), False),
    (REFUSALS, put("refusals", "rates", "403", "per_s", value=3999.9), False),
    (REFUSALS, put("refusals", "rates", "bare_404", "per_s", value=5375.1), False),
    (FLOODED, put("refusals", "inference_ms", "flood", "p99", value=6.0), True),
    (FLOODED, put("refusals", "inference_ms", "flood", "p99", value=6.01), False),
    (FLOODED, put("refusals", "inference_ms", "idle", "p99", value=1.66), False),
    # each mixed goal on each mix: a goal missed on one mix is missed
    (MIXED_SWAPS, put("mixed", "runs", "uniform", "grouped", "loads_per_min", value=10.0),
     True),
    (MIXED_SWAPS, put("mixed", "runs", "uniform", "grouped", "loads_per_min", value=10.01),
     False),
    (MIXED_SWAPS, put("mixed", "runs", "skewed", "grouped", "loads_per_min", value=5.01),
     False),
    (MIXED_SWAPS, put("mixed", "runs", "skewed", "fifo", "loads_per_min", value=3.99), False),
    # uniform: 2 x fifo (150) and 1.5 x router (200) are both 300
    (MIXED_ANSWERS, put("mixed", "runs", "uniform", "grouped", "answers_per_min",
                        value=300.0), True),
    (MIXED_ANSWERS, put("mixed", "runs", "uniform", "grouped", "answers_per_min",
                        value=299.9), False),
    (MIXED_ANSWERS, put("mixed", "runs", "skewed", "fifo", "answers_per_min", value=250.1),
     False),                                                   # < 2 x fifo, > 1.5 x router
    (MIXED_ANSWERS, put("mixed", "runs", "skewed", "router", "answers_per_min",
                        value=333.4), False),                  # < 1.5 x router, > 2 x fifo
    (MIXED_P99, put("mixed", "runs", "uniform", "grouped", "p99_ms", value=8000.0), True),
    (MIXED_P99, put("mixed", "runs", "uniform", "grouped", "p99_ms", value=8000.1), False),
    (MIXED_P99, put("mixed", "runs", "skewed", "fifo", "p99_ms", value=2499.9), False),
    (BATCH_P99, put("batch", "beside", "p99_ms", value=1200.0), True),
    (BATCH_P99, put("batch", "beside", "p99_ms", value=1201.0), False),
    (MIXED_WAIT, put("mixed", "runs", "uniform", "grouped", "longest_wait_s", value=22.0),
     True),
    (MIXED_WAIT, put("mixed", "runs", "uniform", "grouped", "longest_wait_s", value=22.01),
     False),
    (MIXED_WAIT, put("mixed", "runs", "skewed", "grouped", "bound_s", value=17.99), False),
    # a request never answered: missed whatever its wait
    (MIXED_WAIT, put("mixed", "runs", "skewed", "grouped", "unanswered", value=1), False),
    (MIXED_SHARE, put("mixed", "runs", "skewed", "grouped", "share_ratio_min", value=0.8),
     True),
    (MIXED_SHARE, put("mixed", "runs", "skewed", "grouped", "share_ratio_min", value=0.799),
     False),
    # fifo's and the router's shares are not judged
    (MIXED_SHARE, put("mixed", "runs", "uniform", "fifo", "share_ratio_min", value=0.1), True),
]


@pytest.mark.parametrize(("goal", "change", "met"), BOUNDARIES)
def test_each_goal_at_its_boundary(goal: str, change: Callable[[dict[str, Any]], None],
                                   met: bool) -> None:
    r = full()
    change(r)
    got = rows(r)
    assert got[goal]["met"] is met
    # the others unchanged
    assert all(got[g]["met"] in (True, None) for g in GOALS if g != goal)


def test_sections_not_run_are_null() -> None:
    only_realistic = {"plan": {"rounds": 1}, "machine": {}, "retried": [],
                      "realistic": full()["realistic"]}
    got = rows(only_realistic)
    assert {g for g in GOALS if got[g]["figures"] is not None} == {COLD, SWAP, PARKED}
    for g in set(GOALS) - {COLD, SWAP, PARKED}:
        assert got[g]["met"] is None and got[g]["figure"] == "-", g
    assert got[COLD]["met"] is True
    assert all(row["met"] is None for row in report.verdicts({}))


def test_a_figure_missing_within_a_section_is_null() -> None:
    r = full()
    del r["footprint"]["bare_socket_activation_to_first_answer_ms"]   # an older run
    del r["ceiling"]["bare"]["req_per_s"]                             # no rates measured
    got = rows(r)
    assert got[ACTIVATION]["met"] is None and got[CEILING]["met"] is None
    assert got[COLD]["met"] is True


def test_refusals_name_the_slowest() -> None:
    got = rows(full())
    assert got[REFUSALS]["figure"] == "4300/s (429, the slowest)"
    assert got[REFUSALS]["against"] == "bare 404 5000/s" and got[REFUSALS]["ratio"] == 0.86
    assert got[FLOODED]["figure"] == "5.00 ms" and got[FLOODED]["against"] == "idle 2.00 ms"
    assert got[FLOODED]["ratio"] == 2.5
    r = full()
    r["refusals"]["rates"]["415"]["per_s"] = 1000.0
    assert rows(r)[REFUSALS]["figure"] == "1000/s (415, the slowest)"
    del r["refusals"]["rates"]["421"]   # a refusal not measured: the goal is not judged
    assert rows(r)[REFUSALS]["met"] is None and rows(r)[FLOODED]["met"] is True


def test_refusals_median_per_kind_then_the_slowest() -> None:
    runs = [full(), full(), full()]
    for run, (r401, r429) in zip(runs, ((1000.0, 5000.0), (5000.0, 1000.0), (4000.0, 4100.0)),
                                 strict=True):
        run["refusals"]["rates"]["401"]["per_s"] = r401
        run["refusals"]["rates"]["429"]["per_s"] = r429
    got = {row["goal"]: row for row in report.median_verdicts(runs)}[REFUSALS]
    # medians: 401 4000, 429 4100: the slowest median is 401's, met (0.8x) though each
    # run's slowest was 1000
    assert got["figure"] == "4000/s (401, the slowest)" and got["met"] is True


def test_no_crossover_is_said_not_nulled() -> None:
    r = full()
    r["agent_loop"]["crossover"]["crossover_tokens"] = None
    got = rows(r)
    assert got[CROSSOVER]["figure"] == "none"
    assert got[CROSSOVER]["figures"] == {"crossover_tokens": None, "min_prefix": 256.0,
                                         "max_prefix": 4096.0}


def test_mixed_rows_say_each_mix() -> None:
    got = rows(full())
    swaps = got[MIXED_SWAPS]
    assert swaps["figure"] == "uniform 2.00, skewed 1.00 swaps/min"
    assert swaps["against"] == "fifo 40.0, 20.0"
    assert swaps["ratio"] == {"uniform": {"fifo": 0.05}, "skewed": {"fifo": 0.05}}
    assert swaps["compare"] == "0.050x, 0.050x"
    answers = got[MIXED_ANSWERS]
    assert answers["against"] == "fifo 150, 160; router 200, 250"
    assert answers["compare"] == "2.667x, 3.125x fifo; 2.000x, 2.000x router"
    wait = got[MIXED_WAIT]
    assert wait["figure"] == "uniform 15.0, skewed 18.0 s"
    assert wait["against"] == "bound 22.0, 22.0 s"
    assert wait["difference"] == {"uniform": -7.0, "skewed": -4.0}
    r = full()
    r["mixed"]["runs"]["skewed"]["grouped"]["unanswered"] = 2
    assert rows(r)[MIXED_WAIT]["figure"] == "uniform 15.0, skewed 18.0 s (2 unanswered)"
    assert got[MIXED_SHARE]["figure"] == "uniform 0.900x, skewed 0.850x (the least-served model)"
    json.dumps(report.verdicts(full()), allow_nan=False)


def test_mixed_without_grouped_is_not_run() -> None:
    # a gateway that does not take `schedule` yet: fifo and the router measured, no verdict
    r = full()
    for mix in ("uniform", "skewed"):
        del r["mixed"]["runs"][mix]["grouped"]
    r["mixed"]["not_run"] = {"grouped": "this build's gateway refuses its configuration"}
    got = rows(r)
    for goal in (MIXED_SWAPS, MIXED_ANSWERS, MIXED_P99, MIXED_WAIT, MIXED_SHARE):
        assert got[goal]["met"] is None and got[goal]["figures"] is None, goal
    # one mix measured and not the other: not judged on half
    r = full()
    del r["mixed"]["runs"]["skewed"]
    assert rows(r)[MIXED_SWAPS]["met"] is None


def test_mixed_medians_per_figure() -> None:
    runs = [full(), full(), full()]
    for run, loads in zip(runs, (2.0, 30.0, 12.0), strict=True):
        run["mixed"]["runs"]["uniform"]["grouped"]["loads_per_min"] = loads
    got = {row["goal"]: row for row in report.median_verdicts(runs)}[MIXED_SWAPS]
    # the median 12 against fifo's 40: 0.3x, not met, though two runs of three met it
    assert got["figures"]["uniform_grouped"] == 12.0 and got["met"] is False
    assert got["runs"] == ["uniform 2.00, skewed 1.00 swaps/min",
                           "uniform 30.0, skewed 1.00 swaps/min",
                           "uniform 12.0, skewed 1.00 swaps/min"]


def runs_of(cold: list[tuple[float, float]]) -> list[dict[str, Any]]:
    runs = []
    for g, r in cold:
        run = full()
        run["realistic"]["cold_first_byte_ms"] = {"gateway": g, "router": r}
        runs.append(run)
    return runs


def test_medians_then_the_verdict() -> None:
    # per run 0.1x, 2x and 2.04x the router: the verdict is on the medians, 1000 and 980,
    # each taken alone (1.0204x: not met), not on a median of the verdicts or the ratios
    runs = runs_of([(100.0, 1000.0), (1000.0, 500.0), (2000.0, 980.0)])
    runs[1]["warm"]["c1"]["gateway"]["p50_ms"] = 1.5   # its added p50: +0.5 ms
    runs[2]["warm"]["c1"]["gateway"]["p50_ms"] = 1.4
    got = {row["goal"]: row for row in report.median_verdicts(runs)}
    cold = got[COLD]
    assert cold["figures"] == {"gateway": 1000.0, "router": 980.0}
    assert cold["ratio"] == round(1000 / 980, 3) and cold["met"] is False
    assert cold["runs"] == ["100 ms", "1000 ms", "2000 ms"] and cold["counted"] == 3
    assert got[ADDED]["figures"] == pytest.approx({"gateway_added_ms": 0.4,
                                                   "bare_added_ms": 0.25})
    assert got[ADDED]["met"] is False
    table = "\n".join(report.median_table(report.median_verdicts(runs), 3))
    assert "median of 3 runs" in table and "| 100 ms | 1000 ms | 2000 ms |" in table


def test_medians_over_the_runs_that_have_the_section() -> None:
    runs = runs_of([(1000.0, 1000.0), (1010.0, 1000.0), (0.0, 0.0)])
    del runs[2]["realistic"]
    got = {row["goal"]: row for row in report.median_verdicts(runs)}
    assert got[COLD]["figures"] == {"gateway": 1005.0, "router": 1000.0}
    assert got[COLD]["runs"][2] == "-" and got[COLD]["counted"] == 2
    assert got[ACTIVATION]["counted"] == 3
    assert "(2 of 3 runs)" in "\n".join(report.median_table(report.median_verdicts(runs), 3))


README = """# title

intro

<!-- bench-summary:start -->
placeholder
<!-- bench-summary:end -->

the prose below
"""


def test_readme_block_replaced_markers_and_outside_kept() -> None:
    out = report.replace_block(README, ["| a | b |", "line"])
    assert out == README.replace("placeholder", "| a | b |\nline")
    again = report.replace_block(out, ["new"])
    assert again == README.replace("placeholder", "new")


@pytest.mark.parametrize("text", [
    "no markers at all\n",
    "<!-- bench-summary:start -->\nonly the start\n",
    "<!-- bench-summary:end -->\nx\n<!-- bench-summary:start -->\n",     # reversed
    README + README,                                                      # twice
    "<!-- bench-summary:start -->\n<!-- bench-summary:start -->\n<!-- bench-summary:end -->\n",
])
def test_readme_without_its_markers_refused(text: str) -> None:
    with pytest.raises(report.Refused):
        report.replace_block(text, ["x"])


def write_runs(tmp_path: Path, n: int) -> list[str]:
    paths = []
    for i, run in enumerate(runs_of([(1000.0, 990.0), (1100.0, 1000.0), (900.0, 1000.0)][:n])):
        p = tmp_path / f"2025010{i}T000000Z-full.json"
        p.write_text(json.dumps(run))
        paths.append(str(p))
    return paths


def test_runs_write_the_readme(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(README)
    paths = write_runs(tmp_path, 3)
    assert report.main(["--runs", *paths, "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nintro\n\n<!-- bench-summary:start -->\n| goal |")
    assert text.endswith("\n<!-- bench-summary:end -->\n\nthe prose below\n")
    assert "placeholder" not in text
    assert "| cold start, realistic model, page cache | 1000 ms | 1000 ms | 1100 ms | 900 ms |" \
        in text
    assert "Machine: Test CPU, 2 cores, Python 3.11.2; 3 runs: run 1 " \
           "`20250100T000000Z-full.json`" in text
    assert f"generated by `python -m bench.report --runs {' '.join(paths)} --readme {readme}`; " \
           "do not edit by hand." in text
    assert "| goal |" in capsys.readouterr().out


def test_runs_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    paths = write_runs(tmp_path, 1)
    assert report.main(["--runs", *paths, "--readme", str(readme)]) == 2
    assert "bench-summary:start" in capsys.readouterr().err
    assert readme.read_text() == "# no markers\n"
    with pytest.raises(SystemExit) as e:
        report.main(["--runs"])
    assert e.value.code == 2
    (tmp_path / "broken.json").write_text("{")
    assert report.main(["--runs", str(tmp_path / "broken.json")]) == 2
    with pytest.raises(report.Refused):
        report.summary([], [], "cmd")


def test_report_of_one_section(tmp_path: Path) -> None:
    r = {"plan": {"rounds": 1}, "machine": {"cpu": "Test CPU", "cores": 2}, "retried": [],
         "agent_loop": full()["agent_loop"], "seconds": 12.0}
    report.write_report(r, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert md.index("## Verdicts") < md.index("## Agent loop")
    assert "| agent-loop turn, 4k prefix | 100 ms | router 900 ms (0.111x) |" in md
    assert "| c=1 added p50 | - | - |" in md and "not run" in md
    assert "## Warm requests" not in md and "latency.png" not in md
    assert not (tmp_path / "latency.png").exists()


def test_report_of_a_full_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")   # the plot (bench extra)
    r = full()
    r["retried"] = [{"what": "slots, 16 streams", "error": "RuntimeError: reset"}]
    del r["realistic"]["cold_dropped_first_byte_ms"]
    r["realistic"]["dropped_note"] = "not root"
    report.write_report(copy.deepcopy(r), tmp_path)
    md = (tmp_path / "results.md").read_text()
    for heading in ("## Verdicts", "## Warm requests", "## Proxy ceiling", "## Streaming",
                    "## Cold start and swap", "## Footprint", "## Realistic model",
                    "## Agent loop", "## Parallel slots", "## Many clients", "## Refusals",
                    "## Mixed traffic", "## Retried once"):
        assert heading in md
    assert "page cache dropped: not measured (not root)" in md
    assert "- slots, 16 streams: RuntimeError: reset" in md
    assert "| 429 | 4300 | 4200-4400 | 0.860x | 90.0 | 0 |" in md
    assert "| bare 404 | 5000 | 4900-5100 | 1.000x | 90.0 | 0 |" in md
    assert "| chat, flood | 3.0 | 5.0 | 9.0 | 300 |" in md
    assert "the load generator took 0.3 of a core" in md
    assert "## Mixed traffic (16 clients, 3 models (realistic, 1.10 GiB) over 2 places, " \
           "8-token answers, 180.0 s per system and mix; grouped: max_wait_s 20.0)" in md
    assert "| uniform | fifo | 150.0 | 40.0 | 26.67 | 2666.7 | 8000.0 | 30.0 | 1.0 | 0 | 0 |" \
        in md
    assert "| mix | system | mix-a | mix-b | mix-c |" in md
    assert "| skewed | router | 0.700 / 0.700 (1.000x) | 0.200 / 0.200 (1.000x) | " \
           "0.100 / 0.100 (1.000x) |" in md
    assert "grouped's longest wait (to the first token) against its bound: uniform 15.0 s " \
           "against 20.0 + 1.5 (load) + 0.5 (drain) = 22.0 s; skewed 18.0 s" in md
    assert (tmp_path / "latency.png").exists()


def test_suite_stores_the_verdicts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from bench import suite

    async def fake_suite(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return full()
    monkeypatch.setattr(suite, "suite", fake_suite)
    monkeypatch.setattr(suite, "cleanup", lambda: None)

    def no_journal(*args: Any, **kwargs: Any) -> None:
        raise OSError("no journalctl here")
    monkeypatch.setattr("bench.suite.subprocess.run", no_journal)
    assert suite.main(["--out", str(tmp_path), "--llama-server", "x"]) == 0
    stored = json.loads((tmp_path / "results.json").read_text())
    assert [row["goal"] for row in stored["verdicts"]] == GOALS
    assert stored["verdicts"][1]["met"] is True
