"""The metrics adapter's own rules: systemd's figures reach the exposition only where
systemd has them, engines' own metrics are merged by family with a model label, memory
is labelled by budget and figure, and an OOM kill is counted as one."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.adapters.metrics import EngineFigures, GatewayMetrics, Snapshot
from gatewayd.adapters.unit_control import info_from_properties
from gatewayd.core.engines import Engine, EngineState, Failure

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
    assert m[("llm_gateway_engine_unit_restarts_total", a)] == 1
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


def test_each_engines_memory_and_each_budget_are_labelled_by_memory_and_figure() -> None:
    mib = 1 << 20
    snapshot = Snapshot(engines=[
        EngineFigures("a", "ready", restarts=0, memory={
            ("ram", "need"): 900 * mib, ("ram", "measured"): 700 * mib,
            ("ram", "peak"): 800 * mib, ("vram", "need"): 5000 * mib}),
        EngineFigures("b", "loading", restarts=0)],
        budgets={("ram", "total"): 16000 * mib, ("ram", "free"): 9000 * mib,
                 ("gpu", "claimed"): 4000 * mib})
    m = _samples(GatewayMetrics().render(snapshot))

    def engine(model: str, memory: str, figure: str) -> float | None:
        return m.get(("llm_gateway_memory_engine_bytes", (
            ("figure", figure), ("memory", memory), ("model", model))))
    assert engine("a", "ram", "measured") == 700 * mib
    assert engine("a", "ram", "peak") == 800 * mib
    assert engine("a", "vram", "need") == 5000 * mib
    assert engine("a", "vram", "measured") is None and engine("b", "ram", "need") is None
    assert m[("llm_gateway_memory_budget_bytes", (("figure", "free"), ("memory", "ram")))] \
        == 9000 * mib
    assert m[("llm_gateway_memory_budget_bytes", (("figure", "claimed"), ("memory", "gpu")))] \
        == 4000 * mib


def _engine(state: EngineState, failure: Failure | None = None) -> Engine:
    return Engine("a", "llm-engine-a.service", "/run/a.sock", state=state, failure=failure)


def test_an_oom_kill_is_a_failure_of_kind_oom_on_either_cgroup_version() -> None:
    """cgroup v2: systemd says Result=oom-kill, the restart itself is "oom". cgroup v1:
    systemd sees a SIGKILL (a "signal" restart); the gateway's verdict, from the cgroup's
    OOM counter, is the failure that follows, counted "oom"."""
    metrics = GatewayMetrics()
    ready = _engine(EngineState.READY)
    sigkill = Failure("killed by SIGKILL", signal=9)
    v1 = _engine(EngineState.RESTARTING, sigkill)
    metrics.on_engine_change(ready, v1, None)
    metrics.on_engine_change(v1, _engine(EngineState.FAILED, Failure(
        "killed for want of memory", signal=9, out_of_memory=True)), None)
    v2 = _engine(EngineState.RESTARTING, Failure("killed by SIGKILL (oom-kill)", signal=9))
    metrics.on_engine_change(ready, v2, None)
    metrics.on_engine_change(ready, _engine(EngineState.FAILED, sigkill), None)
    m = _samples(metrics.render(Snapshot()))
    assert m[("llm_gateway_engine_restarts_total", (("model", "a"), ("reason", "signal")))] == 1
    assert m[("llm_gateway_engine_restarts_total", (("model", "a"), ("reason", "oom")))] == 1
    assert m[("llm_gateway_engine_failures_total", (("kind", "oom"), ("model", "a")))] == 1
    assert m[("llm_gateway_engine_failures_total", (("kind", "signal"), ("model", "a")))] == 1


def test_short_of_ram_is_a_rejection_like_short_of_gpu_memory() -> None:
    from gatewayd.adapters.records import CallRecord
    metrics = GatewayMetrics()
    for code in ("insufficient_memory", "insufficient_gpu"):
        record = CallRecord(ts=0, method="POST", endpoint="/v1/completions", model="a",
                            status=503, error_code=code)
        metrics.observe_call(record)
    m = _samples(metrics.render(Snapshot()))
    for code in ("insufficient_memory", "insufficient_gpu"):
        assert m[("llm_gateway_rejected_total", (("model", "a"), ("reason", code)))] == 1


def test_no_family_is_exported_twice() -> None:
    """Prometheus refuses a whole scrape where a name has a second TYPE line."""
    snapshot = Snapshot(max_engines=2, engines=[EngineFigures("a", "ready", restarts=1)])
    text = GatewayMetrics().render(snapshot)
    types = [line.split()[2] for line in text.decode().splitlines()
             if line.startswith("# TYPE")]
    assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)


def test_waits_by_reason_and_class_and_the_bounds_near_misses() -> None:
    from gatewayd.core.priority import HIGH, LOW
    from gatewayd.core.waits import Waited
    m = GatewayMetrics()
    m.observe_wait(Waited("b", LOW, {"room": 19.0, "load": 2.0}, True, "near"))
    m.observe_wait(Waited("b", HIGH, {"load": 0.3}, True, None))
    m.observe_wait(Waited("b", LOW, {"room": 45.0}, False, "reached"))   # then a 503
    samples = _samples(m.render(Snapshot()))
    count = "llm_gateway_wait_seconds_count"
    assert samples[count, (("model", "b"), ("priority", "low"), ("reason", "room"))] == 1
    assert samples["llm_gateway_wait_seconds_sum", (
        ("model", "b"), ("priority", "low"), ("reason", "room"))] == 19.0
    assert samples[count, (("model", "b"), ("priority", "low"), ("reason", "load"))] == 1
    assert samples[count, (("model", "b"), ("priority", "high"), ("reason", "load"))] == 1
    assert samples["llm_gateway_wait_seconds_bucket", (
        ("le", "20.0"), ("model", "b"), ("priority", "low"), ("reason", "room"))] == 1
    misses = "llm_gateway_max_wait_near_misses_total"
    assert samples[misses, (("kind", "near"), ("model", "b"), ("priority", "low"))] == 1
    assert samples[misses, (("kind", "reached"), ("model", "b"), ("priority", "low"))] == 1
    assert sum(v for (name, _), v in samples.items() if name == misses) == 2
