"""A systemd container that shares the host's network (how scripts/demo runs where PID 1
is not systemd): its PID 1 lacks CAP_NET_ADMIN, so a PrivateNetwork= namespace would get
its loopback down. Whisper engines must still work, behind their unix socket."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.container import SystemdContainer, engine_workdir, why_unavailable
from tests.harness.plugin import ENGINE_CACHE, REPO, engine_binary, unavailable

pytestmark = [pytest.mark.container, pytest.mark.engine]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def workdir() -> Iterator[Path]:
    """The model and state: not in /tmp, which the engine's PrivateTmp= hides."""
    path = engine_workdir("llmgw-shnet-")
    yield path
    shutil.rmtree(path)


def test_whisper_serves_in_a_container_that_shares_the_host_network(
        workdir: Path, tiny_whisper: Path) -> None:
    if reason := why_unavailable():
        unavailable(reason)
    tmp_path = workdir
    whisper = engine_binary("WHISPER_SERVER")
    port = _free_port()
    wav = tmp_path / "silence.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * 16000)
    model = tmp_path / "tiny-whisper.bin"
    model.write_bytes(tiny_whisper.read_bytes())
    config = tmp_path / "gateway.toml"
    config.write_text(f"""
whisper_server = {json.dumps(str(whisper))}
state_dir = {json.dumps(str(tmp_path / "state"))}
load_timeout_s = 20
[models.whisper-tiny]
path = {json.dumps(str(model))}
backend = "whisper"
threads = 1
[listen]
port = {port}
""")
    box = SystemdContainer(f"shnet{os.getpid() % 10**6}", binds=[REPO, tmp_path],
                           binds_ro=[ENGINE_CACHE] if ENGINE_CACHE.is_dir() else [],
                           private_network=False)
    with box:
        box.exec("systemd-run", "--unit=llm-gateway-shnet", "-p", f"WorkingDirectory={REPO}",
                 "-p", "Type=notify", "-E", "PYTHONDONTWRITEBYTECODE=1",
                 sys.executable, "-m", "gatewayd", "--config", str(config), "serve")
        began = time.monotonic()
        out = subprocess.run(      # from the host: the network is shared
            ["curl", "-sS", "--max-time", "60", "-w", "\n%{http_code}",
             f"http://127.0.0.1:{port}/v1/audio/transcriptions", "-F", f"file=@{wav}",
             "-F", "model=whisper-tiny", "-F", "response_format=json"],
            capture_output=True, text=True, check=False).stdout
        body, _, status = out.rpartition("\n")
        journal = box.exec("journalctl", "--no-pager", "-u", "llm-gateway-shnet",
                           "-u", "llm-engine-whisper\\x2dtiny.service", check=False).stdout
        assert status == "200", f"{out}\n{journal[-3000:]}"
        assert "text" in json.loads(body)
        assert time.monotonic() - began < 30
        assert "lacks CAP_NET_ADMIN" in journal
        box.exec("systemctl", "stop", "llm-gateway-shnet", "llm-engine-whisper\\x2dtiny.service",
                 check=False)
