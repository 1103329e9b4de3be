#!/usr/bin/env python3
"""Generate a tiny, deterministic, RANDOM-WEIGHT whisper model in the legacy
whisper.cpp ggml .bin format (the one read by whisper_model_load() in
whisper.cpp/src/whisper.cpp and written by models/convert-pt-to-ggml.py).

It transcribes nothing meaningful (output is garbage text), but whisper-server
loads it and runs the full encode/decode pipeline, so it is a real end-to-end
test fixture.  Standard library only (no numpy); ~0.2 s to generate, ~4.8 MB.

Layout written:
  int32 magic 0x67676d6c ("ggml")
  int32 x 11 hparams: n_vocab n_audio_ctx n_audio_state n_audio_head
        n_audio_layer n_text_ctx n_text_state n_text_head n_text_layer n_mels ftype
  int32 n_mel, int32 n_fft, float32[n_mel*n_fft] mel filters
  int32 n_tokens, then per token: uint32 len + raw bytes
  tensors: int32 n_dims, int32 name_len, int32 ttype, int32 ne[n_dims] (ggml order,
           fastest dim first), name bytes, raw data

Usage:
  python3 make_tiny_whisper.py OUT.bin [--seed 0] [--n-state 64] [--layers 1]
        [--heads 2] [--ftype q8_0|f16] [--english] [--vocab-from for-tests-ggml-tiny.bin]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import struct
import sys

GGML_MAGIC = 0x67676D6C
GGML_QNT_VERSION = 2  # ggml.h
GGML_QNT_VERSION_FACTOR = 1000
# ggml_type ids used in the per-tensor header
T_F32, T_F16, T_Q8_0 = 0, 1, 8
# file-level ftype (ggml_ftype): 1 mostly f16, 7 mostly q8_0.  ("all f32", ftype 0, is
# NOT offered: whisper.cpp 1.8.5 then makes the conv weights f32 and the CPU im2col
# aborts with GGML_ASSERT(src0->type == GGML_TYPE_F16) at the first request.)
FTYPES = {"f16": (1, T_F16), "q8_0": (7, T_Q8_0)}
N_FILE_TOKENS = 50257  # text tokens; whisper.cpp appends the special/lang/timestamp tokens
N_MELS, N_FFT = 80, 201  # 16 kHz, 400-point FFT -> 201 bins
N_AUDIO_CTX, N_TEXT_CTX = 1500, 448  # keep real context sizes (30 s window, 448 tokens)


class Rand:
    """Deterministic byte stream per tensor name (SHAKE-256, version independent)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def raw(self, name: str, n: int) -> bytes:
        return hashlib.shake_256(f"{self.seed}:{name}".encode()).digest(n)

    # exponent high-byte table: maps a random byte to sign | exp(8..11) | 2 mantissa bits
    # => |x| in [2^-7, 2^-3), i.e. ~0.008 .. 0.125 (sane activations for a random net)
    _HI = bytes((b & 0x80) | ((8 + ((b >> 2) & 3)) << 2) | (b & 3) for b in range(256))

    def f16_bytes(self, name: str, n: int) -> bytes:
        buf = bytearray(self.raw(name, 2 * n))
        buf[1::2] = bytes(buf[1::2]).translate(self._HI)
        return bytes(buf)

    def f32_bytes(self, name: str, n: int, offset: float = 0.0) -> bytes:
        vals = struct.unpack(f"<{n}e", self.f16_bytes(name, n))
        if offset:
            vals = tuple(v + offset for v in vals)
        return struct.pack(f"<{n}f", *vals)

    def q8_0_bytes(self, name: str, n: int) -> bytes:
        assert n % 32 == 0, "q8_0 needs rows that are multiples of 32"
        nb = n // 32
        buf = bytearray(self.raw(name, 34 * nb))  # 32 random int8 quants per block
        d = struct.pack("<e", 1.0 / 512)  # block scale -> |x| <= 0.25
        buf[0::34] = d[0:1] * nb
        buf[1::34] = d[1:2] * nb
        return bytes(buf)


def mel_filters(
    sr: int = 16000, n_fft: int = 400, n_mels: int = N_MELS
) -> tuple[int, int, list[float]]:
    """librosa.filters.mel(sr, n_fft, n_mels) (slaney scale + slaney norm), as used by whisper."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0

    def hz_to_mel(f: float) -> float:
        return min_log_mel + math.log(f / min_log_hz) / logstep if f >= min_log_hz else f / f_sp

    def mel_to_hz(m: float) -> float:
        return min_log_hz * math.exp(logstep * (m - min_log_mel)) if m >= min_log_mel else f_sp * m

    n_bins = n_fft // 2 + 1
    fft_f = [i * (sr / 2) / (n_bins - 1) for i in range(n_bins)]
    m_lo, m_hi = hz_to_mel(0.0), hz_to_mel(sr / 2)
    mel_f = [mel_to_hz(m_lo + i * (m_hi - m_lo) / (n_mels + 1)) for i in range(n_mels + 2)]
    out = []
    for m in range(n_mels):
        lo, c, hi = mel_f[m], mel_f[m + 1], mel_f[m + 2]
        enorm = 2.0 / (hi - lo)
        for f in fft_f:
            w = max(0.0, min((f - lo) / (c - lo), (hi - f) / (hi - c)))
            out.append(w * enorm)
    return n_mels, n_bins, out


def synth_vocab() -> list[bytes]:
    """Deterministic fake BPE-ish vocab: 256 byte-ish tokens, then pseudo words."""
    toks = [bytes([33 + (i % 94)]) for i in range(256)]
    toks[220] = b" "  # whisper.cpp does token_to_id.at(" ") (suppress_blank): must exist
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    for i in range(256, N_FILE_TOKENS):
        j, w = i, ""
        while True:
            w += cons[j % len(cons)] + vows[(j // len(cons)) % len(vows)]
            j //= len(cons) * len(vows)
            if j == 0:
                break
        toks.append((" " + w).encode())
    return toks


def read_for_tests(path: str) -> tuple[tuple[int, int, list[float]], list[bytes]]:
    """Take mel filters + token strings from whisper.cpp's models/for-tests-ggml-*.bin."""
    with open(path, "rb") as f:
        data = f.read()
    magic, *_hp = struct.unpack_from("<12i", data, 0)
    if magic != GGML_MAGIC:
        raise SystemExit(f"{path}: bad magic")
    off = 48
    n_mel, n_fft = struct.unpack_from("<2i", data, off)
    off += 8
    filters = list(struct.unpack_from(f"<{n_mel * n_fft}f", data, off))
    off += 4 * n_mel * n_fft
    (n_tok,) = struct.unpack_from("<i", data, off)
    off += 4
    toks = []
    for _ in range(n_tok):
        (ln,) = struct.unpack_from("<I", data, off)
        off += 4
        toks.append(data[off : off + ln])
        off += ln
    return (n_mel, n_fft, filters), toks


def build(
    out: str,
    seed: int = 0,
    n_state: int = 64,
    n_head: int = 2,
    n_layer: int = 1,
    ftype: str = "q8_0",
    multilingual: bool = True,
    vocab_from: str | None = None,
) -> tuple[str, int]:
    if n_state % n_head:
        raise SystemExit("n_state must be divisible by n_head")
    if ftype == "q8_0" and n_state % 32:
        raise SystemExit("q8_0 needs n_state multiple of 32")
    file_ftype, wtype = FTYPES[ftype]
    vtype = T_F16  # conv weights (loader: vtype)
    n_vocab = 51865 if multilingual else 51864  # >= 51865 => multilingual (99 langs)
    if vocab_from:
        (n_mel, n_fft, filters), toks = read_for_tests(vocab_from)
    else:
        n_mel, n_fft, filters = mel_filters()
        toks = synth_vocab()
    rnd = Rand(seed)
    S, A, T = n_state, N_AUDIO_CTX, N_TEXT_CTX

    tensors: list[
        tuple[str, tuple[int, ...], str]
    ] = []  # (name, ne (ggml order), kind) kind: w=weight matrix, c=conv, b=f32 noise, ln=f32 ~1

    def add(name: str, ne: tuple[int, ...], kind: str) -> None:
        tensors.append((name, ne, kind))

    add("encoder.positional_embedding", (S, A), "b")
    add("encoder.conv1.weight", (3, N_MELS, S), "c")
    add("encoder.conv1.bias", (1, S), "b")
    add("encoder.conv2.weight", (3, S, S), "c")
    add("encoder.conv2.bias", (1, S), "b")
    for i in range(n_layer):
        p = f"encoder.blocks.{i}."
        add(p + "attn_ln.weight", (S,), "ln")
        add(p + "attn_ln.bias", (S,), "b")
        for k in ("query", "key", "value", "out"):
            add(p + f"attn.{k}.weight", (S, S), "w")
            if k != "key":
                add(p + f"attn.{k}.bias", (S,), "b")
        add(p + "mlp_ln.weight", (S,), "ln")
        add(p + "mlp_ln.bias", (S,), "b")
        add(p + "mlp.0.weight", (S, 4 * S), "w")
        add(p + "mlp.0.bias", (4 * S,), "b")
        add(p + "mlp.2.weight", (4 * S, S), "w")
        add(p + "mlp.2.bias", (S,), "b")
    add("encoder.ln_post.weight", (S,), "ln")
    add("encoder.ln_post.bias", (S,), "b")
    add("decoder.positional_embedding", (S, T), "b")
    add("decoder.token_embedding.weight", (S, n_vocab), "w")
    for i in range(n_layer):
        p = f"decoder.blocks.{i}."
        for a in ("attn", "cross_attn"):
            add(p + f"{a}_ln.weight", (S,), "ln")
            add(p + f"{a}_ln.bias", (S,), "b")
            for k in ("query", "key", "value", "out"):
                add(p + f"{a}.{k}.weight", (S, S), "w")
                if k != "key":
                    add(p + f"{a}.{k}.bias", (S,), "b")
        add(p + "mlp_ln.weight", (S,), "ln")
        add(p + "mlp_ln.bias", (S,), "b")
        add(p + "mlp.0.weight", (S, 4 * S), "w")
        add(p + "mlp.0.bias", (4 * S,), "b")
        add(p + "mlp.2.weight", (4 * S, S), "w")
        add(p + "mlp.2.bias", (S,), "b")
    add("decoder.ln.weight", (S,), "ln")
    add("decoder.ln.bias", (S,), "b")

    h = hashlib.sha256()
    with open(out, "wb") as f:

        def w(b: bytes) -> None:
            h.update(b)
            f.write(b)

        w(struct.pack("<i", GGML_MAGIC))
        ft = file_ftype + (GGML_QNT_VERSION * GGML_QNT_VERSION_FACTOR if ftype == "q8_0" else 0)
        w(struct.pack("<11i", n_vocab, A, S, n_head, n_layer, T, S, n_head, n_layer, N_MELS, ft))
        w(struct.pack("<2i", n_mel, n_fft))
        w(struct.pack(f"<{len(filters)}f", *filters))
        w(struct.pack("<i", len(toks)))
        for t in toks:
            w(struct.pack("<I", len(t)) + t)
        for name, ne, kind in tensors:
            n = math.prod(ne)
            if kind == "w":
                ttype = wtype
            elif kind == "c":
                ttype = vtype
            else:
                ttype = T_F32
            if ttype == T_F32:
                data = rnd.f32_bytes(name, n, offset=1.0 if kind == "ln" else 0.0)
            elif ttype == T_F16:
                data = rnd.f16_bytes(name, n)
            else:
                data = rnd.q8_0_bytes(name, n)
            nb = name.encode()
            w(struct.pack(f"<3i{len(ne)}i", len(ne), len(nb), ttype, *ne) + nb)
            w(data)
    return h.hexdigest(), len(tensors)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-state", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--ftype", choices=sorted(FTYPES), default="q8_0")
    ap.add_argument("--english", action="store_true", help="n_vocab 51864 (English-only model)")
    ap.add_argument(
        "--vocab-from", help="for-tests-ggml-*.bin to copy real token strings + mel filters from"
    )
    a = ap.parse_args(argv)
    digest, nt = build(
        a.out, a.seed, a.n_state, a.heads, a.layers, a.ftype, not a.english, a.vocab_from
    )
    print(f"wrote {a.out}: {nt} tensors, sha256 {digest}", file=sys.stderr)


if __name__ == "__main__":
    main()
