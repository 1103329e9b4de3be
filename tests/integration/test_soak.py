"""The scheduler under sustained load (bench/soak, one minute): clients over more models
than slots, some dropping their streams, against a socket-activated gateway whose engines
are transient units. Every request is answered, never more engines run than slots, and the
gateway's view of its engines matches systemd's. Speed is not asserted.

It boots its own container and drives the soak from the host, like bench/soak: marker
`container`."""

from __future__ import annotations

import json
import sys

import pytest

from bench.soak import Spec, markdown, run_mode
from tests.harness.container import why_unavailable
from tests.harness.plugin import engine_binary, unavailable

pytestmark = [pytest.mark.container, pytest.mark.engine, pytest.mark.slow]


def test_a_minute_of_load_over_three_models_in_two_slots() -> None:
    if reason := why_unavailable():
        unavailable(reason)
    spec = Spec(mode="transient", models=3, slots=2, concurrency=16, drop=0.25,
                duration=60, warmup=5, settle=6, llama_server=str(engine_binary("LLAMA_SERVER")),
                python=sys.executable)
    result = run_mode(spec)
    print(markdown([result]))
    details = json.dumps({k: result[k] for k in ("violation_details", "sample_errors")}
                         | {"error_examples": result["requests"]["error_examples"]}, indent=1)
    assert result["requests"]["ok"] > 0, details
    assert result["requests"]["errors"] == 0, (result["requests"]["errors_by_code"], details)
    assert result["max_active_units"] <= spec.slots, details
    assert result["violations"] == 0, details
