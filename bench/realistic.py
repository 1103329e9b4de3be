"""Cold start and swap on a model of realistic size (TinyLlama-1.1B's shape, Q8_0, ~1.1 GiB:
scripts/get_model.sh realistic), against llama.cpp's router, where loading the weights is
most of a start: from the page cache (the common case) and with the file's pages dropped
(posix_fadvise DONTNEED on the file alone, never the host's drop_caches). And the same
cold start with parked units (parked_engines = 4) and without (0): what parking buys where
a load takes a second rather than 20 ms.

Three names for one file (hard links: real-a, real-b, real-c), so 3 models over 2 places
swap without three gigabytes of disk; each engine maps the file as a model of its own.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import shutil
import statistics
from functools import partial
from pathlib import Path
from typing import Any

from bench.suite import (
    PY,
    Plan,
    StreamRun,
    Target,
    chat,
    cleanup,
    cpu_seconds,
    first_byte_ms,
    interleave,
    main_pid,
    pct,
    post_json,
    router_model_id,
    run_unit,
    stream_once,
    wait_http,
)

NAMES = ("real-a", "real-b", "real-c")
GATEWAY = "http://127.0.0.1:18660"          # parked_engines = 4
GATEWAY_UNPARKED = "http://127.0.0.1:18661"  # parked_engines = 0, models named p0-*
ROUTER = "http://127.0.0.1:18662"
SETTLE_S = 0.3   # after a stop: the router unloads asynchronously, the gateway parks
STREAM_TOKENS = 256
PARALLEL = 4   # streams at once on one engine (llama-server's -np auto: 4 slots)


def link_models(source: Path, folder: Path) -> list[Path]:
    """source copied into folder (engines see /srv, not the host's cache under /root) and
    hard-linked under each name."""
    folder.mkdir(parents=True, exist_ok=True)
    first = folder / f"{NAMES[0]}.gguf"
    if not first.exists() or first.stat().st_size != source.stat().st_size:
        first.unlink(missing_ok=True)
        shutil.copyfile(source, first)
    paths = [first]
    for name in NAMES[1:]:
        path = folder / f"{name}.gguf"
        path.unlink(missing_ok=True)
        os.link(first, path)
        paths.append(path)
    return paths


def gateway_config(path: Path, weights: list[Path], llama: str, state: Path, port: int,
                   parked: int, prefix: str) -> Path:
    """weights: one file name per model (a file's name is an alias of its model)."""
    models = "".join(f'[models.{prefix}{name.removeprefix("real-")}]\npath = "{file}"\n'
                     for name, file in zip(NAMES, weights, strict=True))
    path.write_text(f'llama_server = "{llama}"\nstate_dir = "{state}"\nmax_engines = 2\n'
                    f"parked_engines = {parked}\n[listen]\nport = {port}\n"
                    f"[admin]\npublic = true\n{models}")
    return path


def resident_fraction(path: Path) -> float:
    """The share of path's pages in the page cache (mincore over a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec) / pages


def drop_pages(path: Path) -> None:
    """path's clean pages out of the page cache (this file's alone)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def stop_all(ids: dict[str, str]) -> None:
    for base, prefix in ((GATEWAY, "real-"), (GATEWAY_UNPARKED, "p0-")):
        for name in NAMES:
            await post_json(base + "/admin/engines/stop",
                            {"model": prefix + name.removeprefix("real-")})
    for model_id in ids.values():
        await post_json(ROUTER + "/models/unload", {"model": model_id})


async def section(plan: Plan, work: Path, llama: str, models: dict[str, Path],
                  retried: list[dict[str, str]]) -> dict[str, Any]:
    from bench.suite import once_more
    if "realistic" not in models:
        raise RuntimeError("no realistic model: bench/run passes --model realistic=PATH "
                           "(scripts/get_model.sh realistic)")
    root = work / "realistic"
    paths = link_models(models["realistic"], root / "models")
    weights = paths[0]
    for port, parked, prefix in ((18660, 4, "real-"), (18661, 0, "p0-")):
        cfg = gateway_config(root / f"gw{parked}.toml", paths, llama, root / f"state{parked}",
                             port, parked, prefix)
        run_unit(f"bench-real-gw{parked}", [PY, "-m", "gatewayd", "--config", str(cfg), "serve"],
                 notify=True)
    run_unit("bench-real-router", [llama, "--models-dir", str(root / "models"),
                                   "--models-max", "2", "--host", "127.0.0.1", "--port", "18662"])
    await wait_http(ROUTER + "/health")
    ids = {name: await router_model_id(name, ROUTER) for name in NAMES}
    gw = Target("gateway", GATEWAY)
    gw0 = Target("gateway_unparked", GATEWAY_UNPARKED)
    router = Target("router", ROUTER)

    async def cold(target: Target) -> float:
        """target's real-a (p0-a) stopped, then its first byte."""
        if target is router:
            await post_json(ROUTER + "/models/unload", {"model": ids["real-a"]})
            model = ids["real-a"]
        else:
            model = "p0-a" if target is gw0 else "real-a"
            status, body = await post_json(target.base + "/admin/engines/stop",
                                           {"model": model})
            if status != 200 and body.get("error", {}).get("code") != "engine_not_running":
                raise RuntimeError(f"{target.name}: stop {model}: {status} {body}")
        await asyncio.sleep(SETTLE_S)
        return await first_byte_ms(target, model)

    # every path's first start (the router's first load of each model) is not measured
    for target in (gw, gw0, router):
        await once_more(retried, f"realistic warm-up {target.name}", partial(cold, target))
    cached: dict[str, list[float]] = {"gateway": [], "gateway_unparked": [], "router": []}
    for i in range(plan.real_starts):
        order = [gw, gw0, router][i % 3:] + [gw, gw0, router][:i % 3]
        for target in order:
            cached[target.name].append(await once_more(
                retried, f"realistic cold start, page cache, {target.name}",
                partial(cold, target)))
    # the weights' pages dropped before each start: every engine of every path stopped
    # first (a mapping keeps its pages), then DONTNEED on the file
    dropped: dict[str, list[float]] = {"gateway": [], "router": []}
    residency: list[float] = []

    async def cold_dropped(target: Target) -> float:
        await stop_all(ids)
        await asyncio.sleep(SETTLE_S)
        drop_pages(weights)
        residency.append(resident_fraction(weights))
        model = ids["real-a"] if target is router else "real-a"
        return await first_byte_ms(target, model)

    for i in range(plan.real_starts):
        for target in ((gw, router) if i % 2 == 0 else (router, gw)):
            dropped[target.name].append(await once_more(
                retried, f"realistic cold start, pages dropped, {target.name}",
                partial(cold_dropped, target)))
    await stop_all(ids)
    # swap: 3 models over 2 places, each request evicts one (the unparked gateway idle)
    swap: dict[str, list[float]] = {"gateway": [], "router": []}
    for _ in range(plan.real_cycles):
        for name in ("real-c", "real-a", "real-b"):
            swap["gateway"].append(await once_more(
                retried, f"realistic swap to {name}, gateway",
                partial(first_byte_ms, gw, name)))
            swap["router"].append(await once_more(
                retried, f"realistic swap to {name}, router",
                partial(first_byte_ms, router, ids[name])))
    streaming = await streams(plan, [gw, router], {"router": ids["real-a"]},
                              {"gateway": main_pid("bench-real-gw4.service")}, retried)
    cleanup()   # the gateways, the router, and the engines, which outlive their gateway

    def p50(v: list[float]) -> float:
        return round(statistics.median(v), 1)

    def p95(v: list[float]) -> float:
        return round(pct(sorted(v), 95), 1)

    parked_0, parked_4 = p50(cached["gateway_unparked"]), p50(cached["gateway"])
    return {
        "model": {"preset": "realistic", "bytes": weights.stat().st_size},
        "cold_first_byte_ms": {"gateway": parked_4, "router": p50(cached["router"])},
        "cold_p95_ms": {"gateway": p95(cached["gateway"]), "router": p95(cached["router"])},
        "cold_samples_ms": {k: [round(x, 1) for x in v] for k, v in cached.items()},
        "cold_dropped_first_byte_ms": {k: p50(v) for k, v in dropped.items()},
        "cold_dropped_samples_ms": {k: [round(x, 1) for x in v] for k, v in dropped.items()},
        "dropped_resident_before_start": round(max(residency), 4) if residency else None,
        "swap_first_byte_ms": {k: p50(v) for k, v in swap.items()},
        "swap_p95_ms": {k: p95(v) for k, v in swap.items()},
        "swap_samples_ms": {k: [round(x, 1) for x in v] for k, v in swap.items()},
        "streaming": streaming,
        "parked": {"parked_0_ms": parked_0, "parked_4_ms": parked_4,
                   "saving_pct": round((parked_0 - parked_4) / parked_0 * 100, 2)},
    }


async def streams(plan: Plan, targets: list[Target], model_for: dict[str, str],
                  pids: dict[str, int], retried: list[dict[str, str]]) -> dict[str, Any]:
    """Streams on the realistic model, where a token takes the engine tens of ms: one at a
    time (256 tokens) and PARALLEL at once, each path's rate, its gaps between reads, and
    the gateway's CPU per event. What a relay's µs per event come to where users feel it."""
    from bench.suite import once_more
    out: dict[str, Any] = {}
    for t in targets:   # each path's engine loaded before anything is timed
        await once_more(retried, f"realistic stream warm-up, {t.name}",
                        partial(first_byte_ms, t, model_for.get(t.name, "real-a")))
    for label, parallel in (("c1", 1), (f"c{PARALLEL}", PARALLEL)):
        got: dict[str, dict[str, list[float]]] = {
            t.name: {"tok_s": [], "gaps": [], "ttft": [], "cpu": []} for t in targets}
        for rnd in range(plan.real_streams):
            for t in interleave(targets, rnd):
                model = model_for.get(t.name, "real-a")
                body = chat(model, STREAM_TOKENS // parallel, stream=True)
                pid = pids.get(t.name)

                async def together(t: Target = t, body: dict[str, Any] = body,
                                   n: int = parallel, pid: int | None = pid
                                   ) -> tuple[list[StreamRun], float]:
                    # the CPU of this attempt alone (once_more may run it twice)
                    cpu0 = cpu_seconds(pid)
                    runs = await asyncio.gather(*(stream_once(t, body) for _ in range(n)))
                    return list(runs), cpu_seconds(pid) - cpu0

                runs, cpu_s = await once_more(
                    retried, f"realistic stream {label}, {t.name}", together)
                v = got[t.name]
                if pid is not None:
                    events = sum(r.events for r in runs)
                    v["cpu"].append(cpu_s / max(1, events) * 1e6)
                v["tok_s"].append(sum(r.tokens_per_s for r in runs))
                v["ttft"].extend(r.first_token_ms for r in runs)
                for r in runs:
                    v["gaps"].extend(r.gaps)
        out[label] = {name: {
            "tokens_per_s": round(statistics.median(v["tok_s"]), 2),
            "first_token_ms": round(statistics.median(v["ttft"]), 1),
            "gap_p50_ms": round(pct(sorted(v["gaps"]), 50), 2),
            "gap_p99_ms": round(pct(sorted(v["gaps"]), 99), 2),
            "tokens_per_s_rounds": [round(x, 2) for x in v["tok_s"]],
            **({"cpu_us_per_event": round(statistics.median(v["cpu"]), 1)}
               if v["cpu"] else {})}
            for name, v in got.items()}
    return out
