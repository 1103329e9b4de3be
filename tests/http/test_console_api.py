"""GET /admin/series (the status page's charts) and `llm-gateway stats`, over the real
HTTP stack against fake engines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gatewayd import cli
from gatewayd.core import series
from tests.http.test_front_door import _gateway, chat


async def test_calls_are_in_their_buckets_and_a_refusal_is_rejected(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), models_config={"c": {"queue_limit": 0}}):
        for model in ("a", "a", "b"):
            resp = await gw.client.post("/v1/chat/completions", json=chat(model))
            assert resp.status == 200
        resp = await gw.client.post("/v1/chat/completions", json=chat("c"))
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "queue_full"
        rows = await gw.records(4)

        resp = await gw.client.get("/admin/series", params={"window": "15m"})
        assert resp.status == 200, await resp.text()
        out = await resp.json()
        assert (out["window"], out["step_s"], out["buckets"]) == ("15m", 15, 61)
        assert out["start"] % 15 == 0 and out["start"] <= out["now"] - 900 < out["start"] + 15
        assert out["latency_bounds_ms"] == list(series.LATENCY_BOUNDS_MS)
        assert out["models"] == ["a", "b", "c"]
        expected: dict[tuple[int, str], list[int]] = {}   # (bucket, model): [calls, rejected]
        for row in rows:
            cell = expected.setdefault(
                (series.bucket_index(row["ts"], out["start"], 15), row["model"]), [0, 0])
            cell[0] += 1
            cell[1] += row["status"] == 503
        got = {(c["bucket"], c["model"]): [c["calls"], c["rejected"]] for c in out["series"]}
        assert got == expected
        assert all(0 <= b < 61 for b, _ in got)
        assert {b for b, _ in got} <= {out["buckets"] - 1, out["buckets"] - 2}   # just now
        for c in out["series"]:
            assert sum(c["latency"]) == c["calls"] and len(c["latency"]) == series.BINS
            assert c["errors"] == 0
        totals = {t["model"]: t for t in out["totals"]}
        assert (totals["a"]["calls"], totals["c"]["rejected"], totals["c"]["errors"]) == (2, 1, 0)
        latencies = sorted(r["latency_ms"] for r in rows if r["model"] == "a")
        assert totals["a"]["latency_p50_ms"] == round(latencies[0], 1)   # nearest rank of 2
        assert totals["a"]["latency_p95_ms"] == round(latencies[1], 1)
        assert totals["a"]["tokens_per_s"] is not None                   # 4 tokens each

        only = await (await gw.client.get("/admin/series", params={
            "window": "24h", "model": "b"})).json()
        assert (only["step_s"], only["models"]) == (1200, ["b"])
        assert [c["calls"] for c in only["series"]] == [1]
        default = await (await gw.client.get("/admin/series")).json()
        assert (default["window"], default["step_s"]) == ("1h", 60)

        resp = await gw.client.get("/admin/series", params={"window": "2h"})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error", "invalid_request", "window")
        assert "15m" in error["message"]

        # `llm-gateway stats` reads the same
        monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
        url = str(gw.client.make_url("")).rstrip("/")
        assert await asyncio.to_thread(cli.main, ["--url", url, "stats", "--window",
                                                  "15m"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == "last 15m: 4 calls, 0 errors, 1 rejected (429/503: not admitted)"
        assert lines[1].split() == ["MODEL", "CALLS", "ERRORS", "REJECTED", "P50", "P95",
                                    "TTFT_P50", "TOKENS/S"]
        assert [line.split()[:4] for line in lines[2:]] == [
            ["a", "2", "0", "0"], ["b", "1", "0", "0"], ["c", "1", "0", "1"]]
        assert await asyncio.to_thread(cli.main, ["--url", url, "--json", "stats", "--model",
                                                  "a"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["window"] == "1h" and answer["models"] == ["a"]
