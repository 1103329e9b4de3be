"""`llm-gateway stats`: /admin/series's totals as a table (the gateway stubbed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gatewayd import cli


def total(model: str | None, **kw: Any) -> dict[str, Any]:
    return {"model": model, "calls": 0, "errors": 0, "rejected": 0, "latency_p50_ms": None,
            "latency_p95_ms": None, "ttft_p50_ms": None, "ttft_p95_ms": None,
            "tokens_per_s": None, **kw}


def test_stats_prints_the_totals_with_human_figures(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    answer: dict[str, Any] = {"window": "24h", "start": 0, "step_s": 1200, "buckets": 73,
                              "now": 1.0, "latency_bounds_ms": [], "models": ["qwen"],
                              "series": [], "totals": [
        total("qwen", calls=1200, errors=3, rejected=40, latency_p50_ms=812.4,
              latency_p95_ms=7916.6, ttft_p50_ms=4.25, tokens_per_s=31.456),
        total(None, calls=2, errors=2, latency_p50_ms=0.4, latency_p95_ms=0.9)]}
    asked = []

    def call(url: str, method: str, path: str, body: Any = None) -> Any:
        asked.append((method, path))
        return answer

    monkeypatch.setattr(cli, "call", call)
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
    assert cli.main(["--url", "http://gw", "stats", "--window", "24h", "--model", "qwen"]) == 0
    assert asked == [("GET", "/admin/series?window=24h&model=qwen")]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "last 24h: 1202 calls, 5 errors, 40 rejected (429/503: not admitted)"
    assert [line.split() for line in lines[1:]] == [
        ["MODEL", "CALLS", "ERRORS", "REJECTED", "P50", "P95", "TTFT_P50", "TOKENS/S"],
        ["qwen", "1200", "3", "40", "812", "ms", "7.9", "s", "4.2", "ms", "31.5"],
        ["(no", "model)", "2", "2", "0", "0.4", "ms", "0.9", "ms", "-", "-"]]
    assert cli.main(["--url", "http://gw", "--json", "stats"]) == 0
    assert asked[-1] == ("GET", "/admin/series?window=1h")
    assert json.loads(capsys.readouterr().out) == answer
    answer["totals"] = []
    assert cli.main(["--url", "http://gw", "stats", "--window", "15m"]) == 0
    assert capsys.readouterr().out == "no calls in the last 24h\n"   # (the stub's window)
    with pytest.raises(SystemExit):
        cli.main(["--url", "http://gw", "stats", "--window", "2h"])
