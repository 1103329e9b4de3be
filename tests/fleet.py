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
        """The models whose engine units this host's systemd runs or is starting. A unit
        the gateway parked is no engine, told as bench/soak.engine_units tells it: being
        parked (activating, LLM_GATEWAY_PARKED in its environment), or its main process
        the preloaded wait (`llm-parked`) or a shell waiting to exec (core/engine_units),
        or its FIFO still there (a preloaded engine between its exec and its wait). The
        units' properties come from one `systemctl show`, their processes' names and FIFOs
        right after, in the same shell: a swap rarely falls between the reads."""
        out = self.box.shell(
            "u=$(systemctl list-units --type=service --all --plain --no-legend "
            "'llm-engine-*' | awk '{print $1}'); [ -z \"$u\" ] && exit 0; "
            "s=$(systemctl show -p Id,ActiveState,MainPID,Environment $u); "
            "printf '%s\\n\\n' \"$s\"; echo '=== processes'; "
            "for p in $(printf '%s\\n' \"$s\" | sed -n 's/^MainPID=//p'); do "
            "echo \"pid $p $(cat /proc/$p/comm 2>/dev/null)\"; done; "
            "for f in $(printf '%s\\n' \"$s\" | grep -o 'LLM_GATEWAY_PARK_FIFO=[^ ]*' "
            "| cut -d= -f2); do [ -e \"$f\" ] && echo \"fifo $f\"; done", check=False)
        shown, _, processes = out.partition("=== processes")
        comm = {w[1]: (w[2] if len(w) > 2 else "") for line in processes.splitlines()
                if (w := line.split()) and w[0] == "pid" and len(w) > 1}
        fifos = {w[1] for line in processes.splitlines()
                 if (w := line.split()) and w[0] == "fifo" and len(w) > 1}
        running = set()
        for block in shown.strip().split("\n\n"):
            props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
            unit, state = props.get("Id", ""), props.get("ActiveState", "inactive")
            environment = props.get("Environment", "")
            fifo = next((w.split("=", 1)[1] for w in environment.split()
                         if w.startswith("LLM_GATEWAY_PARK_FIFO=")), None)
            parked = (state == "activating" and "LLM_GATEWAY_PARKED=" in environment) or (
                state in ("active", "deactivating")
                and (comm.get(props.get("MainPID", "0")) in ("llm-parked", "sh")
                     or fifo in fifos))
            found = re.fullmatch(r"llm-engine-(\S+)\.service", unit)
            if found and state in ("active", "activating") and not parked:
                running.add(unescape(found.group(1)))
        return running

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/admin/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def answered_by_model(self) -> dict[str, float]:
        """Requests this host's gateway answered 200, per model (its metrics)."""
        out: dict[str, float] = {}
        for line in self.metrics().splitlines():
            if line.startswith("llm_gateway_requests_total{") and 'status="200"' in line:
                model = line.split('model="', 1)[1].split('"', 1)[0]
                out[model] = out.get(model, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def answered(self, model: str) -> float:
        """Requests for model this host's gateway answered 200."""
        return self.answered_by_model().get(model, 0.0)


def unescape(name: str) -> str:
    return name.replace("\\x2d", "-")


def status(url: str, body: bytes | None = None, *, first_503: list[str] | None = None
           ) -> int:
    """A request's status; 0 where no answer came. first_503: where to keep the first 503's
    headers and body (whose it was)."""
    request = urllib.request.Request(url, data=body, headers={
        "Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as e:
        said = e.read()
        if e.code == 503 and first_503 is not None and not first_503:
            first_503.append(f"{dict(e.headers)} {said[:300]!r}")
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
