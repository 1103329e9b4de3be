#!/usr/bin/env python3
"""Write a llama-arch GGUF of a real model's shape and size, Q8_0, random weights, for
benchmarks where the model's load and prefill must cost what a real one's does.

    make_sized_model.py --preset realistic OUT.gguf [--name N] [--seed S]

Presets (shapes of published models; the weights are random, so the text is garbage):
  small      SmolLM2-135M's shape: 30 layers, 576 wide, 49152 tokens, ~0.17 GB
  realistic  TinyLlama-1.1B's shape: 22 layers, 2048 wide, 32000 tokens, ~1.17 GB
  tiny-q8    a few MB of the same build, for tests of this script
Each with an 8192-token context. The tokenizer is make_tiny_model's (ChatML template,
byte fallback) padded with word pieces to the preset's vocabulary size. The output rows of
control and byte tokens are zero, the others' logits spread wide: with llama-server's
default sampling (top-k 40) neither an end-of-generation token nor a byte token is ever
sampled, so every completion runs to max_tokens in plain ASCII, as the tiny models' do.
`scripts/get_model.sh PRESET` caches one per preset."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import make_tiny_model as tiny
import numpy as np
import numpy.typing as npt

QK8_0 = 32                 # values per Q8_0 block: one fp16 scale, 32 int8
Q8_0_BLOCK_BYTES = 2 + QK8_0


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx: int = 8192


PRESETS = {
    "small": Shape(n_embd=576, n_layer=30, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152),
    "realistic": Shape(n_embd=2048, n_layer=22, n_head=32, n_head_kv=4, n_ff=5632,
                       n_vocab=32000),
    "tiny-q8": Shape(n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=256, n_vocab=1024),
}

Array = npt.NDArray[Any]


def padded_vocab(n_vocab: int) -> tuple[list[str], list[float], list[gguf.TokenType]]:
    """make_tiny_model's vocabulary, padded with made-up word pieces to n_vocab tokens."""
    toks, scores, types = tiny.vocab()
    i = 0
    while len(toks) < n_vocab:
        toks.append(f"\u2581x{i:x}")
        scores.append(-10.0 - i * 1e-4)
        types.append(gguf.TokenType.NORMAL)
        i += 1
    return toks[:n_vocab], scores[:n_vocab], types[:n_vocab]


class Q8Weights:
    """Random Q8_0 tensors, cut from one random pool (drawing a gigabyte of random numbers
    costs more than writing it) at random offsets, each block with its own scale."""

    def __init__(self, rng: np.random.Generator, pool_mib: int = 64) -> None:
        self._rng = rng
        self._pool = rng.integers(-127, 128, size=pool_mib << 20, dtype=np.int8)

    def tensor(self, rows: int, cols: int, std: float) -> Array:
        """rows x cols values of about std, as Q8_0 blocks: uint8 (rows, cols/32*34)."""
        if cols % QK8_0:
            raise ValueError(f"a Q8_0 row holds whole blocks of {QK8_0}, not {cols}")
        blocks = rows * cols // QK8_0
        out = np.empty((blocks, Q8_0_BLOCK_BYTES), dtype=np.uint8)
        # int8 uniform on [-127, 127] has a standard deviation of ~73.3
        out[:, :2] = np.full(blocks, std / 73.3, dtype=np.float16).view(np.uint8).reshape(-1, 2)
        need = blocks * QK8_0
        start = int(self._rng.integers(0, self._pool.size))
        reps = -(-(start + need) // self._pool.size)
        values = np.tile(self._pool, reps)[start:start + need] if reps > 1 \
            else self._pool[start:start + need]
        out[:, 2:] = values.view(np.uint8).reshape(blocks, QK8_0)
        return out.reshape(rows, cols // QK8_0 * Q8_0_BLOCK_BYTES)


def write_model(path: str, name: str, shape: Shape, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    q8 = Q8Weights(rng)
    s = shape
    hd = s.n_embd // s.n_head
    toks, scores, types = padded_vocab(s.n_vocab)
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tiny.add_tokenizer(w, toks, scores, types)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(tiny.TEMPLATE)
    q8_0 = gguf.GGMLQuantizationType.Q8_0

    def add(tensor_name: str, rows: int, cols: int, std: float) -> None:
        w.add_tensor(tensor_name, q8.tensor(rows, cols, std),
                     raw_dtype=q8_0)

    def ones() -> Array:
        return np.ones(s.n_embd, dtype=np.float32)

    add("token_embd.weight", s.n_vocab, s.n_embd, 1.0)
    for i in range(s.n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones())
        add(b + "attn_q.weight", s.n_head * hd, s.n_embd, 0.02)
        add(b + "attn_k.weight", s.n_head_kv * hd, s.n_embd, 0.02)
        add(b + "attn_v.weight", s.n_head_kv * hd, s.n_embd, 0.02)
        add(b + "attn_output.weight", s.n_embd, s.n_head * hd, 0.02)
        w.add_tensor(b + "ffn_norm.weight", ones())
        add(b + "ffn_gate.weight", s.n_ff, s.n_embd, 0.02)
        add(b + "ffn_up.weight", s.n_ff, s.n_embd, 0.02)
        add(b + "ffn_down.weight", s.n_embd, s.n_ff, 0.02)
    w.add_tensor("output_norm.weight", ones())
    # after output_norm each of the hidden state's values is ~1: logits of ~4 standard
    # deviations between tokens; the zeroed rows (control, byte) score 0, far below top-k
    out = q8.tensor(s.n_vocab, s.n_embd, 4.0 / np.sqrt(s.n_embd))
    silent = np.array([ty != gguf.TokenType.NORMAL for ty in types])
    out[silent] = 0
    w.add_tensor("output.weight", out, raw_dtype=q8_0)
    tiny.finish(w)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--name")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    tmp = Path(a.out + ".part")
    write_model(str(tmp), a.name or Path(a.out).stem, PRESETS[a.preset], a.seed)
    tmp.rename(a.out)   # a file at OUT is whole


if __name__ == "__main__":
    main()
