"""After a reboot, the engines the user had running come back, one at a time, in order.

Driven from the host (marker `container`): the gateway is an enabled service
inside the container, the container reboots for real (new PID 1, transient
engine units gone), and the gateway restores the desired list on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import make_tiny_model
import pytest

from tests.harness.container import SystemdContainer, engine_workdir, why_unavailable
from tests.harness.plugin import ENGINE_CACHE, REPO, engine_binary, unavailable

pytestmark = [pytest.mark.container, pytest.mark.engine]

UNIT = "llm-gateway-test.service"


@pytest.fixture
def workdir() -> Iterator[Path]:
    # not under /tmp or /var/tmp: the container's /tmp is its own tmpfs, and an engine
    # has a private /tmp and /var/tmp (PrivateTmp=)
    path = engine_workdir("llmgw-reboot-")
    yield path
    shutil.rmtree(path)


@contextlib.contextmanager
def enabled_gateway(name: str, workdir: Path, config: Path, unit: str
                    ) -> Iterator[SystemdContainer]:
    """A container whose systemd has the gateway (config) as an enabled service, unit:
    started now, and again by each boot; stopped (the container) at the end."""
    unit_file = (f"[Unit]\nDescription=llm-gateway under test\n[Service]\n"
                 f"WorkingDirectory={REPO}\n"
                 f"ExecStart={sys.executable} -m gatewayd --config {config} serve\n"
                 "[Install]\nWantedBy=multi-user.target\n")
    ro = [ENGINE_CACHE] if ENGINE_CACHE.is_dir() else []
    box = SystemdContainer(f"{name}-{os.getpid() % 100000}", binds=[REPO, workdir],
                           binds_ro=ro)
    box.start()
    try:
        box.exec("tee", f"/etc/systemd/system/{unit}", input=unit_file)
        box.shell(f"systemctl daemon-reload && systemctl enable --now {unit}")
        yield box
    finally:
        box.stop()


def gateway_cli(box: SystemdContainer, config: Path, *args: str) -> str:
    return box.exec(sys.executable, "-m", "gatewayd", "--config", str(config), *args).stdout


def wait_ready(box: SystemdContainer, config: Path, models: set[str],
               timeout: float = 60) -> dict[str, dict[str, object]]:
    deadline = time.monotonic() + timeout
    engines: dict[str, dict[str, object]] = {}
    while time.monotonic() < deadline:
        proc = box.exec(sys.executable, "-m", "gatewayd", "--config", str(config), "--json",
                        "engines", check=False)
        if proc.returncode == 0:
            engines = {e["model"]: e for e in json.loads(proc.stdout)["engines"]}
            if set(engines) == models and all(e["state"] == "ready" for e in engines.values()):
                return engines
        time.sleep(0.1)
    raise AssertionError(f"engines not restored: {engines}\n" + box.shell(
        f"journalctl -b -u {UNIT} -o cat --no-pager", check=False))


def test_reboot_restores_engines_one_at_a_time_in_order(workdir: Path) -> None:
    if reason := why_unavailable():
        unavailable(reason)
    llama = engine_binary("LLAMA_SERVER")
    for seed, name in enumerate(("alpha", "beta", "gamma")):
        make_tiny_model.write_model(str(workdir / f"tiny-{name}.gguf"), f"tiny-{name}", seed)
    config = workdir / "gateway.toml"
    config.write_text(f'models_dir = "{workdir}"\nllama_server = "{llama}"\n'
                      'state_dir = "/var/lib/llm-gateway-test"\n[listen]\nport = 18480\n')
    with enabled_gateway("reboot", workdir, config, UNIT) as box:
        # the user starts two engines, beta first
        for model in ("tiny-beta", "tiny-alpha"):
            deadline = time.monotonic() + 20
            while "ready" not in (out := box.exec(
                    sys.executable, "-m", "gatewayd", "--config", str(config), "start", model,
                    check=False).stdout) and time.monotonic() < deadline:
                time.sleep(0.1)  # the gateway may still be starting up
            assert "ready" in out
        before = wait_ready(box, config, {"tiny-alpha", "tiny-beta"})

        box.reboot()

        after = wait_ready(box, config, {"tiny-alpha", "tiny-beta"})
        for model in after:   # new processes of a new boot
            assert after[model]["pid"] != before[model]["pid"]
            assert not after[model]["adopted"]
        log = box.shell(f"journalctl -b -u {UNIT} -o cat --no-pager")
        marks = ["restore: starting tiny-beta", "restore: tiny-beta ready",
                 "restore: starting tiny-alpha", "restore: tiny-alpha ready"]
        positions = [log.index(mark) for mark in marks]
        assert positions == sorted(positions), log
        assert "tiny-gamma" not in log   # only what the user had running
