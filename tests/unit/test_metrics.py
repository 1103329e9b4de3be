"""The metrics adapter's own rules: systemd's figures reach the exposition only where
systemd has them, and engines' own metrics are merged by family with a model label."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.adapters.metrics import EngineFigures, GatewayMetrics, Snapshot
from gatewayd.adapters.unit_control import info_from_properties

UNSET = 2**64 - 1

LLAMA_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
"""


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_systemd_accounting_is_read_and_unset_means_unknown() -> None:
    service = {"MainPID": 7, "MemoryCurrent": 5 << 20, "CPUUsageNSec": 2_500_000_000}
    info = info_from_properties("u.service", {"ActiveState": "active"}, service)
    assert (info.memory_bytes, info.cpu_ns) == (5 << 20, 2_500_000_000)
    info = info_from_properties("u.service", {}, {"MemoryCurrent": UNSET, "CPUUsageNSec": UNSET})
    assert (info.memory_bytes, info.cpu_ns) == (None, None)


def test_snapshot_figures_and_absent_accounting() -> None:
    snapshot = Snapshot(max_engines=2, engines=[
        EngineFigures("a", "ready", restarts=1, in_flight=2, queued=3, memory_bytes=1 << 30,
                      cpu_seconds=2.5),
        EngineFigures("b", "loading", restarts=0)],
        gpus=[("GPU-1", 1 << 30, 4 << 30)])
    m = _samples(GatewayMetrics().render(snapshot))
    a, b = (("model", "a"),), (("model", "b"),)
    assert m[("llm_gateway_engine_memory_bytes", a)] == 1 << 30
    assert m[("llm_gateway_engine_cpu_seconds_total", a)] == 2.5
    assert ("llm_gateway_engine_memory_bytes", b) not in m       # unknown is absent, not 0
    assert m[("llm_gateway_engine_restarts_total", a)] == 1
    assert m[("llm_gateway_requests_in_flight", a)] == 2
    assert m[("llm_gateway_queue_depth", a)] == 3
    assert m[("llm_gateway_engine_state", (("model", "b"), ("state", "loading")))] == 1
    assert m[("llm_gateway_engines_running", ())] == 2
    assert m[("llm_gateway_gpu_memory_total_bytes", (("device", "GPU-1"),))] == 4 << 30


def test_engines_own_metrics_merge_by_family_with_a_model_label() -> None:
    text = GatewayMetrics().render(Snapshot(), {"a": LLAMA_METRICS, "b": LLAMA_METRICS,
                                               "broken": "not {{ metrics"})
    m = _samples(text)
    assert m[("llamacpp_prompt_tokens_total", (("model", "a"),))] == 12
    assert m[("llamacpp_prompt_tokens_total", (("model", "b"),))] == 12
    assert m[("llamacpp_requests_processing", (("model", "b"),))] == 1
    assert text.count(b"# TYPE llamacpp_prompt_tokens_total counter") == 1   # one family
    assert b"broken" not in text


def test_histograms_are_cumulative_with_le_bounds() -> None:
    from gatewayd.adapters.records import CallRecord
    metrics = GatewayMetrics()
    for latency_ms in (3.0, 5.0, 20.0, 500_000.0):     # 5 ms lands in le=0.005 (<=)
        record = CallRecord(ts=0, method="POST", endpoint="/v1/completions")
        record.model, record.status, record.latency_ms = "a", 200, latency_ms
        metrics.observe_call(record)
    m = _samples(metrics.render(Snapshot()))
    key = (("endpoint", "/v1/completions"), ("model", "a"))

    def bucket(le: str) -> float:
        return m[("llm_gateway_request_duration_seconds_bucket", tuple(sorted(
            (*key, ("le", le)))))]
    assert [bucket(le) for le in ("0.005", "0.01", "0.025", "300.0", "+Inf")] == [2, 2, 3, 3, 4]
    assert m[("llm_gateway_request_duration_seconds_count", key)] == 4
    assert m[("llm_gateway_request_duration_seconds_sum", key)] == pytest.approx(500.028)
