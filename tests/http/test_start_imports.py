"""What a socket-activated start imports before its first answer: the modules the gateway
defers (each where its comment says, docs/benchmarks.md "Figures behind choices in the
code") stay out of it. A fresh interpreter imports as `llm-gateway serve` does, builds the
app (on fake engines), serves and answers GET /health, then says which of them it holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# each: where it is imported instead
DEFERRED = {
    "gatewayd.core.memory_estimate": "adapters/model_files.py, at the first estimate",
    "prometheus_client": "adapters/metrics.py, at the first scrape",
    "gguf": "adapters/gguf_meta.py mirrors its tables; never",
    "numpy": "gguf's; never",
    "importlib.resources": "http/admin_api.py reads the page beside its module; never",
    "zipfile": "importlib.resources'; never",
    "gatewayd.cli_fleet": "cli.py, when `llm-gateway endpoints` runs",
    "python_multipart": "http/form_field.py, at the first multipart upload",
    "gatewayd.http.form_field": "http/openai_api.py, at the first multipart upload",
}

START = """
import asyncio, gc, json, sys
from pathlib import Path
gc.disable()
import gatewayd.cli   # as cli.main's serve: the CLI, then the app with the CA bundle deferred
from gatewayd.adapters.client_tls import deferred_ca_loading
with deferred_ca_loading():
    from gatewayd.app import build_app
from aiohttp.test_utils import TestClient, TestServer
from tests.fakes import engine_layer_on, engine_manager_on_fakes

async def first_answer() -> None:
    mgr, _, _ = engine_manager_on_fakes(Path(sys.argv[1]))
    app = build_app(mgr.config, engines_ctx=engine_layer_on(mgr))
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/health")
        assert resp.status == 200, resp.status

asyncio.run(first_answer())
print(json.dumps(sorted(name for name in json.loads(sys.argv[2]) if name in sys.modules)))
"""


def test_the_start_and_its_first_answer_leave_the_deferred_modules_out(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", START, str(tmp_path), json.dumps(list(DEFERRED))],
                         capture_output=True, text=True, cwd=Path(__file__).parents[2],
                         timeout=120)
    assert out.returncode == 0, out.stderr
    imported = json.loads(out.stdout.splitlines()[-1])
    assert imported == [], {name: DEFERRED[name] for name in imported}
