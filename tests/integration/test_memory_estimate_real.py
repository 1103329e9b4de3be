"""The memory estimate against what a real llama-server reports for itself.

Each case starts llama-server (CPU, on the host, no systemd) on a generated model with
one context size, cache type and slot layout, reads its log until the model is loaded,
stops it, and compares each part it reports (model, KV cache, compute and output
buffers) with gatewayd.core.memory_estimate. A part agrees within 10 %, or within
0.5 MiB where llama-server reports under 5 MiB (those are mostly rounding).

The models: the tiny test model, and synthetic ones built the same way with more
layers and wider embeddings, so that the KV and compute figures are not all rounding:
grouped-query and plain multi-head attention, per-layer KV head counts (deci, one layer
without attention), Q8_0 weights, and sliding-window layers (gemma2).

Set MEMORY_ESTIMATE_TABLE=PATH to have the table written as markdown (it is printed
with -s either way).
"""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import make_tiny_model
import numpy as np
import pytest

from gatewayd.adapters.gguf_meta import read_gguf_facts
from gatewayd.core.memory_estimate import MIB, EngineSettings, MemoryEstimate, estimate

pytestmark = [pytest.mark.engine, pytest.mark.slow]

READY = "llama_server: model loaded"
START_DEADLINE_S = 60.0
TOLERANCE = 0.10
SMALL_MIB, FLOOR_MIB = 5.0, 0.5
# "<where>: <device> <part> buffer size = <MiB> MiB", e.g.
# "load_tensors:   CPU_Mapped model buffer size =    71.46 MiB",
# "llama_kv_cache:        CPU KV buffer size =    48.00 MiB",
# "sched_reserve:        CPU compute buffer size =    30.02 MiB"
BUFFER = re.compile(r"(\S+)\s+(model|KV|compute|output) buffer size =\s*([\d.]+) MiB")
PARTS = {"model": "weights", "KV": "kv_cache", "compute": "compute", "output": "output"}


def write_model(path: Path, *, arch: str = "llama", n_embd: int, n_layer: int, n_head: int,
                n_head_kv: int | list[int], n_ff: int, n_ctx: int, window: int = 0,
                q8_weights: bool = False, seed: int = 0) -> Path:
    """A synthetic model llama-server loads (make_tiny_model's vocabulary and template);
    deci takes per-layer KV head counts (0: a layer without attention), gemma2 a sliding
    window (its output is tied to the token embeddings)."""
    rng = np.random.default_rng(seed)
    toks, scores, types = make_tiny_model.vocab()
    head = n_embd // n_head
    kv = n_head_kv if isinstance(n_head_kv, list) else [n_head_kv] * n_layer
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(path.stem)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_weights else gguf.LlamaFileType.ALL_F32)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if window:
        w.add_sliding_window(window)
    make_tiny_model.add_tokenizer(w, toks, scores, types)
    w.add_chat_template(make_tiny_model.TEMPLATE)

    def matrix(name: str, rows: int, cols: int) -> None:
        data = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        if q8_weights:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, data)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    w.add_tensor("token_embd.weight",
                 rng.standard_normal((len(toks), n_embd), dtype=np.float32) * 0.1)
    for i in range(n_layer):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight")
        if kv[i]:
            matrix(b + "attn_q.weight", n_head * head, n_embd)
            matrix(b + "attn_k.weight", kv[i] * head, n_embd)
            matrix(b + "attn_v.weight", kv[i] * head, n_embd)
        matrix(b + "attn_output.weight", n_embd, n_head * head)
        if arch == "gemma2":
            norm(b + "post_attention_norm.weight")
            norm(b + "post_ffw_norm.weight")
        norm(b + "ffn_norm.weight")
        matrix(b + "ffn_gate.weight", n_ff, n_embd)
        matrix(b + "ffn_up.weight", n_ff, n_embd)
        matrix(b + "ffn_down.weight", n_embd, n_ff)
    norm("output_norm.weight")
    if arch != "gemma2":
        matrix("output.weight", len(toks), n_embd)
    make_tiny_model.finish(w)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("estimate")
    tiny = root / "tiny.gguf"
    make_tiny_model.write_model(str(tiny), name="tiny")
    return {
        "tiny": tiny,
        "gqa-512x6": write_model(root / "gqa.gguf", n_embd=512, n_layer=6, n_head=8,
                                 n_head_kv=2, n_ff=1536, n_ctx=32768),
        "mha-256x8": write_model(root / "mha.gguf", n_embd=256, n_layer=8, n_head=4,
                                 n_head_kv=4, n_ff=1024, n_ctx=8192),
        "deci-kv[2,0,8,1]": write_model(root / "deci.gguf", arch="deci", n_embd=256,
                                        n_layer=4, n_head=8, n_head_kv=[2, 0, 8, 1],
                                        n_ff=1024, n_ctx=8192),
        "q8w-512x4": write_model(root / "q8.gguf", n_embd=512, n_layer=4, n_head=8,
                                 n_head_kv=2, n_ff=2048, n_ctx=8192, q8_weights=True),
        "gemma2-swa512": write_model(root / "gemma2.gguf", arch="gemma2", n_embd=256,
                                     n_layer=4, n_head=4, n_head_kv=2, n_ff=1024,
                                     n_ctx=16384, window=512),
    }


@dataclass
class Row:
    model: str
    args: str
    part: str
    reported: float
    estimated: float

    @property
    def error(self) -> float:
        return (self.estimated - self.reported) / self.reported if self.reported else 0.0

    @property
    def ok(self) -> bool:
        if self.reported < SMALL_MIB:
            return abs(self.estimated - self.reported) <= FLOOR_MIB
        return abs(self.error) <= TOLERANCE


def _cases() -> Iterator[tuple[str, tuple[str, ...]]]:
    for ctx in ("512", "4096", "16384"):
        for cache in ("f16", "q8_0"):
            for model in ("gqa-512x6", "mha-256x8", "deci-kv[2,0,8,1]", "q8w-512x4",
                          "gemma2-swa512"):
                yield model, ("-c", ctx, "-ctk", cache, "-ctv", cache)
            # the tiny model's 16-wide heads do not fit q8_0's 32-element blocks
            yield "tiny", ("-c", ctx, "-ctk", cache if cache == "f16" else "f32",
                           "-ctv", cache if cache == "f16" else "f32")
    # slots with their own KV streams, flash attention off, the trained context left unset
    # (fit then sizes it for every stream), long flags (llama-server refuses --flag=value)
    yield "gqa-512x6", ("-c", "16384", "-np", "3")
    yield "gemma2-swa512", ("-c", "16384", "-np", "3")
    yield "gemma2-swa512", ("-c", "16384", "--swa-full")
    yield "mha-256x8", ("-c", "4096", "-fa", "off")
    yield "deci-kv[2,0,8,1]", ("--ctx-size", "2048", "--flash-attn", "off")
    yield "mha-256x8", ("-np", "2")
    yield "tiny", ()


def run_llama_server(binary: Path, model: Path, args: tuple[str, ...], tmp: Path
                     ) -> dict[str, float]:
    """MiB llama-server reports per part (summed over its buffers), once it has loaded
    the model; then it is stopped."""
    socket = tmp / f"engine-{time.monotonic_ns()}.sock"
    argv = [str(binary), "-m", str(model), "--host", str(socket), "-t", "1", "-lv", "4",
            "--no-warmup", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    log = b""
    deadline = time.monotonic() + START_DEADLINE_S
    try:
        # raw reads on the pipe: a buffered reader may hold the ready line while the
        # selector waits for more
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while READY.encode() not in log:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(timeout=left):
                    pytest.fail(f"llama-server not loaded within {START_DEADLINE_S}s: "
                                + log[-2000:].decode(errors="replace"))
                chunk = os.read(fd, 65536)
                if not chunk:
                    pytest.fail(f"llama-server exited ({proc.wait()}): "
                                + log[-2000:].decode(errors="replace"))
                log += chunk
    finally:
        proc.kill()      # our own child, by its PID
        proc.wait(timeout=30)
        proc.stdout.close()
    lines = log.decode(errors="replace").splitlines()
    parts: dict[str, float] = {}
    for line in lines:
        if m := BUFFER.search(line):
            part = PARTS[m.group(2)]
            parts[part] = parts.get(part, 0.0) + float(m.group(3))
    return parts


def estimated_parts(e: MemoryEstimate) -> dict[str, float]:
    return {"weights": e.weights_ram / MIB, "kv_cache": e.kv_ram / MIB,
            "compute": e.compute_ram / MIB, "output": e.output_ram / MIB}


def markdown(rows: list[Row]) -> str:
    out = ["| model | llama-server args | part | reported MiB | estimated MiB | error % |",
           "|---|---|---|---:|---:|---:|"]
    out += [f"| {r.model} | `{r.args or '(defaults)'}` | {r.part} | {r.reported:.2f} | "
            f"{r.estimated:.2f} | {r.error * 100:+.1f}{'' if r.ok else ' ✗'} |" for r in rows]
    return "\n".join(out) + "\n"


def test_estimate_matches_what_llama_server_reports(
        llama_server: Path, models: dict[str, Path], tmp_path: Path) -> None:
    rows: list[Row] = []
    facts: dict[str, Any] = {}
    for name, args in _cases():
        if name not in facts:
            facts[name] = read_gguf_facts(models[name], tensors=True)
            assert facts[name].error is None and facts[name].tensors is not None
        reported = run_llama_server(llama_server, models[name], args, tmp_path)
        settings = EngineSettings.parse(args)
        assert settings.warnings == ()
        ours = estimated_parts(estimate(facts[name], settings, gpu=False, mmproj_bytes=0))
        assert set(reported) == set(PARTS.values()), reported
        rows += [Row(name, " ".join(args), part, reported[part], ours[part])
                 for part in PARTS.values()]
    table = markdown(rows)
    print("\n" + table)
    if path := os.environ.get("MEMORY_ESTIMATE_TABLE"):
        Path(path).write_text(table)
    wrong = [r for r in rows if not r.ok]
    assert not wrong, "estimate off:\n" + markdown(wrong)
