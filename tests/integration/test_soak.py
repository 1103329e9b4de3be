"""The scheduler under sustained load (bench/soak, one minute): clients over more models
than places (max_engines), some dropping their streams, against a socket-activated gateway
whose engines are transient units. Every request is answered, never more engines run than
places, and the gateway's view of its engines matches systemd's. Speed is not asserted.

The soak boots its own container and drives it from the host, like bench/soak does:
marker `container`. The sampler's rules are checked here too, without a container. (Spec's
and Sampler's `slots` are bench/soak's: its --slots flag and its results' JSON key.)"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from bench.soak import Sampler, Spec, markdown, model_of, run_mode
from tests.harness.container import why_unavailable
from tests.harness.plugin import engine_binary, unavailable


@pytest.mark.container
@pytest.mark.engine
@pytest.mark.slow
def test_a_minute_of_load_over_three_models_in_two_places() -> None:
    if reason := why_unavailable():
        unavailable(reason)
    spec = Spec(mode="transient", models=3, slots=2, concurrency=16, drop=0.25,
                duration=60, warmup=5, settle=6, llama_server=str(engine_binary("LLAMA_SERVER")),
                python=sys.executable)
    result = run_mode(spec)
    print(markdown([result]))
    details = json.dumps({"violations": result["violation_details"][:10],
                          "sample_errors": result["sample_errors"],
                          "error_examples": result["requests"]["error_examples"]}, indent=1)
    assert result["requests"]["ok"] > 0, details
    assert result["requests"]["errors"] == 0, (result["requests"]["errors_by_code"], details)
    assert result["max_active_units"] <= spec.slots, details
    assert result["violations"] == 0, details


# -- the sampler's rules (fast) ----------------------------------------------------------


def engine(model: str, state: str) -> dict[str, Any]:
    return {"model": model, "state": state, "unit": f"llm-engine-{model}.service"}


def test_unit_names_map_back_to_models() -> None:
    assert model_of("llm-engine-tiny\\x2dalpha.service") == "tiny-alpha"
    assert model_of("llm-engine@soak0.service") == "soak0"


def test_more_active_units_than_places_is_a_violation_every_sample() -> None:
    s = Sampler(slots=2)
    units = {f"llm-engine-m{i}.service": "active" for i in range(3)}
    units["llm-engine-m3.service"] = "deactivating"          # not counted
    engines = [engine(f"m{i}", "ready") for i in range(3)]
    s.observe(0, units, engines, "llm-engine-")
    s.observe(1, units, engines, "llm-engine-")
    assert s.max_active == 3 and len(s.over_slots) == 2


def test_a_disagreement_counts_once_it_is_seen_twice_in_a_row() -> None:
    s = Sampler(slots=2)
    running = {"llm-engine-a.service": "active"}
    s.observe(0, running, [], "llm-engine-")                 # the gateway lost it: once...
    s.observe(1, {}, [], "llm-engine-")                      # ... gone: a passing moment
    assert s.disagreements == []
    for t in (2, 3, 4):                                      # now it persists: one episode
        s.observe(t, running, [engine("a", "stopped")], "llm-engine-")
    assert [(d["model"], d["gateway"], d["systemd"]) for d in s.disagreements] == [
        ("a", "stopped", "active")]


def test_a_swap_in_progress_is_fine_but_a_stuck_one_is_not() -> None:
    s = Sampler(slots=2, interval=1.0)
    for t in range(5):                                       # starting, no unit yet
        s.observe(t, {}, [engine("a", "starting")], "llm-engine-")
    assert s.disagreements == []
    for t in range(5, 12):
        s.observe(t, {}, [engine("a", "starting")], "llm-engine-")
    assert [d["kind"] for d in s.disagreements] == ["stuck"]


def test_states_that_agree_are_never_counted() -> None:
    s = Sampler(slots=2)
    pairs = [("starting", "activating"), ("loading", "active"), ("ready", "active"),
             ("stopping", "deactivating"), ("stopped", "inactive"), ("failed", "failed")]
    for t in range(3):
        units = {f"llm-engine-m{i}.service": sd for i, (_, sd) in enumerate(pairs)}
        s.observe(t, units, [engine(f"m{i}", gw) for i, (gw, _) in enumerate(pairs)],
                  "llm-engine-")
    assert s.disagreements == [] and s.unknown_states == set()


def test_the_report_tells_a_warm_up_from_a_leak_by_the_halves() -> None:
    def run(start: float, mid: float | None, end: float) -> dict[str, Any]:
        return {"mode": "m", "spec": {"slots": 2, "duration": 600.0},
                "gateway": {"start": {"rss_mib": start},
                            "mid": None if mid is None else {"rss_mib": mid},
                            "end": {"rss_mib": end}}}
    table = markdown([run(40.0, 43.0, 43.5), run(40.0, 42.0, 44.0), run(40.0, None, 41.0)])
    row = next(line for line in table.splitlines() if "per minute" in line)
    assert row.split(" | ")[1:] == ["+0.60 / +0.10", "+0.40 / +0.40", "- |"]
