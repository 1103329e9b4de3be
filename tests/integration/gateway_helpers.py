"""Run the real gateway as a service inside the test container, and talk to it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


@dataclass
class GatewayService:
    """The gateway as a transient unit of the container's systemd (it runs as root)."""

    config: Path
    port: int
    unit: str = ""          # default: llm-gateway-test-<port>.service, own journal per test
    env: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None   # sent by api() and cli() where the gateway checks keys

    def __post_init__(self) -> None:
        self.unit = self.unit or f"llm-gateway-test-{self.port}.service"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20) -> None:
        cmd = ["systemd-run", "--quiet", f"--unit={self.unit}", "--collect",
               "-p", f"WorkingDirectory={os.getcwd()}"]
        for key, value in self.env.items():
            cmd += ["-E", f"{key}={value}"]
        cmd += [sys.executable, "-m", "gatewayd", "--config", str(self.config), "serve"]
        subprocess.run(cmd, check=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.api("GET", "/admin/status")
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"gateway not answering after {timeout}s:\n{self.journal()}")

    def stop(self) -> None:
        subprocess.run(["systemctl", "stop", self.unit], check=False)

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "LLM_GATEWAY_API_KEY": self.api_key} if self.api_key else None
        return subprocess.run([sys.executable, "-m", "gatewayd", "--config", str(self.config),
                               *args], capture_output=True, text=True, check=False, timeout=300,
                              env=env)

    def engines(self) -> dict[str, dict[str, Any]]:
        _, body = self.api("GET", "/admin/engines")
        return {e["model"]: e for e in body["engines"]}

    def journal(self) -> str:
        subprocess.run(["journalctl", "--sync"], check=False)
        return subprocess.run(["journalctl", "-u", self.unit, "-o", "cat", "--no-pager"],
                              capture_output=True, text=True, check=False).stdout

    def wait_engine(self, model: str, pred: Any, timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            last = self.engines().get(model)
            if last is not None and pred(last):
                return last
            time.sleep(0.05)
        raise AssertionError(f"engine {model} never matched; last: {last}\n{self.journal()}")


def journal_until(needle: str, *args: str, timeout: float = 10) -> str:
    """journalctl ARGS -o cat, polled until it shows needle (journald writes lag a little)."""
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        subprocess.run(["journalctl", "--sync"], check=False)
        out = subprocess.run(["journalctl", *args, "-o", "cat", "--no-pager"],
                             capture_output=True, text=True, check=False).stdout
        if needle in out:
            return out
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not in journalctl {' '.join(args)}:\n{out[-2000:]}")


def stop_all_engine_units() -> None:
    """Engines outlive the gateway by design: tests stop them explicitly."""
    out = subprocess.run(["systemctl", "list-units", "--plain", "--no-legend", "--all",
                          "llm-engine-*", "llm-engine@*"], capture_output=True, text=True,
                         check=False).stdout
    units = [line.split()[0] for line in out.splitlines() if line.strip()]
    if units:
        subprocess.run(["systemctl", "stop", *units], check=False)
        subprocess.run(["systemctl", "reset-failed", *units], check=False,
                       stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def socket_activated(name: str, config: Path, port: int, *, socket_extra: str = "",
                     service_extra: str = "") -> Iterator[GatewayService]:
    """The gateway as `name`.socket → `name`.service (Type=notify), socket started; on exit
    both stopped and removed, and the engines they started stopped."""
    units = Path("/run/systemd/system")
    (units / f"{name}.socket").write_text(
        f"[Socket]\nListenStream=127.0.0.1:{port}\n{socket_extra}")
    (units / f"{name}.service").write_text(
        f"[Unit]\nRequires={name}.socket\nAfter={name}.socket\n[Service]\nType=notify\n"
        f"WorkingDirectory={os.getcwd()}\n{service_extra}"
        f"ExecStart={sys.executable} -m gatewayd --config {config} serve\n")
    try:
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        subprocess.run(["systemctl", "start", f"{name}.socket"], check=True)
        yield GatewayService(config, port, unit=f"{name}.service")
    finally:
        subprocess.run(["systemctl", "stop", f"{name}.socket", f"{name}.service"], check=False)
        for suffix in ("socket", "service"):
            (units / f"{name}.{suffix}").unlink(missing_ok=True)
        subprocess.run(["systemctl", "daemon-reload"], check=False)
        stop_all_engine_units()


def tcp_listeners() -> set[tuple[str, str]]:
    """(local address, inode) of every listening TCP socket in this network namespace."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                found.add((fields[1], fields[9]))
    return found


def unit_property(unit: str, prop: str) -> str:
    return subprocess.run(["systemctl", "show", "-p", prop, "--value", unit],
                          capture_output=True, text=True, check=True).stdout.strip()


def whisper_model_config(whisper_server: Path, model: Path) -> str:
    """Config lines (a gateway_factory `extra`) for a whisper model called whisper-tiny."""
    return (f"whisper_server = {toml_str(str(whisper_server))}\n"
            f"[models.whisper-tiny]\npath = {toml_str(str(model))}\n"
            'backend = "whisper"\nthreads = 1\n')


def speech_wav(path: Path, text: str = "hello world") -> Path:
    """Real speech to transcribe: espeak-ng's voice saying text, as a WAV file."""
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True)
    return path


# What a compromised engine would try (python3 -c PROBE RECORDS KEYFILE ADMIN_SOCKET):
# prints a JSON object, for each attempt "ok" or the error it met.
COMPROMISED_ENGINE_PROBE = r"""
import json, socket, subprocess, sys
records, keys, sock = sys.argv[1:4]
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
attempt("records", lambda: open(records, "rb").read(1))
attempt("keys", lambda: open(keys, "rb").read(1))
def admin():
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock)
        s.sendall(b"GET /admin/status HTTP/1.0\r\n\r\n")
        answer = s.recv(100)
        if b" 200 " not in answer.split(b"\r\n", 1)[0]:
            raise PermissionError(answer[:40])
attempt("admin_socket", admin)
def start(argv):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise PermissionError(proc.stderr.strip()[-200:])
attempt("start_unit", lambda: start(["systemctl", "start", "systemd-tmpfiles-clean.service"]))
attempt("transient_unit", lambda: start(["systemd-run", "--quiet", "--collect",
                                         "--unit=llmgw-probe-evil", "/bin/true"]))
print(json.dumps(out))
"""
