"""The Batch API against the real gateway (a unit of the container's systemd) and real
llama-server engines, through the official openai SDK: a batch runs to the end with the
gateway SIGKILLed in the middle of it, and every line is in the output exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

import openai
import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import unit_property
from tests.integration.test_front_door_e2e import client, records

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

LINES = 80


def batch_file() -> bytes:
    rows = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny-alpha" if i % 3 else "tiny-beta", "max_tokens": 48,
                      "messages": [{"role": "user", "content": f"count to {i}"}]}}
            for i in range(LINES)]
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def wait_batch(oa: openai.OpenAI, batch_id: str, until: Any, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            batch = oa.batches.retrieve(batch_id)
        except openai.APIConnectionError:   # the gateway is starting again
            time.sleep(0.1)
            continue
        if until(batch):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} never got there")


def test_a_batch_survives_a_sigkill_of_the_gateway_and_answers_each_line_once(
        gateway_factory: GatewayFactory) -> None:
    gw = gateway_factory("[batches]\nidle_s = 0\nconcurrency = 2\n", max_engines=1)
    oa = client(gw)
    uploaded = oa.files.create(file=("lines.jsonl", batch_file()), purpose="batch")
    batch = oa.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    # some lines answered, more on their way: the gateway dies without a word
    wait_batch(oa, batch.id, lambda b: b.request_counts.completed >= 5, timeout=120)
    pid = int(unit_property(gw.unit, "MainPID"))
    assert pid > 0
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while unit_property(gw.unit, "ActiveState") not in ("inactive", "failed") \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    subprocess.run(["systemctl", "reset-failed", gw.unit], check=False)
    gw.start()
    done = wait_batch(oa, batch.id, lambda b: b.status in ("completed", "failed",
                                                           "expired", "cancelled"))
    assert done.status == "completed", done
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0), counts
    assert done.error_file_id is None
    answers = [json.loads(x) for x in oa.files.content(done.output_file_id).text.splitlines()]
    assert [a["custom_id"] for a in answers] == [f"line-{i}" for i in range(LINES)]
    assert all(a["response"]["status_code"] == 200 and
               a["response"]["body"]["choices"][0]["message"]["content"] for a in answers)
    # the lines' call records name the batch (those queued for the records' writer when
    # the gateway was killed are lost with it: the output is the batch's truth)
    rows = [r for r in records(gw, 1) if r["endpoint"] == "/v1/chat/completions"]
    assert rows and {r["batch"] for r in rows} == {batch.id}
    assert f"batch {batch.id} goes on" in gw.journal()
