"""Small helpers for tests that run real engines as units inside the container."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from gatewayd.adapters.systemd import Systemd
from gatewayd.core.unit_spec import UnitSpec

CGROUP_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup")


def llama_unit(name: str, binary: Path, model: Path, *, prefix: Sequence[str] = (),
               extra: Sequence[str] = (), restart_sec: float = 0.2) -> tuple[UnitSpec, str]:
    """A llama-server on a private unix socket under /run, as the gateway will run it."""
    rundir = f"llm-engine-{name}"
    sock = f"/run/{rundir}/engine.sock"
    argv = [*prefix, str(binary), "--host", sock, "-m", str(model), "-t", "1", "-c", "512", *extra]
    spec = UnitSpec(name=f"{rundir}.service", argv=argv, description=f"LLM engine {name}",
                    runtime_directory=rundir, syslog_identifier=rundir,
                    restart_sec=restart_sec, environment={"LLM_GATEWAY_MODEL": name})
    return spec, sock


async def request(sock: str | None, method: str, path: str, *, json_body: Any = None,
                  data: Any = None, url: str = "http://engine") -> tuple[int, bytes]:
    """One HTTP request over a unix socket (or TCP when sock is None)."""
    connector = aiohttp.UnixConnector(path=sock) if sock else aiohttp.TCPConnector()
    async with aiohttp.ClientSession(connector=connector) as session, session.request(
            method, url + path, json=json_body, data=data,
            timeout=aiohttp.ClientTimeout(total=60)) as resp:
        return resp.status, await resp.read()


async def wait_healthy(sock: str | None, timeout: float = 30, url: str = "http://engine") -> float:
    """Poll /health until 200; returns the seconds it took."""
    t0 = time.monotonic()
    last: object = None
    while time.monotonic() - t0 < timeout:
        try:
            status, _ = await request(sock, "GET", "/health", url=url)
            if status == 200:
                return time.monotonic() - t0
            last = status
        except (aiohttp.ClientError, OSError) as e:
            last = e
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine not healthy after {timeout}s (last: {last!r})")


def sse_events(body: bytes) -> list[str]:
    return [line[len(b"data: "):].decode() for line in body.splitlines()
            if line.startswith(b"data: ")]


def cgroup_procs(control_group: str) -> list[int]:
    for root in CGROUP_ROOTS:
        procs = Path(root + control_group, "cgroup.procs")
        if procs.exists():
            return [int(p) for p in procs.read_text().split()]
    return []


def ignores_sigpipe(pid: int) -> bool:
    """SIGPIPE (13) is in the process's ignored set (/proc/PID/status SigIgn)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGPIPE - 1)))
    return False


def cgroup_exists(control_group: str) -> bool:
    return any(Path(root + control_group).exists() for root in CGROUP_ROOTS)


def process_ended(pid: int) -> bool:
    """Gone, or a zombie: dead and out of its cgroup, only not yet reaped.

    A stop job is done once the cgroup is empty; a child the engine forked was
    reparented to PID 1, which reaps it when it gets to its SIGCHLD, a moment
    later. Asking for /proc/<pid> to be gone at once made CI flaky.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


async def wait_for(predicate: Any, timeout: float = 15, what: str = "condition") -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def journal(unit: str) -> str:
    sync = await asyncio.create_subprocess_exec("journalctl", "--sync")
    await sync.wait()
    proc = await asyncio.create_subprocess_exec(
        "journalctl", "-u", unit, "-o", "json", "--no-pager",
        stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.decode()


def journal_messages(raw: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


async def stop_quietly(sd: Systemd, unit: str) -> None:
    with contextlib.suppress(Exception):  # already gone: fine for cleanup
        await sd.stop_unit(unit)


def engine_slots(socket: str) -> list[dict[str, Any]]:
    """llama-server's own /slots, asked over its unix socket (as root, not through the
    gateway): each slot's is_processing and its task's n_decoded."""
    import http.client
    import socket as socket_mod

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
            self.sock.settimeout(10)
            self.sock.connect(socket)

    conn = UnixConnection("engine")
    try:
        conn.request("GET", "/slots")
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return list(json.loads(resp.read()))
    finally:
        conn.close()


def decoding(socket: str) -> tuple[bool, int]:
    """(whether any slot is generating, the most tokens any slot's task has decoded)."""
    slots = engine_slots(socket)
    tasks: list[dict[str, Any]] = []
    for slot in slots:
        next_token = slot.get("next_token")
        tasks += next_token if isinstance(next_token, list) else [next_token or {}]
    decoded = max((int(t.get("n_decoded", 0)) for t in tasks), default=0)
    return any(slot.get("is_processing") for slot in slots), decoded
