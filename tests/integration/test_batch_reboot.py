"""A batch job survives a reboot of the machine in its middle: the gateway is an enabled
service inside the container, the container reboots for real (new PID 1, every engine
unit gone), and the gateway's next run goes on with the batch until every line is in its
output exactly once (a line on its way at the reboot is sent again, once)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import make_tiny_model
import pytest

from tests.harness.container import SystemdContainer, engine_workdir, why_unavailable
from tests.harness.plugin import engine_binary, unavailable
from tests.integration.test_reboot_restore import enabled_gateway

pytestmark = [pytest.mark.container, pytest.mark.engine]

UNIT = "llm-gateway-batch-test.service"
PORT = 18481
LINES = 80
# run inside the container with its python: one call of the gateway's HTTP API, printing
# the JSON answer (the file upload as multipart)
CALL = r"""
import json, sys, urllib.request, uuid
method, path = sys.argv[1], sys.argv[2]
data, headers = None, {}
if len(sys.argv) > 3 and sys.argv[3] == "--upload":
    boundary = uuid.uuid4().hex
    content = open(sys.argv[4], "rb").read()
    data = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
            f"batch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"in.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n").encode() \
        + content + f"\r\n--{boundary}--\r\n".encode()
    headers["Content-Type"] = f"multipart/form-data; boundary={boundary}"
elif len(sys.argv) > 3:
    data, headers["Content-Type"] = sys.argv[3].encode(), "application/json"
req = urllib.request.Request(f"http://127.0.0.1:GATEWAY_PORT{path}", data=data, method=method,
                             headers=headers)
with urllib.request.urlopen(req, timeout=30) as resp:
    body = resp.read()
sys.stdout.write(body.decode() if path.endswith("/content") else json.dumps(json.loads(body)))
""".replace("GATEWAY_PORT", str(PORT))


@pytest.fixture
def workdir() -> Iterator[Path]:
    # not under /tmp or /var/tmp: the container's /tmp is its own tmpfs
    path = engine_workdir("llmgw-batch-reboot-")
    yield path
    shutil.rmtree(path)


def call(box: SystemdContainer, script: Path, *args: str) -> Any:
    out = box.exec(sys.executable, str(script), *args, check=False)
    if out.returncode != 0:
        return None    # the gateway is not up (yet): the caller waits
    return out.stdout if args[1].endswith("/content") else json.loads(out.stdout)


def wait_batch(box: SystemdContainer, script: Path, batch_id: str, until: Any,
               timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = call(box, script, "GET", f"/v1/batches/{batch_id}")
        if last is not None and until(last):
            return dict(last)
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id}: {last}\n" + box.shell(
        f"journalctl -b -u {UNIT} -o cat --no-pager", check=False))


def test_a_batch_goes_on_after_a_reboot_and_answers_each_line_once(workdir: Path) -> None:
    if reason := why_unavailable():
        unavailable(reason)
    llama = engine_binary("LLAMA_SERVER")
    make_tiny_model.write_model(str(workdir / "tiny-alpha.gguf"), "tiny-alpha", 0)
    config = workdir / "gateway.toml"
    config.write_text(f'models_dir = "{workdir}"\nllama_server = "{llama}"\n'
                      'state_dir = "/var/lib/llm-gateway-batch-test"\n'
                      f"[batches]\nconcurrency = 1\n[listen]\nport = {PORT}\n")
    script = workdir / "call.py"
    script.write_text(CALL)
    lines = workdir / "lines.jsonl"
    lines.write_text("".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny-alpha", "max_tokens": 128,
                 "messages": [{"role": "user", "content": f"count to {i}"}]}}) + "\n"
        for i in range(LINES)))
    with enabled_gateway("batchboot", workdir, config, UNIT) as box:
        deadline = time.monotonic() + 30
        while (uploaded := call(box, script, "POST", "/v1/files", "--upload", str(lines))
               ) is None and time.monotonic() < deadline:
            time.sleep(0.2)   # the gateway may still be starting up
        assert uploaded is not None and uploaded["id"].startswith("file-")
        batch = call(box, script, "POST", "/v1/batches", json.dumps({
            "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}))
        # some lines answered, the rest not: the machine reboots under the batch
        wait_batch(box, script, batch["id"],
                   lambda b: 3 <= b["request_counts"]["completed"] < LINES, timeout=120)

        box.reboot()

        done = wait_batch(box, script, batch["id"], lambda b: b["status"] in (
            "completed", "failed", "expired", "cancelled"))
        assert done["status"] == "completed", done
        counts = done["request_counts"]
        assert (counts["total"], counts["completed"], counts["failed"]) == (LINES, LINES, 0)
        output = call(box, script, "GET", f"/v1/files/{done['output_file_id']}/content")
        answers = [json.loads(x) for x in output.splitlines()]
        assert [a["custom_id"] for a in answers] == [f"line-{i}" for i in range(LINES)]
        assert all(a["response"]["status_code"] == 200 for a in answers)
        log = box.shell(f"journalctl -b -u {UNIT} -o cat --no-pager")
        assert f"batch {batch['id']} goes on" in log, log
