"""bench/mixed.py's figures from what the clients and each system said: the window, the
shares, the longest wait and its bound, the router's journal."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench import mixed
from bench.mixed import Answer, Load

NAMES = ("a", "b", "c")


def answer(model: str, sent: float, wait: float, drain: float = 0.5) -> Answer:
    return Answer(model, sent, sent + wait, sent + wait + drain)


def test_window_shares_and_bound() -> None:
    # a window of 60 s from t=1000: a and b answered inside it, c's one answer came after
    load = Load(answers=[answer("a", 1000, 1.0), answer("a", 1010, 2.0),
                         answer("b", 1020, 3.0, drain=1.5), answer("c", 1055, 9.0)],
                asked=Counter(a=2, b=1, c=1))
    f = mixed.summarise(load, (0.5, 0.25, 0.25), NAMES, 1000.0, 1060.0,
                        load_ends=[999.0, 1030.0, 1061.0], load_s=[0.8, 1.2, 0.9],
                        max_wait_s=20.0)
    assert f["answers"] == 3 and f["answers_per_min"] == 3.0
    assert f["answered_after_window"] == 1
    assert f["loads"] == 1 and f["loads_per_min"] == 1.0   # the ones before and after: no
    assert f["loads_per_100_answers"] == pytest.approx(33.33)
    assert f["longest_wait_s"] == 9.0 and f["longest_load_s"] == 1.2
    assert f["longest_drain_s"] == 1.5
    assert f["bound_s"] == 22.7 and f["max_wait_s"] == 20.0
    # c asked a quarter of the requests and got none of the answers inside the window
    assert f["share"]["a"] == {"weight": 0.5, "asked": 2, "answered": 2, "demand": 0.5,
                               "answers": 0.6667, "ratio": 1.333}
    assert f["share"]["c"]["ratio"] == 0.0 and f["share_ratio_min"] == 0.0
    # p50/p99 over every answer, the late one too (request to the last token)
    assert f["p99_ms"] == 9500.0 and f["p50_ms"] == 4500.0   # (suite.pct: nearest rank)
    json.dumps(f, allow_nan=False)


def test_unanswered_requests_count_as_waits_and_no_bound_without_max_wait() -> None:
    load = Load(answers=[answer("a", 1000, 1.0)], asked=Counter(a=1, b=1),
                unanswered=[("b", 150.0)], errors=Counter({"HTTP 503": 2}))
    f = mixed.summarise(load, (0.5, 0.5, 0.0), NAMES, 1000.0, 1030.0, [], [], None)
    assert f["unanswered"] == 1 and f["longest_wait_s"] == 150.0
    assert f["errors"] == 2 and f["error_kinds"] == {"HTTP 503": 2}
    assert "bound_s" not in f and f["longest_load_s"] is None
    assert f["share"]["c"]["demand"] == 0.0 and f["share"]["c"]["ratio"] is None
    assert f["share_ratio_min"] == 0.0   # b: half the demand, no answer


def test_no_answer_at_all_is_no_figure_not_nan() -> None:
    f = mixed.summarise(Load(asked=Counter(a=3)), (1.0, 0.0, 0.0), NAMES, 0.0, 60.0, [], [],
                        20.0)
    assert f["answers"] == 0 and f["p99_ms"] is None and f["longest_wait_s"] is None
    assert f["share_ratio_min"] is None and f["loads_per_100_answers"] is None
    json.dumps(f, allow_nan=False)


def journal(ts: float, message: str) -> str:
    return json.dumps({"__REALTIME_TIMESTAMP": str(int(ts * 1e6)), "MESSAGE": message})


def test_router_journal() -> None:
    lines = [
        journal(99.0, "srv  load_models: spawning server instance with name=mix-a on port 40001"),
        journal(101.0, "srv  load_models: spawning server instance with name=mix-c on port 40002"),
        journal(102.0, "[40002] 00.01.234.500 I srv  llama_server: model loaded"),
        journal(102.1, "00.00.100.000 I srv  llama_server: model loaded"),   # the router's own
        json.dumps({"__REALTIME_TIMESTAMP": "103000000", "MESSAGE": [104, 105]}),   # bytes
        "not json",
        journal(104.0, "srv  load_models: spawning server instance with name=mix-b on port 40003"),
    ]
    spawned, loads = mixed.parse_router_journal(lines, since=100.0)
    assert spawned == [101.0, 104.0]
    assert loads == [pytest.approx(1.2345)]


def test_config_says_the_order_only_when_asked(tmp_path: Path) -> None:
    weights = {name: tmp_path / f"{name}.gguf" for name in mixed.NAMES}
    grouped = mixed.gateway_config("grouped", 20.0, weights, "/bin/llama", tmp_path, 18670)
    assert 'schedule = "grouped"\nmax_wait_s = 20\n' in grouped
    assert grouped.index("max_wait_s") < grouped.index("[listen]")   # top-level keys
    fifo = mixed.gateway_config("fifo", 20.0, weights, "/bin/llama", tmp_path, 18671)
    assert 'schedule = "fifo"\n' in fifo and "max_wait_s" not in fifo
    before = mixed.gateway_config(None, 20.0, weights, "/bin/llama", tmp_path, 18671)
    assert "schedule" not in before and "max_engines = 2" in before
    assert mixed.config_refused(before) is None
    assert "unknown key" in (mixed.config_refused(before + "[listen2]\nx = 1\n") or "")
