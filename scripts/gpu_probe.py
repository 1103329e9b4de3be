#!/usr/bin/env python3
"""On a machine with an NVIDIA GPU: a CUDA llama-server on a model, and what the gateway's
own parts say of it, side by side, as JSON. Needs no systemd (the engine runs as a child).

    scripts/gpu_probe.py --llama-server BIN --model M.gguf [--args "-ngl 99"] [--out F]

- the exec and link cost of the binary (`--version`, 5 runs): what the parked wait
  (gatewayd/engine_park.c) pays ahead of a start;
- each start's exec -> /health 200 (3 starts, page cache warm after the first);
- the engine's GPU memory as the gateway's NVML adapter reads it per process
  (adapters/gpu.NvmlGpu.process_mib) against the gateway's estimate
  (core/memory_estimate.estimate_for, with the tensor table) for the same arguments;
- a ~4k-token prompt's prefill and a 128-token answer's decode rate, then the KV cache of
  that slot saved and restored (what the gateway does at a stop and a start) and the same
  prompt again: the agent loop's restore against a prefill, on a GPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gatewayd.adapters.config_file import load_config
from gatewayd.adapters.gpu import open_gpu
from gatewayd.adapters.model_files import TensorTables, load_catalog
from gatewayd.core.memory_estimate import estimate_for

PORT = 18777
BASE = f"http://127.0.0.1:{PORT}"


def http(method: str, path: str, body: dict[str, Any] | None = None,
         timeout: float = 300) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")[:300]}
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


def start(binary: str, model: Path, args: list[str], slots: Path, log: Path
          ) -> tuple[subprocess.Popen[bytes], float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([binary, "-m", str(model), "--host", "127.0.0.1", "--port",
                             str(PORT), "--slot-save-path", str(slots), *args],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}: see {log}")
        status, _ = http("GET", "/health", timeout=5)
        if status == 200:
            return proc, (time.perf_counter() - t0) * 1000
        time.sleep(0.005)
    proc.kill()
    raise RuntimeError("llama-server not ready in 300 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def completion(prompt: str, n: int) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    status, body = http("POST", "/completion", {"prompt": prompt, "n_predict": n,
                                               "cache_prompt": True, "id_slot": 0})
    if status != 200:
        raise RuntimeError(f"/completion: {status} {body}")
    return (time.perf_counter() - t0) * 1000, body.get("timings", {})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--args", default="-ngl 99")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    args = shlex.split(a.args)
    report: dict[str, Any] = {"args": args}
    work = Path(tempfile.mkdtemp(prefix="gpu-probe-"))
    log = work / "llama-server.log"
    slots = work / "slots"
    slots.mkdir()

    versions = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([a.llama_server, "--version"], capture_output=True, check=False)
        versions.append(round((time.perf_counter() - t0) * 1000, 2))
    report["version_exec_ms"] = versions

    cfg = work / "gw.toml"
    cfg.write_text(f'[models.probe]\npath = "{a.model}"\nargs = {json.dumps(args)}\n')
    model = next(m for m in load_catalog(load_config(cfg, required=True)) if m.id == "probe")
    est = estimate_for(model, gpu=True, facts=TensorTables().facts(model))
    report["estimate"] = est.describe() if est is not None else None
    gpu = open_gpu()
    report["adapter"] = gpu.description

    starts, vram = [], []
    for i in range(3):
        proc, took = start(a.llama_server, a.model, args, slots, log)
        starts.append(round(took, 1))
        per_process = gpu.process_mib() or {}
        vram.append(per_process.get(proc.pid))
        if i < 2:
            stop(proc)
    report["start_to_health_ms"] = starts
    report["vram_measured_mib"] = vram
    report["devices"] = [d.__dict__ for d in (gpu.devices() or [])]

    prompt = " ".join(f"the file number {i} has a name and a size" for i in range(200))
    ms, t = completion(prompt, 1)
    report["prefill"] = {"ms": round(ms, 1), "prompt_n": t.get("prompt_n"),
                         "prompt_ms": t.get("prompt_ms")}
    ms, t = completion(prompt, 128)
    report["decode"] = {"ms": round(ms, 1), "predicted_per_second": t.get("predicted_per_second"),
                        "cache_n": t.get("cache_n")}
    t0 = time.perf_counter()
    status, body = http("POST", "/slots/0?action=save", {"filename": "probe.bin"})
    report["slot_save"] = {"status": status, "ms": round((time.perf_counter() - t0) * 1000, 1),
                           "n_saved": body.get("n_saved"),
                           "bytes": (slots / "probe.bin").stat().st_size
                           if (slots / "probe.bin").exists() else None}
    stop(proc)
    proc, took = start(a.llama_server, a.model, args, slots, log)
    t0 = time.perf_counter()
    status, body = http("POST", "/slots/0?action=restore", {"filename": "probe.bin"})
    report["slot_restore"] = {"status": status,
                              "ms": round((time.perf_counter() - t0) * 1000, 1),
                              "n_restored": body.get("n_restored"), "start_ms": round(took, 1)}
    ms, t = completion(prompt, 1)
    report["after_restore"] = {"ms": round(ms, 1), "prompt_n": t.get("prompt_n"),
                               "cache_n": t.get("cache_n")}
    stop(proc)
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)
        (a.out.parent / "llama-server.log").write_text(log.read_text()[-20000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
