"""The Grafana dashboard (packaging/grafana/llm-gateway.json) against the gateway's real
/admin/metrics: every query parses as PromQL (promql_parser, Prometheus's grammar in
Rust), and every metric and label it names is one the gateway exports: scraped from a
gateway on fakes after chat and streamed traffic, or, for the families that exist only
with a GPU or remote upstreams, named in gatewayd/adapters/metrics.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.core.engines import CLD_EXITED
from tests.http.test_front_door import _gateway, chat
from tests.unit.test_engine_restart import crash, restart
from tests.unit.test_ram_budget import FakeHost, FakeMeter

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "packaging" / "grafana" / "llm-gateway.json"
METRICS_SOURCE = REPO / "gatewayd" / "adapters" / "metrics.py"
# Grafana's variables, as Grafana substitutes them before a query reaches Prometheus
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
# exported only where there is what they measure
CONDITIONAL = {"llm_gateway_gpu_memory_used_bytes": "NVML",
               "llm_gateway_gpu_memory_total_bytes": "NVML",
               "llm_gateway_upstream_up": "[upstreams]",
               "llm_gateway_upstream_requests_in_flight": "[upstreams]"}


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in board["panels"] for t in p["targets"]]
    model = next(v for v in board["templating"]["list"] if v["name"] == "model")
    found = re.fullmatch(r"label_values\((.+), model\)", model["definition"])
    assert found is not None, model["definition"]
    queries.append(found.group(1))
    return queries


def parse(query: str) -> Any:
    for name, value in GRAFANA_VARIABLES.items():
        query = query.replace(name, value)
    return promql_parser.parse(query)


def selectors(node: Any) -> Iterator[tuple[str, set[str]]]:
    """(metric name, label names) of every series the expression reads, and the label
    names it groups by (under the name "")."""
    if isinstance(node, promql_parser.VectorSelector):
        labels = {m.name for m in node.matchers.matchers} - {"__name__"}
        yield node.name or "", labels
    elif isinstance(node, promql_parser.MatrixSelector):
        yield from selectors(node.vector_selector)
    elif isinstance(node, promql_parser.AggregateExpr):
        if node.modifier is not None:
            yield "", set(node.modifier.labels) - {"le"}
        yield from selectors(node.expr)
    elif isinstance(node, promql_parser.Call):
        for arg in node.args:
            yield from selectors(arg)
    elif isinstance(node, promql_parser.BinaryExpr):
        yield from selectors(node.lhs)
        yield from selectors(node.rhs)
    elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr,
                           promql_parser.SubqueryExpr)):
        yield from selectors(node.expr)


async def exported(tmp_path: Path) -> dict[str, set[str]]:
    """sample name -> its label names, scraped after what each family counts has
    happened once: a chat and a stream, a rejection, an eviction (its request waited, past
    a max_wait_s this short), a restart, a failure."""
    names: dict[str, set[str]] = {}
    async for gw in _gateway(tmp_path, ("a",), max_engines=1, host=FakeHost(),
                             meter=FakeMeter(), max_wait_s=1e-6):
        c = gw.client
        assert (await c.post("/v1/chat/completions", json=chat("a"))).status == 200
        resp = await c.post("/v1/chat/completions", json=chat("a", stream=True))
        assert resp.status == 200
        await resp.read()
        resp = await c.post("/v1/chat/completions?autoload=false", json=chat("b"))
        assert resp.status == 503                              # rejected: model_not_loaded
        assert (await c.post("/v1/chat/completions", json=chat("b"))).status == 200  # evicts a
        await crash(gw.units, "b")                               # systemd restarts it
        await restart(gw.units, "b", pid=4242)
        await crash(gw.units, "b", code=CLD_EXITED, status=3)   # and then gives up
        gw.units.emit(gw.units.layout("b").unit, ActiveState="failed", SubState="failed",
                      Result="exit-code")
        await gw.units.delivered()
        text = await (await c.get("/admin/metrics")).text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_every_query_parses_as_promql() -> None:
    queries = dashboard_queries()
    assert len(queries) >= 26
    for query in queries:
        parse(query)          # raises on a query Prometheus would refuse


async def test_every_metric_and_label_the_dashboard_names_is_exported(tmp_path: Path) -> None:
    names = await exported(tmp_path)
    source = METRICS_SOURCE.read_text()
    missing = []
    for query in dashboard_queries():
        read = list(selectors(parse(query)))
        metrics = {name for name, _ in read if name}
        for name, labels in read:
            if not name:      # a grouping: some series it reads carries each label
                carried = any(labels <= names.get(m, set()) for m in metrics
                              if m not in CONDITIONAL)
                if not carried and not all(m in CONDITIONAL for m in metrics):
                    missing.append(f"{query}: grouped by {sorted(labels)}")
                continue
            if name in CONDITIONAL:
                assert f'"{name}"' in source, name
                continue
            if name not in names:
                missing.append(f"{query}: {name} is not exported")
            elif not labels <= names[name]:
                missing.append(f"{query}: {name} has no {sorted(labels - names[name])}")
    assert missing == []


async def test_the_dashboard_shows_swaps_and_waits_by_reason_and_class(
        tmp_path: Path) -> None:
    """Issue 51's figures: swaps per minute (loads and evictions), waits by reason and by
    class, the bound's near misses; and the scrape has each reason a wait for an engine
    can have had here (its model's turn for a place, the load)."""
    read = {name: labels for q in dashboard_queries() for name, labels in selectors(parse(q))
            if name}
    assert "llm_gateway_engine_starts_total" in read and "llm_gateway_evictions_total" in read
    assert "llm_gateway_max_wait_near_misses_total" in read
    groupings = [labels for q in dashboard_queries() if "llm_gateway_wait_seconds" in q
                 for name, labels in selectors(parse(q)) if not name]
    assert {"reason"} in groupings and {"priority"} in groupings
    names = await exported(tmp_path)
    assert {"model", "reason", "priority"} <= names["llm_gateway_wait_seconds_bucket"]
    assert {"model", "priority", "kind"} <= names["llm_gateway_max_wait_near_misses_total"]


def test_the_checks_catch_a_broken_query_and_read_what_a_query_names() -> None:
    with pytest.raises(ValueError, match="unclosed left parenthesis"):
        parse("sum by (model) (rate(llm_gateway_requests_total[$__rate_interval])")
    read = dict(selectors(parse('sum by (model) (rate(llm_gateway_request_total[5m]))')))
    assert "llm_gateway_request_total" in read and read[""] == {"model"}
