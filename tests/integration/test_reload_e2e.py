"""Reloading the configuration in place, through `systemctl reload` (ExecReload= sends
SIGHUP) and `llm-gateway reload`: the gateway keeps its PID, new names and files route
at once, an engine whose settings did not change keeps its process, one whose settings
changed is restarted once idle (never under a request), a model that left is stopped,
and a configuration that does not validate is refused with the old one in force."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import make_tiny_model
import pytest

from tests.integration.engine_helpers import decoding
from tests.integration.gateway_helpers import (
    GatewayService,
    journal_until,
    socket_activated,
    toml_str,
    unit_property,
)
from tests.integration.test_front_door_e2e import client

pytestmark = [pytest.mark.systemd, pytest.mark.engine]


def answer(gw: GatewayService, model: str) -> str:
    out = client(gw).completions.create(model=model, prompt="hi", max_tokens=2)
    return out.model


def test_reload_in_place(tmp_path: Path, llama_server: Path,
                         tiny_models: dict[str, Path]) -> None:
    from tests.integration.conftest import write_config
    models = tmp_path / "models"
    models.mkdir()
    # beta: a long context, so that its answer is still being generated when the reload
    # runs (seconds here; the usual tiny model fills its 2048 tokens in milliseconds)
    make_tiny_model.write_model(str(models / "tiny-beta.gguf"), name="tiny-beta",
                                n_ctx=32768)
    beta_table = (f"[models.tiny-beta]\npath = {toml_str(str(models / 'tiny-beta.gguf'))}\n"
                  "ctx_size = 32768\n")
    config, port = write_config(tmp_path, llama_server, tiny_models, extra=beta_table)
    original = config.read_text()
    name = "llm-gateway-rl"
    with socket_activated(name, config, port,
                          service_extra="ExecReload=/bin/kill -HUP $MAINPID\n") as gw, \
            contextlib.ExitStack() as stack:
        for model in ("tiny-alpha", "tiny-beta", "tiny-gamma"):
            assert gw.cli("start", model).returncode == 0
        pids = {m: e["pid"] for m, e in gw.engines().items()}
        gateway_pid = unit_property(f"{name}.service", "MainPID")
        # a stream on beta runs through the reload: its engine must not be restarted
        # under it (ignore_eos: it cannot end early)
        asked = 20000
        stream = client(gw).chat.completions.create(
            model="tiny-beta", messages=[{"role": "user", "content": "go"}],
            max_tokens=asked, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        beta_socket = gw.engines()["tiny-beta"]["socket"]
        stack.callback(stream.close)   # on a failure, before the gateway's stop drains it

        # alpha gets an alias (same engine), beta a thread count (its engine changes),
        # gamma's file leaves the models directory, delta's arrives
        (models / "tiny-gamma.gguf").unlink()
        (models / "tiny-delta.gguf").symlink_to(tiny_models["gamma"])
        edited = original.replace(beta_table, beta_table + "threads = 1\n").replace(
            "[listen]", (
                f"[models.tiny-alpha]\npath = {toml_str(str(models / 'tiny-alpha.gguf'))}\n"
                'aliases = ["alfa"]\n[listen]'))
        config.write_text(edited)
        began = time.monotonic()
        subprocess.run(["systemctl", "reload", f"{name}.service"], check=True)
        journal_until("configuration reloaded", "-u", f"{name}.service")
        generating, decoded = decoding(beta_socket)
        assert generating and decoded < asked          # beta was mid-answer at the reload
        assert answer(gw, "alfa") == "tiny-alpha"      # a new name routes at once
        assert answer(gw, "tiny-delta") == "tiny-delta"   # a new file too
        reading = time.monotonic()
        rest = list(chunks)                            # beta's answer ran to its end
        began += time.monotonic() - reading            # (the client's pace, not the reload's)
        assert len(rest) > asked - decoded - 10 and rest[-1].choices[0].finish_reason == \
            "length"
        assert gw.engines()["tiny-alpha"]["pid"] == pids["tiny-alpha"]
        beta = gw.wait_engine("tiny-beta", lambda e: e["state"] == "ready"
                              and e["pid"] != pids["tiny-beta"], timeout=30)
        assert beta["pid"]
        deadline = time.monotonic() + 30   # gamma left the configuration: stopped
        while gw.engines().get("tiny-gamma", {"state": "stopped"})["state"] != "stopped":
            assert time.monotonic() < deadline, gw.engines()
            time.sleep(0.05)
        assert "tiny-gamma" not in {m["id"] for m in gw.api("GET", "/v1/models")[1]["data"]}
        assert unit_property(f"{name}.service", "MainPID") == gateway_pid
        assert time.monotonic() - began < 60

        # a file that does not validate: refused, with the key; the old one stays in force
        config.write_text(edited.replace("max_engines = 4", 'max_engines = "many"'))
        refused = gw.cli("reload")
        assert refused.returncode == 1 and "max_engines" in refused.stderr, refused
        checked = gw.cli("check")
        assert checked.returncode == 1 and "max_engines" in checked.stderr, checked
        subprocess.run(["systemctl", "reload", f"{name}.service"], check=True)
        journal_until("was not reloaded", "-u", f"{name}.service")
        assert "reload refused" in unit_property(f"{name}.service", "StatusText")
        assert answer(gw, "alfa") == "tiny-alpha"
        assert unit_property(f"{name}.service", "MainPID") == gateway_pid
        assert unit_property(f"{name}.service", "ActiveState") == "active"

        config.write_text(edited)
        checked = gw.cli("check")
        assert checked.returncode == 0 and "tiny-delta" in checked.stdout, checked
        reloaded = gw.cli("reload")
        assert reloaded.returncode == 0 and "kept running: tiny-alpha" in reloaded.stdout, \
            reloaded
