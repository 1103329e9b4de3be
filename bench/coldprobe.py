"""Where a cold start's time goes: the gateway's and the router's, interleaved.

Runs inside the systemd test container (bench/coldprobe boots it). For each start it
lines up, on one clock (CLOCK_REALTIME, µs): the client's send, the gateway's engine
events (loading = the wake written, ready), the engine's own log lines (journald's
receive stamps, and llama-server's own stamps since its logger started), and the first
byte. Not a benchmark (no ratios to keep): a tool to find the next millisecond.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.suite import (
    PY,
    EngineEvents,
    Target,
    cleanup,
    cold_model,
    first_byte_ms,
    post_json,
    router_model_id,
    run_unit,
    say_why_it_failed,
    tiny_models,
    wait_http,
    write_config,
)

MARKS = ("system info", "loading model", "model loaded", "server is listening",
         "starting the main loop", "launch_slot_", "restore", "prompt processing",
         "print_timing", "all slots are idle")


STAMP = re.compile(r"^(?:\[\d+\] )?(\d+)\.(\d+)\.(\d+)\.(\d+) ")
EVAL = re.compile(r"prompt eval time = +([\d.]+) ms")


def engine_facts(lines: list[tuple[int, str]]) -> dict[str, float]:
    """From the engine's own stamps (ms since its logger started): when it logged each
    mark, and its first prompt's eval time."""
    facts: dict[str, float] = {}
    for _, msg in lines:
        stamp = STAMP.match(msg)
        if stamp is None:
            continue
        m, sec, ms, us = (int(g) for g in stamp.groups())
        at = m * 60_000 + sec * 1000 + ms + us / 1000
        for mark in ("model loaded", "launch_slot_"):
            if mark in msg:
                facts.setdefault(mark, at)
        if (ev := EVAL.search(msg)) is not None:
            facts.setdefault("prompt eval", float(ev.group(1)))
    return facts


def timeline(label: str, sent: float, lines: list[tuple[int, str]],
             marks: list[tuple[float, str]]) -> None:
    """One start, ms from the client's send: the engine's lines placed by their own stamps
    (shifted by the smallest gap between journald's receipt and the stamp: an upper
    bound, journald reads late), beside the given marks."""
    stamped: list[tuple[float, str]] = []
    offsets: list[float] = []
    for us, msg in lines:
        if (stamp := STAMP.match(msg)) is not None:
            m, sec, ms, micro = (int(g) for g in stamp.groups())
            at = m * 60_000 + sec * 1000 + ms + micro / 1000
            offsets.append((us / 1e6 - sent) * 1000 - at)
            stamped.append((at, "engine: " + msg[stamp.end():]))
    shift = min(offsets, default=0.0)
    merged = [(at + shift, what) for at, what in stamped]
    for at, what in sorted([*merged, *marks]):
        print(f"  {label:9s} {at:8.2f} {what[:110]}")


def cpu_census() -> dict[str, int]:
    """CPU ns so far per process name (all threads), every process in view."""
    out: dict[str, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm = (proc / "comm").read_text().strip()
            if comm == "python":
                argv = (proc / "cmdline").read_bytes()
                comm = ("probe" if int(proc.name) == os.getpid() else
                        "gateway" if b"gatewayd" in argv else "python")
            ns = sum(int((t / "schedstat").read_text().split()[0])
                     for t in (proc / "task").iterdir())
        except (OSError, ValueError):
            continue
        out[f"{comm}:{proc.name}"] = out.get(f"{comm}:{proc.name}", 0) + ns
    return out


def census_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    per: dict[str, float] = {}
    for key, ns in after.items():
        name = key.split(":")[0]
        per[name] = per.get(name, 0) + (ns - before.get(key, 0)) / 1e6
    return per


def journal_since(unit: str, since_us: int) -> list[tuple[int, str]]:
    subprocess.run(["journalctl", "--sync"], check=False)
    out = subprocess.run(["journalctl", "-u", unit, "-o", "json", "--no-pager",
                          "--since", f"@{since_us / 1e6:.6f}"],
                         capture_output=True, text=True, check=False).stdout
    lines = []
    for raw in out.splitlines():
        entry = json.loads(raw)
        msg = entry.get("MESSAGE", "")
        if isinstance(msg, list):
            msg = bytes(msg).decode(errors="replace")
        lines.append((int(entry["__REALTIME_TIMESTAMP"]), msg))
    return lines


class Table:
    """Figures per key, over the starts."""

    def __init__(self) -> None:
        self.rows: dict[str, list[float]] = {}

    def note(self, key: str, value: float) -> None:
        self.rows.setdefault(key, []).append(value)

    def print(self) -> None:
        for key, values in self.rows.items():
            print(f"{key:60s} median {statistics.median(values):7.2f}  "
                  f"[{min(values):.2f}-{max(values):.2f}] n={len(values)}")


async def one_start(label: str, target: Target, model: str, unit: str, table: Table, *,
                    child_lines: bool, events: EngineEvents | None, verbose: bool) -> None:
    """One cold start of a model just stopped: its first byte, the CPU each process
    spent on it, its engine's log marks and stamps, and the gateway's phases (events)."""
    c0 = cpu_census()
    sent = time.time()
    took = await first_byte_ms(target, model)
    for name, ms in census_delta(c0, cpu_census()).items():
        if ms > 0.3:
            table.note(f"{label} CPU ms: {name}", ms)
    table.note(f"{label} first byte", took)
    marks: list[tuple[float, str]] = [(took, "client: first byte")]
    if events is not None and (at := await events.start_phases(model, sent)) is not None:
        table.note(f"{label} send->wake", (at[0] - sent) * 1000)
        table.note(f"{label} wake->ready", (at[1] - at[0]) * 1000)
        table.note(f"{label} ready->first byte", took - (at[1] - sent) * 1000)
        marks += [((e["ts"] - sent) * 1000, f"gateway: {e['state']}")
                  for e in events.seen if e["model"] == model and e["ts"] >= sent]
    lines = journal_since(unit, int(sent * 1e6))
    seen: set[str] = set()
    for us, msg in lines:
        for mark in (*MARKS, "spawning"):
            if mark in msg and mark not in seen:
                seen.add(mark)
                table.note(f"{label} log '{mark}' (journald, from send)",
                           (us / 1e6 - sent) * 1000)
                break
    # the router's own lines are stamped on its clock; its child's start with [port]
    engine = [(us, m) for us, m in lines if m.startswith("[")] if child_lines else lines
    facts = engine_facts(engine)
    if "model loaded" in facts:
        table.note(f"{label} engine: own load (its log clock)", facts["model loaded"])
        if "launch_slot_" in facts:
            table.note(f"{label} engine: loaded->request arrives",
                       facts["launch_slot_"] - facts["model loaded"])
    if "prompt eval" in facts:
        table.note(f"{label} engine: first prompt eval", facts["prompt eval"])
    if verbose:
        timeline(label, sent, engine, marks)


async def probe(work: Path, llama: str, starts: int, verbose: bool, cold_args: str) -> None:
    models, cold = tiny_models(work)
    cfg = write_config(work / "gw.toml", models, llama, work / "gw-state", 18600,
                       extra=cold_model(cold, cold_args.split()))
    run_unit("bench-gateway", [PY, "-m", "gatewayd", "--config", str(cfg), "serve"],
             notify=True)
    run_unit("bench-router", [llama, "--models-dir", str(models), "--models-max", "2",
                              "--host", "127.0.0.1", "--port", "18601"])
    await wait_http("http://127.0.0.1:18601/health")
    gw = Target("gateway", "http://127.0.0.1:18600")
    router = Target("router", "http://127.0.0.1:18601")
    rid = await router_model_id("tiny-beta")
    events = EngineEvents(gw.base)
    await events.start()
    table = Table()
    for model in ("tiny-beta", "tiny-cold"):
        await first_byte_ms(gw, model)
    await first_byte_ms(router, rid)
    for i in range(starts):
        for model in ("tiny-beta", "tiny-cold"):
            await post_json(gw.base + "/admin/engines/stop", {"model": model})
            await asyncio.sleep(0.3)
            await one_start(model, gw, model, "llm-engine-" + model.replace("-", "\\x2d")
                            + ".service", table, child_lines=False, events=events,
                            verbose=verbose and i < 2)
        await post_json(router.base + "/models/unload", {"model": rid})
        await asyncio.sleep(0.3)
        await one_start("router", router, rid, "bench-router.service", table,
                        child_lines=True, events=None, verbose=verbose and i < 2)
    await events.stop()
    table.print()


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.coldprobe")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--starts", type=int, default=10)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/srv/llm-gateway-coldprobe"))
    ap.add_argument("--cold-args", default="", help="tiny-cold's engine arguments")
    ap.add_argument("--activation", type=int, default=0, metavar="N",
                    help="instead: N socket activations (bench/activationprobe.py)")
    a = ap.parse_args()
    try:
        if a.activation:
            from bench.activationprobe import probe as activations
            asyncio.run(activations(a.work, a.llama_server, a.activation, a.verbose))
            return 0
        asyncio.run(probe(a.work, a.llama_server, a.starts, a.verbose, a.cold_args))
    except Exception:
        say_why_it_failed()
        subprocess.run(["journalctl", "-u", "llm-engine-*", "-n", "30", "--no-pager"])
        raise
    finally:
        cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
