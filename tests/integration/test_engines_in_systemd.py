"""Proof that the infrastructure is real: real engines as transient units of a real systemd.

These run inside the test container (marker `systemd`), through gatewayd's own
D-Bus adapter, against the real llama-server / whisper-server builds and real
generated models. Each check below would fail against a fake: the process
behind the unit is the built binary, the answers carry llama.cpp's build number
and the model's own metadata, restarts are counted by systemd.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from gatewayd.adapters.systemd import SERVICE, UNIT, Systemd
from gatewayd.core.unit_spec import UnitSpec
from tests.integration.engine_helpers import (
    cgroup_exists,
    cgroup_procs,
    journal,
    journal_messages,
    llama_unit,
    process_ended,
    request,
    sse_events,
    stop_quietly,
    wait_for,
    wait_healthy,
)

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

LLAMA_BUILD = "b11434"


@pytest.fixture
async def units(systemd: Systemd) -> AsyncIterator[list[str]]:
    """Names of units a test started; all stopped afterwards, pass or fail."""
    started: list[str] = []
    yield started
    for unit in started:
        await stop_quietly(systemd, unit)


async def start(systemd: Systemd, units: list[str], spec: UnitSpec) -> None:
    units.append(spec.name)
    assert await systemd.start_transient(spec) == "done"


async def test_llama_server_unit_answers_chat_plain_and_streamed(
        systemd: Systemd, units: list[str], llama_server: Path,
        tiny_models: dict[str, Path]) -> None:
    spec, sock = llama_unit("alpha", llama_server, tiny_models["alpha"])
    await start(systemd, units, spec)
    await wait_healthy(sock)

    # the process behind the unit is the real binary, in the unit's own cgroup
    service = await systemd.properties(spec.name, SERVICE)
    main_pid, control_group = service["MainPID"], service["ControlGroup"]
    assert Path(f"/proc/{main_pid}/exe").resolve() == llama_server.resolve()
    assert control_group.endswith(f"/{spec.name}")
    assert main_pid in cgroup_procs(control_group)
    # a private socket: srwx------ in a 0700 directory under /run, and no TCP listener
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o700
    assert _tcp_listeners_of(main_pid) == []

    status, body = await request(sock, "GET", "/props")
    props = json.loads(body)
    assert status == 200
    assert LLAMA_BUILD in props["build_info"]
    assert props["model_path"] == str(tiny_models["alpha"])

    status, body = await request(sock, "POST", "/v1/chat/completions", json_body={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["object"] == "chat.completion"
    assert answer["usage"]["completion_tokens"] == 8  # the tiny model never stops early
    assert answer["choices"][0]["message"]["content"].strip()

    status, body = await request(sock, "POST", "/v1/chat/completions", json_body={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c["choices"])
    assert text.strip()
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


async def test_kill_9_is_restarted_by_systemd_and_seen_in_signals(
        systemd: Systemd, units: list[str], llama_server: Path,
        tiny_models: dict[str, Path]) -> None:
    spec, sock = llama_unit("beta", llama_server, tiny_models["beta"])
    seen: list[Mapping[str, Any]] = []
    unwatch = systemd.watch(lambda unit, changed: seen.append(changed)
                            if unit == spec.name else None)
    try:
        await start(systemd, units, spec)
        await wait_healthy(sock)
        service = await systemd.properties(spec.name, SERVICE)
        first_pid = service["MainPID"]
        assert service["NRestarts"] == 0

        os.kill(first_pid, signal.SIGKILL)

        async def restarted() -> bool:
            pid = (await systemd.properties(spec.name, SERVICE))["MainPID"]
            state = (await systemd.properties(spec.name, UNIT))["ActiveState"]
            return bool(pid) and pid != first_pid and state == "active"
        await wait_for(restarted, what="systemd to restart the engine")
        await wait_healthy(sock)
        assert (await systemd.properties(spec.name, SERVICE))["NRestarts"] == 1
        status, _ = await request(sock, "POST", "/v1/completions",
                                  json_body={"prompt": "hi", "max_tokens": 2})
        assert status == 200
    finally:
        unwatch()
    # the crash arrived as signals, with the kill in them: no polling needed
    assert any(c.get("SubState") == "auto-restart" for c in seen), seen
    assert any(c.get("ExecMainCode") == 2 and c.get("ExecMainStatus") == signal.SIGKILL
               for c in seen), seen  # CLD_KILLED by signal 9


async def test_stop_kills_the_whole_cgroup(
        systemd: Systemd, units: list[str], llama_server: Path,
        tiny_models: dict[str, Path]) -> None:
    # a helper process forked beside the engine: StopUnit must take it down too
    spec, sock = llama_unit("gamma", llama_server, tiny_models["gamma"], prefix=[
        "/bin/bash", "-c", 'sleep 600 & exec "$@"', "engine-with-a-child"])
    await start(systemd, units, spec)
    await wait_healthy(sock)
    service = await systemd.properties(spec.name, SERVICE)
    control_group, main_pid = service["ControlGroup"], service["MainPID"]
    others = [p for p in cgroup_procs(control_group) if p != main_pid]
    assert len(others) == 1, cgroup_procs(control_group)

    async def child_is_sleep() -> bool:
        return Path(f"/proc/{others[0]}/comm").read_text().strip() == "sleep"
    await wait_for(child_is_sleep, timeout=5, what="the forked child to exec sleep")

    assert await systemd.stop_unit(spec.name) == "done"

    assert process_ended(main_pid)
    assert process_ended(others[0]), Path(f"/proc/{others[0]}/stat").read_text()

    async def cgroup_gone() -> bool:  # removed as the unit goes inactive; allow a moment
        return not cgroup_exists(control_group)
    await wait_for(cgroup_gone, timeout=5, what=f"{control_group} to be removed")

    async def runtime_directory_gone() -> bool:   # systemd removes it as the unit ends;
        return not os.path.exists(os.path.dirname(sock))   # CI once saw it a moment later
    await wait_for(runtime_directory_gone, timeout=5, what="the RuntimeDirectory to go")
    assert [u.name for u in await systemd.list_units([spec.name])] == []


async def test_engine_with_mmproj_logs_to_the_journal(
        systemd: Systemd, units: list[str], llama_server: Path,
        tiny_models: dict[str, Path]) -> None:
    mmproj = tiny_models["alpha"].with_name("mmproj-tiny-alpha.gguf")
    spec, sock = llama_unit("alpha-journal", llama_server, tiny_models["alpha"],
                            extra=["--mmproj", str(mmproj)])
    await start(systemd, units, spec)
    await wait_healthy(sock)
    _, body = await request(sock, "GET", "/props")
    assert json.loads(body)["modalities"]["vision"] is True  # the generated mmproj loaded
    main_pid = (await systemd.properties(spec.name, SERVICE))["MainPID"]
    messages = journal_messages(await journal(spec.name))
    lines = [m["MESSAGE"] for m in messages if isinstance(m.get("MESSAGE"), str)]
    assert any("listening" in line for line in lines), lines[-20:]
    from_engine = [m for m in messages if m.get("_PID") == str(main_pid)]
    assert from_engine, "no journal lines from the engine's own PID"
    assert all(m["SYSLOG_IDENTIFIER"] == "llm-engine-alpha-journal" for m in from_engine)
    # found by the command a user would type
    out = subprocess.run(["journalctl", "-u", spec.name, "-o", "cat", "--no-pager"],
                         capture_output=True, text=True, check=True).stdout
    assert "listening" in out


async def test_whisper_server_unit_transcribes_an_espeak_wav(
        systemd: Systemd, units: list[str], whisper_server: Path, tiny_whisper: Path,
        tmp_path: Path) -> None:
    wav = tmp_path / "hello.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "hello world"], check=True)
    assert wav.read_bytes()[:4] == b"RIFF"
    # TCP inside the container's private network namespace; the unix-socket-only
    # form (private netns + socket proxy) belongs to the engine layer.
    port = 18180
    spec = UnitSpec(name="llm-engine-whisper.service", argv=[
        str(whisper_server), "-m", str(tiny_whisper), "--host", "127.0.0.1", "--port",
        str(port), "--inference-path", "/v1/audio/transcriptions", "-t", "1"],
        syslog_identifier="llm-engine-whisper", restart_sec=0.2)
    await start(systemd, units, spec)
    url = f"http://127.0.0.1:{port}"
    await wait_healthy(None, url=url)
    main_pid = (await systemd.properties(spec.name, SERVICE))["MainPID"]
    assert Path(f"/proc/{main_pid}/exe").resolve() == whisper_server.resolve()

    import aiohttp
    form = aiohttp.FormData()
    form.add_field("file", wav.read_bytes(), filename="hello.wav", content_type="audio/wav")
    form.add_field("response_format", "json")
    form.add_field("temperature_inc", "0")
    status, body = await request(None, "POST", "/v1/audio/transcriptions", data=form, url=url)
    assert status == 200, body
    assert json.loads(body)["text"].strip()  # random weights: garbage, but real text


def _tcp_listeners_of(pid: int) -> list[str]:
    """Listening TCP sockets (v4/v6) owned by pid."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                listening.append(fields[1])
    return listening




async def test_whisper_launcher_without_private_network_falls_back_to_distinct_ports(
        systemd: Systemd, units: list[str], whisper_server: Path, tiny_whisper: Path,
        tmp_path: Path) -> None:
    """Where PrivateNetwork is unavailable: a free loopback port each, chosen under a lock."""
    wav = tmp_path / "hello.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "hello"], check=True)
    specs = []
    for name in ("w1", "w2"):
        rundir = f"llm-engine-{name}"
        sock = f"/run/{rundir}/engine.sock"
        specs.append((UnitSpec(name=f"{rundir}.service", argv=[
            sys.executable, "-m", "gatewayd.engine_launch", "--socket", sock, "--",
            str(whisper_server), "-m", str(tiny_whisper), "--host", "127.0.0.1", "--port",
            "{port}", "--inference-path", "/v1/audio/transcriptions", "-t", "1"],
            runtime_directory=rundir, restart_sec=0.2,
            environment={"PYTHONPATH": os.getcwd()}), sock))
    for spec, _ in specs:
        units.append(spec.name)
    await asyncio.gather(*(systemd.start_transient(spec) for spec, _ in specs))
    ports = set()
    for spec, sock in specs:
        await wait_healthy(sock)
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o700
        out = subprocess.run(
            ["curl", "-sS", "--unix-socket", sock, "http://e/v1/audio/transcriptions",
             "-F", f"file=@{wav}", "-F", "temperature_inc=0"],
            capture_output=True, text=True, check=True).stdout
        assert json.loads(out)["text"].strip()
        said = [m["MESSAGE"] for m in journal_messages(await journal(spec.name))
                if "using 127.0.0.1:" in str(m.get("MESSAGE"))]
        found = re.search(r"using 127\.0\.0\.1:(\d+)", said[0])
        assert found, said   # (the line goes on to say the port is the host's)
        port = int(found.group(1))
        assert 39000 <= port < 40000
        ports.add(port)
    assert len(ports) == 2
