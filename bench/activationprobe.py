"""Where socket activation's time goes: from the client's connect to the first answer.

Runs inside the systemd test container (bench/coldprobe --activation boots it). Each
sample is the bench suite's measurement (a fresh socket unit, a GET /health that
activates the gateway) with the gateway's journal lines placed on the client's clock;
one more, run with PYTHONPROFILEIMPORTTIME, lists the imports that cost the most.
Not a benchmark (no ratios to keep): a tool to find the next millisecond.
"""

from __future__ import annotations

import pstats
import statistics
import subprocess
import time
from pathlib import Path

import aiohttp

from bench.coldprobe import journal_since
from bench.suite import PY, REPO, tiny_models, write_config

PORT = 18690


def units(name: str, config: Path, env: dict[str, str], wrap: str = "") -> None:
    Path(f"/run/systemd/system/{name}.socket").write_text(
        f"[Socket]\nListenStream=127.0.0.1:{PORT}\n")
    environment = "".join(f"Environment={k}={v}\n" for k, v in env.items())
    Path(f"/run/systemd/system/{name}.service").write_text(
        f"[Unit]\nRequires={name}.socket\n[Service]\nType=notify\n{environment}"
        f"WorkingDirectory={REPO}\nExecStart={PY} {wrap}-m gatewayd --config {config} serve\n")
    subprocess.run(["systemctl", "daemon-reload"], check=True)
    subprocess.run(["systemctl", "start", f"{name}.socket"], check=True)


def stop(name: str) -> None:
    subprocess.run(["systemctl", "stop", f"{name}.socket", f"{name}.service"], check=False)
    for kind in ("socket", "service"):
        Path(f"/run/systemd/system/{name}.{kind}").unlink(missing_ok=True)
    subprocess.run(["systemctl", "daemon-reload"], check=False)


def exec_monotonic_us(name: str) -> int:
    out = subprocess.run(["systemctl", "show", "-P", "ExecMainStartTimestampMonotonic",
                          f"{name}.service"], capture_output=True, text=True).stdout
    try:
        return int(out.strip())
    except ValueError:
        return 0


async def one(i: int, config: Path, env: dict[str, str], wrap: str = ""
              ) -> tuple[float, list[tuple[float, str]]]:
    """One activation: ms to the first answer, and the gateway's lines (ms from the send)."""
    name = f"probe-sa{i}"
    units(name, config, env, wrap)
    sent_us = time.time_ns() // 1000
    sent_mono_us = time.monotonic_ns() // 1000
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session, \
            session.get(f"http://127.0.0.1:{PORT}/health") as resp:
        await resp.read()
    took = (time.perf_counter() - t0) * 1000
    lines = [((us - sent_us) / 1000, msg) for us, msg in journal_since(f"{name}.service", sent_us)]
    if (at := exec_monotonic_us(name)) > 0:
        lines.append(((at - sent_mono_us) / 1000, "(systemd: the gateway's process execs)"))
    stop(name)
    return took, sorted(lines)


async def probe(work: Path, llama: str, samples: int, verbose: bool) -> None:
    models, _ = tiny_models(work)
    config = write_config(work / "activation.toml", models, llama,
                          work / "activation-state", PORT)
    took: list[float] = []
    execs: list[float] = []
    for i in range(samples):
        ms, lines = await one(i, config, {})
        took.append(ms)
        execs += [at for at, what in lines if what.startswith("(systemd")]
        if verbose:
            print(f"activation {i}: {ms:.1f} ms")
            for at, what in lines:
                print(f"  {at:8.1f} {what[:110]}")
    print(f"socket activation -> first answer: median {statistics.median(took):.1f} ms "
          f"[{min(took):.1f}-{max(took):.1f}] n={samples}")
    if execs:
        print(f"  the gateway's process execs at: median {statistics.median(execs):.1f} ms")
    took_profiled, lines = await one(samples, config, {"PYTHONPROFILEIMPORTTIME": "1"})
    imports = [at for at, msg in lines if msg.startswith("import time:")]
    print(f"with PYTHONPROFILEIMPORTTIME: first answer at {took_profiled:.1f} ms; the imports' "
          f"lines from {min(imports, default=0):.1f} to {max(imports, default=0):.1f} ms")
    for at, msg in lines:
        if not msg.startswith("import time:"):
            print(f"  {at:8.1f} {msg[:110]}")
    costs: list[tuple[int, int, str]] = []
    for _, msg in lines:
        if msg.startswith("import time:") and "|" in msg:
            _, own, cumulative, module = (part.strip() for part in
                                          msg.replace("import time:", "|").split("|"))
            if own.isdigit():
                costs.append((int(own), int(cumulative), module))
    await one(samples + 1, config, {}, wrap=f"-m cProfile -o {work}/activation.prof ")
    stats = pstats.Stats(str(work / "activation.prof"))
    print("the activated gateway's run under cProfile (to its stop), by cumulative time:")
    stats.sort_stats("cumulative").print_stats(25)
    print("... the gateway's own functions:")
    stats.print_stats(r"gatewayd/", 40)
    print("imports by their own time (with PYTHONPROFILEIMPORTTIME, which slows them):")
    print(f"  all: {sum(c[0] for c in costs) / 1000:.1f} ms over {len(costs)} modules")
    for self_us, total_us, module in sorted(costs, reverse=True)[:25]:
        print(f"  {self_us / 1000:7.1f} ms own {total_us / 1000:7.1f} ms with its imports"
              f"  {module}")
