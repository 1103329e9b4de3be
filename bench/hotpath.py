"""The request path alone, on this machine, without systemd: where the gateway's CPU goes.

    .venv/bin/python -m bench.hotpath                 # gateway vs bare proxy, CPU µs/request
    .venv/bin/python -m bench.hotpath --stream        # the same for 256-event streams
    .venv/bin/python -m bench.hotpath --profile gw    # + py-spy's top functions in the gateway

Three processes: an instant engine (a raw asyncio protocol answering llama-server's way,
~10 µs a request, so the engine costs next to nothing), the proxy under test (the gateway
on fakes of systemd with its records and metrics on, or bench/bare_proxy.py), and wrk as
the client (C, so the load generator does not eat the core the proxy needs). Each proxy
is measured in alternating rounds; the figure that matters is the proxy's own CPU time per
request from /proc (robust to a noisy neighbour), with req/s beside it.

This is a tool for finding costs, not the benchmark: bench/run measures the product in a
real systemd against the real engine and llama.cpp's router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# the proxies on the last core, engine and client on the others: less noise from sharing
CORES = os.cpu_count() or 1
PIN_PROXY: list[str] = []   # (pinned to one core, its records thread would share it)
PIN_CLIENT = ["taskset", "-c", f"0-{CORES - 2}"] if CORES > 1 else []

# what llama-server sends (b11434), so the proxies do the work they do for real
CHAT_ANSWER = json.dumps({
    "choices": [{"finish_reason": "length", "index": 0,
                 "message": {"role": "assistant", "content": "Hello"}}],
    "created": 1764600000, "model": "tiny-alpha", "system_fingerprint": "b11434-0000000",
    "object": "chat.completion",
    "usage": {"completion_tokens": 1, "prompt_tokens": 9, "total_tokens": 10},
    "id": "chatcmpl-0123456789abcdef0123456789abcdef",
    "timings": {"prompt_n": 1, "prompt_ms": 0.4, "prompt_per_token_ms": 0.4,
                "prompt_per_second": 2500.0, "predicted_n": 1, "predicted_ms": 0.1,
                "predicted_per_token_ms": 0.1, "predicted_per_second": 10000.0}}).encode()
HEADERS = (b"Server: llama.cpp\r\nAccess-Control-Allow-Origin: \r\n"
           b"Keep-Alive: timeout=5, max=100\r\n")
STREAM_EVENT = (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" w"}}],'
                b'"created":1764600000,"id":"chatcmpl-0123456789abcdef","model":"tiny-alpha",'
                b'"system_fingerprint":"b11434-0000000","object":"chat.completion.chunk"}\n\n')
STREAM_USAGE = (b'data: {"choices":[],"created":1764600000,"id":"chatcmpl-0123456789abcdef",'
                b'"model":"tiny-alpha","object":"chat.completion.chunk","usage":'
                b'{"completion_tokens":256,"prompt_tokens":9,"total_tokens":265}}\n\n')


STREAMS: set[asyncio.Future[None]] = set()


class InstantEngine(asyncio.Protocol):
    """llama-server's answers with no model behind them. Streams: one event per write,
    `gap_s` apart, as an engine generating tokens does (so each is its own read)."""

    events = int(os.environ.get("HOTPATH_EVENTS", "256"))
    gap_s = 0.00015   # the tiny model on this machine: ~7000 tokens/s

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end == -1:
                return
            head = self.buffer[:end]
            m = re.search(rb"(?i)content-length:\s*(\d+)", head)
            length = int(m.group(1)) if m else 0
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            if head.startswith(b"GET /health"):
                self._answer(b'{"status":"ok"}')
            elif b'"stream":true' in body or b'"stream": true' in body:
                task = asyncio.ensure_future(self._stream(b'"include_usage": true' in body
                                                          or b'"include_usage":true' in body))
                STREAMS.add(task)
                task.add_done_callback(STREAMS.discard)
            else:
                self._answer(CHAT_ANSWER)

    def _answer(self, body: bytes) -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\n" + HEADERS +
                             b"Content-Type: application/json; charset=utf-8\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)

    async def _stream(self, usage: bool) -> None:
        write = self.transport.write
        write(b"HTTP/1.1 200 OK\r\n" + HEADERS + b"Content-Type: text/event-stream\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(self.events):
            write(b"%x\r\n%s\r\n" % (len(STREAM_EVENT), STREAM_EVENT))
            time.sleep(self.gap_s)     # "computing the next token" (the loop's timers are
            await asyncio.sleep(0)     # too coarse for 0.15 ms); c=1, so nobody waits
        tail = (STREAM_USAGE if usage else b"") + b"data: [DONE]\n\n"
        write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
        self.transport.close()   # llama-server closes after every stream


async def _serve_engine(socket: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(InstantEngine, socket)
    async with server:
        await server.serve_forever()


async def _serve_gateway(socket_dir: str, port: int) -> None:
    """The real gateway app (records, metrics, dispatcher, access checks) on fakes of
    systemd, its one engine 'tiny-alpha' at the instant engine's socket."""
    from aiohttp import web

    from gatewayd.app import build_app
    from tests.fakes import engine_layer_on, engine_manager_on_fakes

    work = Path(tempfile.mkdtemp(prefix="hotpath-"))
    settings = json.loads(os.environ.get("HOTPATH_CONFIG", "{}"))   # GatewayConfig fields
    os.environ.update(settings.pop("_env", {}))     # and environment variables
    mgr, _units, _ = engine_manager_on_fakes(work, run_root=socket_dir, **settings)
    app = build_app(mgr.config, engines_ctx=engine_layer_on(mgr))
    runner = web.AppRunner(app, access_log=None, handle_signals=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await mgr.lifecycle.start("a")
    print("ready", flush=True)
    await asyncio.Event().wait()


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """The process's CPU time, or one thread's (tid == pid: the event loop's), from
    schedstat: nanoseconds on the CPU (/proc's stat counts in 10 ms ticks)."""
    tasks = [tid] if tid else [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    total = 0
    for task in tasks:
        with contextlib.suppress(FileNotFoundError):   # a thread that just ended
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total / 1e9


RAW = "raw"   # kinds' settings: the raw relay


def wait_port(port: int, timeout: float = 30) -> None:
    import socket
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout}s")


def wrk(port: int, body: dict[str, Any], seconds: float, connections: int,
        script_dir: Path) -> tuple[float, int]:
    """(req/s, requests) of one wrk run; a non-2xx answer fails the run."""
    lua = script_dir / "post.lua"
    lua.write_text(
        f"wrk.method = 'POST'\nwrk.body = {json.dumps(json.dumps(body))}\n"
        "wrk.headers['Content-Type'] = 'application/json'\n"
        "done = function(summary, latency, requests)\n"
        "  io.write(string.format('RESULT %d %d %d\\n', summary.requests,"
        " summary.errors.status, summary.errors.connect + summary.errors.read +"
        " summary.errors.write + summary.errors.timeout))\nend\n")
    out = subprocess.run([*PIN_CLIENT, "wrk", "-t1", f"-c{connections}",
                          f"-d{max(1, round(seconds))}s", "-s", str(lua),
                          f"http://127.0.0.1:{port}/v1/chat/completions"],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"RESULT (\d+) (\d+) (\d+)", out)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not m or not rate:
        raise RuntimeError(f"wrk said: {out}")
    requests, bad_status, errors = map(int, m.groups())
    if bad_status or errors:
        raise RuntimeError(f"port {port}: {bad_status} non-2xx, {errors} socket errors:\n{out}")
    return float(rate.group(1)), requests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hotpath")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--stream", action="store_true", help="256-event streams, c=1")
    ap.add_argument("--events", type=int, default=256,
                    help="events per stream (the fixed part of a stream's cost shows "
                         "against fewer)")
    ap.add_argument("--profile", metavar="NAME", help="py-spy the proxy NAME (gw, bare, ...)")
    ap.add_argument("--only", metavar="NAME", help="measure only the proxy NAME")
    ap.add_argument("--raw", action="store_true",
                    help="add bench/raw_relay.py: bytes passed on unparsed, the least a "
                         "Python relay spends (raw)")
    ap.add_argument("--uvloop-too", action="store_true",
                    help="each proxy also on uvloop (NAME-uv)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="one more gateway, with these GatewayConfig fields (HOTPATH_CONFIG)")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hp", dir="/tmp"))   # short: sun_path
    socket = str(work / "engine.sock")
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOTPATH_EVENTS": str(a.events)}
    try:
        procs.append(subprocess.Popen([*PIN_CLIENT, PY, "-c",
                                       "import asyncio, bench.hotpath as h; "
                                       f"asyncio.run(h._serve_engine({socket!r}))"], env=env))
        while not os.path.exists(socket):
            time.sleep(0.02)
        proxies: dict[str, subprocess.Popen[bytes]] = {}
        ports: dict[str, int] = {}
        kinds = [("gw", "{}", "asyncio"), ("bare", "", "asyncio")]
        if a.raw:
            kinds.append(("raw", RAW, "asyncio"))
        kinds += [(n, js, "asyncio") for n, _, js in (v.partition("=") for v in a.variant)]
        if a.uvloop_too:
            kinds += [(f"{n}-uv", js, "uvloop") for n, js, _ in list(kinds)]
        for i, (name, settings, loop) in enumerate(kinds):
            ports[name] = 18701 + i
            # the gateway and the bare proxy choose uvloop themselves where it is installed;
            # in this harness the gateway runs under asyncio.run: install says which loop
            install = ("import uvloop; uvloop.install(); " if loop == "uvloop" else
                       "import os; os.environ['LLM_GATEWAY_EVENT_LOOP'] = 'asyncio'; ")
            if settings in ("", RAW):   # the bare proxy, the raw relay
                module = "bench.raw_relay" if settings == RAW else "bench.bare_proxy"
                code = (f"{install}import sys, runpy; sys.argv[1:] = ['--socket', {socket!r}, "
                        f"'--port', '{ports[name]}']; runpy.run_module({module!r}, "
                        "run_name='__main__')")
            else:
                root = work / name
                (root / "llm-engine-a").mkdir(parents=True)
                os.symlink(socket, root / "llm-engine-a" / "engine.sock")
                code = (f"{install}import asyncio, bench.hotpath as h; "
                        f"asyncio.run(h._serve_gateway({str(root)!r}, {ports[name]}))")
            proxies[name] = subprocess.Popen([*PIN_PROXY, PY, "-c", code],
                                             env={**env, "HOTPATH_CONFIG":
                                                  settings if settings.startswith("{") else "{}"},
                                             stdout=subprocess.DEVNULL)
        procs += proxies.values()
        for port in ports.values():
            wait_port(port)
        time.sleep(0.5)   # the gateway starts its engine ("a") after it listens
        names = [a.only] if a.only else list(proxies)
        if a.profile and a.profile not in names:
            names.append(a.profile)
        body: dict[str, Any] = {"model": "a", "max_tokens": 1,
                                "messages": [{"role": "user", "content": "hi"}]}
        connections = a.connections
        if a.stream:
            body["stream"] = True
            connections = 1
        for name in names:   # warm up
            wrk(ports[name], body, 1, connections, work)
        figures: dict[str, dict[str, list[float]]] = {n: {"rate": [], "cpu": [], "loop": []}
                                                      for n in names}
        for rnd in range(a.rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                pid = proxies[name].pid
                c0, l0 = cpu_seconds(pid), cpu_seconds(pid, pid)
                rate, n = wrk(ports[name], body, a.seconds, connections, work)
                figures[name]["rate"].append(rate)
                figures[name]["cpu"].append((cpu_seconds(pid) - c0) / n * 1e6)
                figures[name]["loop"].append((cpu_seconds(pid, pid) - l0) / n * 1e6)
        unit = "stream" if a.stream else "request"
        for name in names:
            f = figures[name]
            print(f"{name:5} {statistics.median(f['rate']):9.1f} {unit}s/s   "
                  f"CPU {statistics.median(f['cpu']):7.1f} µs/{unit} "
                  f"(event loop {statistics.median(f['loop']):6.1f})  "
                  f"(spread {min(f['cpu']):.1f} to {max(f['cpu']):.1f})")
        if a.profile:
            profile(proxies[a.profile].pid, ports[a.profile], body, connections, work)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def profile(pid: int, port: int, body: dict[str, Any], connections: int, work: Path) -> None:
    """py-spy samples the proxy under load; prints where its samples are, by own time and
    by the time below each of our functions."""
    spy = shutil.which("py-spy") or str(Path(PY).with_name("py-spy"))
    raw = work / "profile.txt"
    rec = subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "2000", "--format",
                            "raw", "--output", str(raw), "--nonblocking", "--duration", "8"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    wrk(port, body, 7, connections, work)
    rec.wait()
    own: Counter[str] = Counter()
    below: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]  # by function
        own[frames[-1]] += n
        for frame in set(frames):
            below[frame] += n
    print(f"\n{total} samples. Own time:")
    for frame, n in own.most_common(30):
        print(f"  {100 * n / total:5.1f}%  {frame}")
    print("Time below (inclusive), gatewayd and aiohttp frames:")
    for frame, n in below.most_common(300):
        if ("gatewayd" in frame or "aiohttp" in frame or "bare_proxy" in frame) \
                and n / total > 0.01:
            print(f"  {100 * n / total:5.1f}%  {frame}")


if __name__ == "__main__":
    sys.exit(main())
