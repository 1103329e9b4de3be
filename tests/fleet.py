"""A fleet as an operator runs it: gateways, each in its own systemd container (the test
harness's) with its own real llama-server engines, on loopback ports of their own (the
containers share the host's network). tests/integration/test_fleet_e2e.py and the
soak through the balancer (bench/soak --fleet) both run on it; tests/haproxy.py puts
HAProxy in front."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.haproxy import free_port
from tests.harness.container import SystemdContainer, why_unavailable
from tests.harness.plugin import ENGINE_CACHE, REPO, engine_binary

DEADLINE_S = 60.0


class FleetUnavailable(Exception):
    """No systemd container can run here (tests/harness/container.why_unavailable)."""


@dataclass
class Host:
    box: SystemdContainer
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_gateway(self) -> None:
        self.box.shell(f"systemd-run --quiet --unit=fleet-gw --collect "
                       f"-p WorkingDirectory={REPO} {REPO}/.venv/bin/python -m gatewayd "
                       "--config /etc/fleet-gw.toml serve")
        deadline = time.monotonic() + DEADLINE_S
        while status(f"{self.url}/ready") != 200:
            assert time.monotonic() < deadline, self.box.shell(
                "journalctl -u fleet-gw --no-pager | tail -30", check=False)
            time.sleep(0.1)

    def engines(self) -> set[str]:
        """The models whose engine units this host's systemd runs or is starting; a unit
        the gateway parked (its main process the preloaded wait, `llm-parked`, or a shell
        waiting to exec: core/engine_units) is no engine."""
        out = self.box.shell(
            "for u in $(systemctl list-units --type=service --state=active,activating "
            "--plain --no-legend 'llm-engine-*' | awk '{print $1}'); do "
            "pid=$(systemctl show -p MainPID --value \"$u\"); "
            "case \"$(cat /proc/$pid/comm 2>/dev/null)\" in llm-parked|sh) ;; "
            "*) echo \"$u\";; esac; done", check=False)
        return {unescape(m.group(1)) for m in re.finditer(r"llm-engine-(\S+)\.service", out)}

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/admin/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def answered(self, model: str | None = None) -> float:
        """Requests (for model, else any) this host's gateway answered 200 (its metrics)."""
        return sum(float(line.rsplit(" ", 1)[1]) for line in self.metrics().splitlines()
                   if line.startswith("llm_gateway_requests_total{")
                   and (model is None or f'model="{model}"' in line)
                   and 'status="200"' in line)


def unescape(name: str) -> str:
    return name.replace("\\x2d", "-")


def status(url: str, body: bytes | None = None) -> int:
    """A request's status; 0 where no answer came."""
    request = urllib.request.Request(url, data=body, headers={
        "Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as e:
        e.read()
        return int(e.code)
    except OSError:
        return 0


def write_models(root: Path, names: Sequence[str]) -> Path:
    """A tiny GGUF model per name, each its own weights."""
    if str(REPO / "scripts") not in sys.path:   # (bench/soak imports this outside pytest)
        sys.path.insert(0, str(REPO / "scripts"))
    import make_tiny_model

    root.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(names):
        make_tiny_model.write_model(str(root / f"{name}.gguf"), name=name, seed=seed)
    return root


@contextlib.contextmanager
def running_fleet(models: Path, *, notice_s: Sequence[float] = (0, 0), max_engines: int = 4
                  ) -> Iterator[list[Host]]:
    """One gateway per entry of notice_s (its [listen] drain_notice_s), serving the models
    in the folder models, each in a container of its own, stopped at the end."""
    if (why := why_unavailable()) is not None:
        raise FleetUnavailable(why)
    llama = engine_binary("LLAMA_SERVER")
    started: list[Host] = []
    try:
        for i, notice in enumerate(notice_s):
            box = SystemdContainer(f"fleet{i}-{os.getpid() % 10000}", private_network=False,
                                   binds_ro=[models, *([ENGINE_CACHE]
                                                       if ENGINE_CACHE.is_dir() else [])])
            box.start()
            host = Host(box, free_port())
            started.append(host)
            box.shell(f"mkdir -p /srv/fleet-models && cp {models}/*.gguf /srv/fleet-models/ "
                      "&& chmod -R a+rX /srv/fleet-models && printf '%s\\n' "
                      "'models_dir = \"/srv/fleet-models\"' "
                      f"'llama_server = \"{llama}\"' 'state_dir = \"/var/lib/fleet-gw\"' "
                      f"'max_engines = {max_engines}' '[listen]' 'host = \"127.0.0.1\"' "
                      f"'port = {host.port}' 'drain_notice_s = {notice}' '[admin]' "
                      "'public = true' "
                      "> /etc/fleet-gw.toml")
            host.start_gateway()
        yield started
    finally:
        for host in started:
            host.box.stop()
