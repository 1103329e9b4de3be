"""Prometheus metrics (prometheus_client): what the gateway counts as it goes, and what
it reads at scrape time.

On the request path there is only `observe_call`, once per finished call (the
same moment its record is queued), and `observe_wait`, once per request that waited
for an engine: a few additions to plain dictionaries; prometheus_client builds the
exposition from them only when scraped.
Engine starts, loads and evictions are counted from the engine manager's state
changes. Everything that is a current value (engine
states, queues, in-flight requests, systemd's memory and CPU per unit, each engine's
RAM and VRAM, each memory budget, restarts) is read only when someone scrapes
(`Snapshot`), so it costs nothing between scrapes.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from gatewayd.adapters.records import CallRecord
from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.model_server import KvUse, Warm, host_kv
from gatewayd.core.priority import NAMES
from gatewayd.core.routing import CAPABILITY_OF_PATH, WHISPER_PATHS
from gatewayd.core.waits import Waited

if TYPE_CHECKING:
    from prometheus_client.core import Metric

# prometheus_client is imported where a scrape needs it, not here: it is a large part of
# the gateway's start-up (on the socket-activation path), and only a scrape uses it
# (docs/benchmarks.md, "Figures behind choices in the code").

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# endpoint label values: the paths the gateway knows; anything else is "other", so a
# client inventing paths cannot grow the number of series without bound
KNOWN_ENDPOINTS = frozenset({
    *CAPABILITY_OF_PATH, *WHISPER_PATHS, "/v1/responses/input_tokens",
    "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/apply-template", "/props",
    "/metrics", "/slots", "/v1/models"})
# why a request was turned away (429/503), by the error code it got
REJECTIONS = frozenset({"concurrency_limit", "queue_full", "engine_limit_reached",
                        "insufficient_gpu", "insufficient_memory", "model_not_loaded",
                        "no_engine_ready", "engine_busy"})
# an eviction's stop reason says more after its first word ("evicted for 'b' (...)"):
# the label is the first word, a closed set
EVICTION_REASONS = frozenset({"evicted", "idle_ttl"})
# llm_gateway_bounded's `bound` label of a call refused or cut off by a bound, by its
# error code (the bounds counted elsewhere come with the scrape's Snapshot)
BOUND_OF_CODE: Mapping[str, str] = {"queue_full": "queue_limit",
                                    "answer_too_large": "max_answer_mb",
                                    "event_too_large": "max_event_mb"}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LOAD_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
# a wait for an engine: a turn at a ready one (milliseconds) up to the bound (max_wait_s,
# 20 s by default) plus a drain and a load
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


class _Counts:
    """A labelled counter kept as a plain dict (the event loop is one thread: no lock)."""

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name, self.doc, self.labels = name, doc, list(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...], amount: float = 1) -> None:
        self.values[key] = self.values.get(key, 0) + amount

    def family(self) -> Metric:
        from prometheus_client.core import CounterMetricFamily
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, value in self.values.items():
            family.add_metric(list(key), value)
        return family


class _Histograms:
    """A labelled histogram kept as bucket counts per label key."""

    def __init__(self, name: str, doc: str, labels: Sequence[str],
                 buckets: Sequence[float]) -> None:
        self.name, self.doc, self.labels, self.buckets = name, doc, list(labels), buckets
        self.values: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        found = self.values.get(key)
        if found is None:
            found = self.values[key] = ([0] * (len(self.buckets) + 1), [0.0])
        found[0][bisect_left(self.buckets, value)] += 1   # le: the first bound >= value
        found[1][0] += value

    def family(self) -> Metric:
        from prometheus_client.core import HistogramMetricFamily
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        bounds = [*(_bound(b) for b in self.buckets), "+Inf"]
        for key, (counts, total) in self.values.items():
            family.add_metric(list(key), list(zip(bounds, accumulate(counts), strict=True)),
                              sum_value=total[0])
        return family


class GatewayMetrics:
    """The counters and histograms; `render` adds the scrape-time figures.

    Kept as plain dictionaries and turned into prometheus_client's metric families only
    when scraped: prometheus_client's own Counter/Histogram take a lock per update,
    several times the CPU per call of this way (docs/benchmarks.md, "Figures behind
    choices in the code")."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.requests = _Counts("llm_gateway_requests", "Requests answered, by status",
                                ["model", "endpoint", "status"])
        self.duration = _Histograms("llm_gateway_request_duration_seconds",
                                    "Time from request to the end of the answer",
                                    ["model", "endpoint"], LATENCY_BUCKETS)
        self.ttft = _Histograms("llm_gateway_time_to_first_token_seconds",
                                "Time from request to the first streamed event", ["model"],
                                LATENCY_BUCKETS)
        self.tokens = _Counts("llm_gateway_tokens", "Tokens, as the engines counted them",
                              ["model", "kind"])
        self.rejected = _Counts("llm_gateway_rejected",
                                "Requests turned away (429/503), by reason", ["model", "reason"])
        self.starts = _Counts("llm_gateway_engine_starts", "Engine starts, by result",
                              ["model", "result"])
        self.load = _Histograms("llm_gateway_engine_load_seconds",
                                "Time from an engine's start to ready", ["model"], LOAD_BUCKETS)
        self.upstream_requests = _Counts("llm_gateway_upstream_requests",
                                         "Requests sent to (or refused for) remote upstreams, "
                                         "by status", ["upstream", "status"])
        self.restarts = _Counts("llm_gateway_engine_restarts",
                                "Engines restarted by systemd after their process ended, by "
                                "why (exit, signal, oom, hung: killed by the liveness check)",
                                ["model", "reason"])
        # an OOM kill on a cgroup-v1 host reaches systemd as a plain SIGKILL: its restart
        # is counted as "signal", and only the failure that follows (the gateway stops
        # the restart once the cgroup's OOM counter has moved) says "oom"
        self.failures = _Counts("llm_gateway_engine_failures",
                                "Engines that failed and are not restarted, by why (exit, "
                                "signal, oom: killed for want of memory, hung, other)",
                                ["model", "kind"])
        self.evictions = _Counts("llm_gateway_evictions",
                                 "Engines stopped by the gateway to make room or when idle",
                                 ["reason"])
        self.bounded = _Counts("llm_gateway_bounded",
                               "What the bounds refused, cut off or deleted, by bound: calls "
                               "(queue_limit, max_answer_mb, max_event_mb), engine answers "
                               "(engine_framing), records (records_max_age_days, "
                               "records_max_mb), KV cache directories (kv_cache_unconfigured)",
                               ["bound"])
        self.waits = _Histograms("llm_gateway_wait_seconds",
                                 "Time a request waited for an engine before it was handed "
                                 "one, by reason: queue (a turn at its ready engine), load "
                                 "(its engine starting or loading), room (its model's turn "
                                 "for a place, or a drain); a request that waited for "
                                 "several is counted under each, for its part",
                                 ["model", "reason", "priority"], WAIT_BUCKETS)
        self.near_misses = _Counts("llm_gateway_max_wait_near_misses",
                                   "Waits for a model's turn (their room part) against its "
                                   "max_wait_s: near (past 90% of it), reached (it or "
                                   "longer: the bound made room), handed an engine or not",
                                   ["model", "priority", "kind"])
        # batch jobs' lines (their calls are also in the figures above, as any call)
        self.batch_lines = _Counts("llm_gateway_batch_lines",
                                   "Batch lines ended, by result: ok (the engine answered "
                                   "2xx), failed (any other answer, or the gateway's error)",
                                   ["model", "result"])
        self.batch_tokens = _Counts("llm_gateway_batch_tokens",
                                    "Tokens of batch lines, as the engines counted them",
                                    ["model", "kind"])
        self._clock = clock
        self._started: dict[str, float] = {}

    # -- the request path ------------------------------------------------------------

    def observe_call(self, record: CallRecord) -> None:
        model = record.model or ""
        endpoint = record.endpoint if record.endpoint in KNOWN_ENDPOINTS else "other"
        status = record.status
        self.requests.inc((model, endpoint, str(status)))
        self.duration.observe((model, endpoint), record.latency_ms / 1000)
        if record.ttft_ms is not None:
            self.ttft.observe((model,), record.ttft_ms / 1000)
        if record.upstream is not None:
            self.upstream_requests.inc((record.upstream, str(status)))
        if record.prompt_tokens:
            self.tokens.inc((model, "prompt"), record.prompt_tokens)
        if record.completion_tokens:
            self.tokens.inc((model, "completion"), record.completion_tokens)
        if status in (429, 503) and record.error_code in REJECTIONS:
            self.rejected.inc((model, record.error_code))
        if (bound := BOUND_OF_CODE.get(record.error_code or "")) is not None:
            self.bounded.inc((bound,))
        if record.batch is not None:
            self.batch_lines.inc((model, "ok" if 200 <= status < 300 else "failed"))
            if record.prompt_tokens:
                self.batch_tokens.inc((model, "prompt"), record.prompt_tokens)
            if record.completion_tokens:
                self.batch_tokens.inc((model, "completion"), record.completion_tokens)

    def observe_wait(self, waited: Waited) -> None:
        """A request's wait for an engine, over (the dispatcher's, core/waits)."""
        klass = NAMES.get(waited.priority, str(waited.priority))
        if waited.handed:
            for reason, seconds in waited.parts.items():
                self.waits.observe((waited.model, reason, klass), seconds)
        if waited.miss is not None:
            self.near_misses.inc((waited.model, klass, waited.miss))

    # -- engine state changes ----------------------------------------------------------

    def on_engine_change(self, old: Engine, new: Engine, stop_reason: str | None) -> None:
        if old.state is new.state:
            return
        model = new.model_id
        if new.state is EngineState.FAILED:
            self.failures.inc((model, new.failure.kind if new.failure else "other"))
        if new.state is EngineState.STARTING:
            self._started[model] = self._clock()
        elif new.state is EngineState.RESTARTING:
            failure = new.failure
            # counted as a restart, not a failed start: a cold start that crashed ends
            # later as that start's ok or failed (its load time then includes restarts)
            self.restarts.inc((model, failure.kind if failure else "other"))
        elif new.state is EngineState.READY and model in self._started:
            self.starts.inc((model, "ok"))
            started = self._started.pop(model, None)
            if started is not None:
                self.load.observe((model,), self._clock() - started)
        elif new.state is EngineState.FAILED and model in self._started:
            self.starts.inc((model, "failed"))
            self._started.pop(model, None)
        elif new.state is EngineState.STOPPING and stop_reason is not None \
                and (kind := stop_reason.split(" ", 1)[0]) in EVICTION_REASONS:
            self.evictions.inc((kind,))

    # -- a scrape ------------------------------------------------------------------------

    def families(self) -> list[Metric]:
        return [m.family() for m in (self.requests, self.duration, self.ttft, self.tokens,
                                     self.rejected, self.starts, self.restarts,
                                     self.failures, self.load,
                                     self.evictions, self.upstream_requests, self.waits,
                                     self.near_misses, self.batch_lines, self.batch_tokens)]

    def render(self, snapshot: Snapshot, engine_metrics: Mapping[str, str] | None = None
               ) -> bytes:
        """The exposition: the counters, the snapshot's figures, and (if given) each
        engine's own metrics with a `model` label."""
        from prometheus_client import generate_latest
        bounded = _Counts(self.bounded.name, self.bounded.doc, self.bounded.labels)
        for key, value in (*self.bounded.values.items(),
                           *(((bound,), n) for bound, n in snapshot.bounded.items())):
            bounded.inc(key, value)
        out = generate_latest(_Once([*self.families(), bounded.family(),
                                     *snapshot.families()]))
        if engine_metrics:
            out += generate_latest(_Once(relabel(engine_metrics)))
        return out


@dataclass
class EngineFigures:
    """One engine's figures for a metrics scrape, as the gateway sees it."""
    model: str
    state: str
    restarts: int
    in_flight: int = 0
    queued: int = 0
    waiting: int = 0                    # for a turn at the engine (part of in_flight)
    memory_bytes: int | None = None     # systemd's MemoryCurrent
    cpu_seconds: float | None = None    # systemd's CPUUsageNSec
    # llm_gateway_memory_engine_bytes: (memory "ram"/"vram", figure "need"/"measured"/
    # "peak") -> bytes; a figure not known is absent
    memory: dict[tuple[str, str], int] = field(default_factory=dict)
    adapters: tuple[str, ...] = ()      # the LoRA adapters it loaded (core/variants)
    kv: KvUse | None = None             # its KV cache, from its /slots (core/model_server)


@dataclass
class Snapshot:
    """Current values, read when the scrape comes."""

    engines: list[EngineFigures] = field(default_factory=list)
    gpus: list[tuple[str, int, int]] = field(default_factory=list)  # (device, used, total) B
    # llm_gateway_memory_budget_bytes: (memory "ram"/"gpu", figure) -> bytes
    budgets: dict[tuple[str, str], int] = field(default_factory=dict)
    records_dropped: int = 0
    max_engines: int = 0
    parked: int = 0                     # engine units parked (no engine, no place)
    kv_cache: Mapping[tuple[str, str], int] = field(default_factory=dict)
    upstreams: list[tuple[str, bool, int]] = field(default_factory=list)  # (name, up, in flight)
    bounded: Mapping[str, int] = field(default_factory=dict)   # counted outside the calls
    # unended batches' lines not answered yet: (model, "queued"|"sending") -> lines
    batch_lines: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # the host as one model server, for an endpoint picker (core/model_server)
    requests_waiting: int = 0
    requests_running: int = 0
    warm: Warm | None = None
    queued_no_engine: Mapping[str, int] = field(default_factory=dict)  # model -> requests

    def families(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        state = GaugeMetricFamily("llm_gateway_engine_state",
                                  "1 for the engine's current state", labels=["model", "state"])
        # not llm_gateway_engine_restarts (the gateway's own count, by reason): one name
        # twice in an exposition is a scrape Prometheus refuses whole
        restarts = CounterMetricFamily("llm_gateway_engine_unit_restarts",
                                       "systemd's NRestarts of the engine's unit", labels=["model"])
        in_flight = GaugeMetricFamily("llm_gateway_requests_in_flight",
                                      "Requests an engine is serving", labels=["model"])
        queued = GaugeMetricFamily("llm_gateway_queue_depth",
                                   "Requests waiting for an engine", labels=["model"])
        waiting = GaugeMetricFamily("llm_gateway_engine_waiting",
                                    "Requests waiting for a connection to an engine whose "
                                    "parallel slots are all in use (counted in "
                                    "requests_in_flight too)",
                                    labels=["model"])
        memory = GaugeMetricFamily("llm_gateway_engine_memory_bytes",
                                   "Memory of the engine's cgroup (systemd's MemoryCurrent)",
                                   labels=["model"])
        cpu = CounterMetricFamily("llm_gateway_engine_cpu_seconds",
                                  "CPU time of the engine's cgroup (systemd's CPUUsageNSec)",
                                  labels=["model"])
        engine_memory = GaugeMetricFamily(
            "llm_gateway_memory_engine_bytes",
            "An engine's memory per budget (memory: ram, vram): need (what admission counts "
            "for its model: learned, else estimated), measured (what it holds now: its "
            "cgroup or PSS; NVML per process), peak (the most its cgroup held)",
            labels=["model", "memory", "figure"])
        # an endpoint picker's adapter affinity (llm-d reads vLLM's lora_requests_info):
        # every adapter an engine loaded is always ready to run (docs/fleet.md)
        adapters = GaugeMetricFamily("llm_gateway_engine_lora_adapters_info",
                                     "1 for each engine with LoRA adapters: the adapters it "
                                     "loaded (comma-separated) and how many",
                                     labels=["model", "running_lora_adapters", "max_lora"])
        for e in self.engines:
            if e.adapters:
                adapters.add_metric([e.model, ",".join(e.adapters), str(len(e.adapters))], 1)
            for (kind, figure), value in sorted(e.memory.items()):
                engine_memory.add_metric([e.model, kind, figure], value)
            for s in EngineState:
                state.add_metric([e.model, s.value], 1.0 if s.value == e.state else 0.0)
            restarts.add_metric([e.model], e.restarts)
            in_flight.add_metric([e.model], e.in_flight)
            queued.add_metric([e.model], e.queued)
            waiting.add_metric([e.model], e.waiting)
            if e.memory_bytes is not None:
                memory.add_metric([e.model], e.memory_bytes)
            if e.cpu_seconds is not None:
                cpu.add_metric([e.model], e.cpu_seconds)
        for model, depth in sorted(self.queued_no_engine.items()):   # waiting for room
            queued.add_metric([model], depth)
        yield from (state, restarts, in_flight, queued, waiting, memory, cpu, engine_memory,
                    adapters)
        budget = GaugeMetricFamily(
            "llm_gateway_memory_budget_bytes",
            "Each memory budget (memory: ram, gpu): total, available (MemAvailable; the "
            "GPU's free), reserve (kept back for the host), budget (ram_budget_mib), claimed "
            "(by the engines holding a place), pending (loads still to take), free (what a "
            "new engine may count on)", labels=["memory", "figure"])
        for (kind, figure), value in sorted(self.budgets.items()):
            budget.add_metric([kind, figure], value)
        yield budget
        used = GaugeMetricFamily("llm_gateway_gpu_memory_used_bytes", "GPU memory in use (NVML)",
                                 labels=["device"])
        total = GaugeMetricFamily("llm_gateway_gpu_memory_total_bytes", "GPU memory (NVML)",
                                  labels=["device"])
        for device, used_b, total_b in self.gpus:
            used.add_metric([device], used_b)
            total.add_metric([device], total_b)
        yield from (used, total)
        yield CounterMetricFamily("llm_gateway_records_dropped",
                                  "Call records that could not be written",
                                  value=self.records_dropped)
        yield GaugeMetricFamily("llm_gateway_engines_running",
                                "Engines holding a place (starting, loading, ready, stopping)",
                                value=sum(1 for e in self.engines if e.state in
                                          ("starting", "loading", "ready", "stopping")))
        yield GaugeMetricFamily("llm_gateway_max_engines", "The configured max_engines",
                                value=self.max_engines)
        yield GaugeMetricFamily("llm_gateway_parked_engines",
                                "Stopped engines whose unit waits, parked, for their next start",
                                value=self.parked)
        kv = CounterMetricFamily("llm_gateway_kv_cache_operations",
                                 "KV cache saves (at a stop) and restores (at a start)",
                                 labels=["action", "result"])
        for action in ("save", "restore"):
            for result in ("ok", "failed"):
                kv.add_metric([action, result], self.kv_cache.get((action, result), 0))
        yield kv
        up = GaugeMetricFamily("llm_gateway_upstream_up",
                               "1 while a remote upstream is not known to be down",
                               labels=["upstream"])
        busy = GaugeMetricFamily("llm_gateway_upstream_requests_in_flight",
                                 "Requests a remote upstream is serving", labels=["upstream"])
        for name, is_up, in_flight_ in self.upstreams:
            up.add_metric([name], 1.0 if is_up else 0.0)
            busy.add_metric([name], in_flight_)
        yield from (up, busy)
        lines = GaugeMetricFamily("llm_gateway_batch_lines_waiting",
                                  "Lines of unended batches not answered yet: queued (to "
                                  "be sent) or sending (on their way to an engine)",
                                  labels=["model", "state"])
        for (model, stage), count in sorted(self.batch_lines.items()):
            lines.add_metric([model, stage], count)
        yield lines
        yield from self._model_server()

    def _model_server(self) -> Iterator[Metric]:
        """The figures an endpoint picker reads, each one series for the whole host (a
        picker takes a family's first series), and each engine's KV use by model."""
        from prometheus_client.core import GaugeMetricFamily
        kv = GaugeMetricFamily("llm_gateway_engine_kv_cache_usage_ratio",
                               "Of an engine's context (all its slots), the share held by "
                               "requests being served, 0-1 (llama-server's /slots)",
                               labels=["model"])
        for e in self.engines:
            if e.kv is not None:
                kv.add_metric([e.model], e.kv.ratio)
        yield kv
        yield GaugeMetricFamily("llm_gateway_requests_waiting",
                                "Requests of every model waiting: for an engine, or for a "
                                "connection to one whose slots are all in use",
                                value=self.requests_waiting)
        yield GaugeMetricFamily("llm_gateway_requests_running",
                                "Requests of every model an engine is serving now",
                                value=self.requests_running)
        yield GaugeMetricFamily("llm_gateway_kv_cache_usage_ratio",
                                "Of every engine's context, the share held by requests being "
                                "served, 0-1 (llama engines that answered /slots)",
                                value=host_kv(e.kv for e in self.engines
                                              if e.kv is not None).ratio)
        warm = GaugeMetricFamily(
            "llm_gateway_models_warm_info",
            "The names this host answers from a running engine (running_lora_adapters) and "
            "from one on its way (waiting_lora_adapters), and how many it can hold without "
            "evicting (max_lora): vLLM's lora_requests_info, for a picker's affinity; the "
            "value is the time of the reading",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        if self.warm is not None:
            warm.add_metric([",".join(self.warm.running), ",".join(self.warm.waiting),
                             str(self.warm.max)], time.time())
        yield warm


def _bound(value: float) -> str:
    """A bucket bound as Prometheus writes it: 1.0, 0.25, 300.0."""
    return repr(float(value))


def relabel(engine_metrics: Mapping[str, str]) -> list[Metric]:
    """Each engine's own exposition (llama-server's /metrics), merged family by family
    with a `model` label, so one scrape covers every engine."""
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    merged: dict[str, Metric] = {}
    for model, text in engine_metrics.items():
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue   # an engine that answered something else: skip it, not the scrape
        for family in families:
            name = _safe_name(family.name)
            into = merged.setdefault(name, Metric(name, family.documentation, family.type))
            for sample in family.samples:
                into.add_sample(_safe_name(sample.name), {**sample.labels, "model": model},
                                sample.value, sample.timestamp)
    return list(merged.values())


def _safe_name(name: str) -> str:
    """llama-server names its metrics `llamacpp:...`; a colon is legal but reserved for
    recording rules, so it becomes an underscore."""
    return name.replace(":", "_")


class _Once:
    """A collector over families already made (for generate_latest)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families
