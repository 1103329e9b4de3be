#!/usr/bin/env python3
"""Write a tiny deterministic llama-arch GGUF (~0.65 MB) that llama-server loads
and chats with (garbage text). Needs the gguf package (and numpy, which it pulls in).
  make_tiny_model.py OUT.gguf [--name N] [--seed S] [--f16] [--mmproj MMPROJ.gguf]
                    [--reranker] [--lora LORA.gguf ...]
Self-made SPM vocab (specials, 256 byte-fallback tokens, ASCII, word pieces),
ChatML template. Embedding dim 0 is a constant 1 and output rows of
control/byte tokens get -20 there, so EOS/bytes are never sampled: every
completion runs to max_tokens with plain ASCII text. --mmproj writes a tiny
LLaVA-style ("mlp") CLIP projector that llama-server --mmproj accepts."""

from __future__ import annotations

import argparse
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = (  # noqa: SIM905 - a word list reads best as text
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them so some her would make like "
    "him into time has look two more write go see number no way could people my than first "
    "water been call who now find long down day did get come made may part hello world tiny "
    "model llama test token random garbage server socket router ok"
).split()
T = gguf.TokenType


def vocab() -> tuple[list[str], list[float], list[gguf.TokenType]]:
    toks: list[str] = []
    types: list[gguf.TokenType] = []

    def add(t: str, ty: gguf.TokenType) -> None:
        if t not in toks:
            toks.append(t)
            types.append(ty)

    add("<unk>", T.UNKNOWN)
    for t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>"):
        add(t, T.CONTROL)  # ids 1..4: BOS=1, EOS=4
    for b in range(256):
        add(f"<0x{b:02X}>", T.BYTE)
    for c in ["\u2581"] + [chr(c) for c in range(0x21, 0x7F)]:
        add(c, T.NORMAL)
    for w in [c for c in "abcdefghijklmnopqrstuvwxyz0123456789"] + WORDS:
        p = "\u2581" + w
        for i in range(2, len(p) + 1):  # all prefixes: SPM merges reach them
            add(p[:i], T.NORMAL)
    scores = [
        float(len(t)) - i * 1e-4 if ty == T.NORMAL else 0.0
        for i, (t, ty) in enumerate(zip(toks, types, strict=True))
    ]
    return toks, scores, types


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


Array = npt.NDArray[Any]


def add_tokenizer(w: gguf.GGUFWriter, toks: list[str], scores: list[float],
                  types: list[gguf.TokenType]) -> None:
    """The tiny vocabulary (vocab()), as llama.cpp reads it."""
    w.add_vocab_size(len(toks))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)
    w.add_unk_token_id(0)


def write_model(
    path: str,
    name: str,
    seed: int = 0,
    f16: bool = False,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx: int = 2048,
    reranker: bool = False,
) -> None:
    """reranker: a Qwen3-style reranker instead (qwen3 arch, rank pooling, a two-label
    classifier head), which llama-server --rerank serves on /v1/rerank."""
    rng = np.random.default_rng(seed)
    toks, scores, types = vocab()
    nv, hd, dt = len(toks), n_embd // n_head, (np.float16 if f16 else np.float32)

    def rnd(*s: int) -> Array:
        return (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(dt)

    def ones() -> Array:
        return np.ones(n_embd, dtype=np.float32)

    w = gguf.GGUFWriter(path, arch="qwen3" if reranker else "llama")
    w.add_name(name)
    if reranker:
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["no", "yes"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    add_tokenizer(w, toks, scores, types)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(TEMPLATE)
    emb = rng.standard_normal((nv, n_embd), dtype=np.float32) * 0.1
    emb[:, 0] = 1.0
    w.add_tensor("token_embd.weight", emb.astype(dt))
    for i in range(n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones())
        w.add_tensor(b + "attn_q.weight", rnd(n_head * hd, n_embd))
        w.add_tensor(b + "attn_k.weight", rnd(n_head_kv * hd, n_embd))
        w.add_tensor(b + "attn_v.weight", rnd(n_head_kv * hd, n_embd))
        w.add_tensor(b + "attn_output.weight", rnd(n_embd, n_head * hd))
        if reranker:   # qwen3 normalises q and k per head
            w.add_tensor(b + "attn_q_norm.weight", np.ones(hd, dtype=np.float32))
            w.add_tensor(b + "attn_k_norm.weight", np.ones(hd, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", ones())
        w.add_tensor(b + "ffn_gate.weight", rnd(n_ff, n_embd))
        w.add_tensor(b + "ffn_up.weight", rnd(n_ff, n_embd))
        w.add_tensor(b + "ffn_down.weight", rnd(n_embd, n_ff))
    w.add_tensor("output_norm.weight", ones())
    out = rng.standard_normal((nv, n_embd), dtype=np.float32)
    out[:, 0] = [0.0 if ty == T.NORMAL else -20.0 for ty in types]
    w.add_tensor("output.weight", out.astype(dt))
    if reranker:   # the classifier head: hidden state -> (no, yes); softmax gives the score
        w.add_tensor("cls.output.weight", (rng.standard_normal((2, n_embd),
                                                                dtype=np.float32)).astype(dt))
    finish(w)


def write_lora(
    path: str,
    name: str,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 128,
    rank: int = 4,
    alpha: float = 4.0,
) -> None:
    """A LoRA adapter for write_model's model (its default sizes): llama-server --lora
    loads it, and applied it changes the greedy answer. Tensors `<base>.lora_a` (rank, in)
    and `.lora_b` (out, rank) on attn_q, attn_v and ffn_up of each block and on the
    output (never token_embd, whose A and B llama.cpp swaps); the output's B is zero on
    the rows of control and byte tokens, so they stay unsampled and an answer still runs
    to max_tokens."""
    rng = np.random.default_rng(seed + 2000)
    toks, _, types = vocab()
    hd = n_embd // n_head

    def pair(base: str, n_out: int, n_in: int) -> None:
        w.add_tensor(base + ".lora_a", rng.standard_normal((rank, n_in), dtype=np.float32))
        b = rng.standard_normal((n_out, rank), dtype=np.float32)
        if base == "output.weight":
            b[[ty != T.NORMAL for ty in types]] = 0.0
        w.add_tensor(base + ".lora_b", b)

    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name(name)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for i in range(n_layer):
        b = f"blk.{i}."
        pair(b + "attn_q.weight", n_head * hd, n_embd)
        pair(b + "attn_v.weight", (n_head // 2) * hd, n_embd)
        pair(b + "ffn_up.weight", n_ff, n_embd)
    pair("output.weight", len(toks), n_embd)
    finish(w)


def write_mmproj(
    path: str,
    name: str,
    seed: int = 0,
    n_embd_text: int = 64,
    n_embd: int = 32,
    n_ff: int = 64,
    img: int = 32,
    patch: int = 16,
    hidden: int = 64,
) -> None:
    rng = np.random.default_rng(seed + 1000)

    def rnd(*s: int) -> Array:
        return rng.standard_normal(s, dtype=np.float32) * 0.02

    def zeros(n: int) -> Array:
        return np.zeros(n, dtype=np.float32)

    w = gguf.GGUFWriter(path, arch="clip")
    w.add_name(name + "-mmproj")
    w.add_type("mmproj")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.use_gelu", True)
    for k, v in {
        "image_size": img,
        "patch_size": patch,
        "embedding_length": n_embd,
        "feed_forward_length": n_ff,
        "projection_dim": n_embd_text,
        "attention.head_count": 2,
        "block_count": 1,
    }.items():
        w.add_uint32("clip.vision." + k, v)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5] * 3)
    w.add_array("clip.vision.image_std", [0.5] * 3)
    w.add_tensor("v.patch_embd.weight", rnd(n_embd, 3, patch, patch))
    w.add_tensor("v.position_embd.weight", rnd((img // patch) ** 2, n_embd))
    for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
        w.add_tensor(f"v.blk.0.{t}.weight", rnd(n_embd, n_embd))
        w.add_tensor(f"v.blk.0.{t}.bias", zeros(n_embd))
    for t in ("ln1", "ln2"):
        w.add_tensor(f"v.blk.0.{t}.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"v.blk.0.{t}.bias", zeros(n_embd))
    w.add_tensor("v.blk.0.ffn_up.weight", rnd(n_ff, n_embd))
    w.add_tensor("v.blk.0.ffn_up.bias", zeros(n_ff))
    w.add_tensor("v.blk.0.ffn_down.weight", rnd(n_embd, n_ff))
    w.add_tensor("v.blk.0.ffn_down.bias", zeros(n_embd))
    w.add_tensor("mm.0.weight", rnd(hidden, n_embd))
    w.add_tensor("mm.0.bias", zeros(hidden))
    w.add_tensor("mm.2.weight", rnd(n_embd_text, hidden))
    w.add_tensor("mm.2.bias", zeros(n_embd_text))
    finish(w)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out")
    ap.add_argument("--name", default="tiny-llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--f16", action="store_true")
    ap.add_argument("--mmproj", metavar="PATH")
    ap.add_argument("--reranker", action="store_true",
                    help="a qwen3 reranker (rank pooling, classifier head)")
    ap.add_argument("--lora", metavar="PATH", action="append", default=[],
                    help="also a LoRA adapter for it (repeat for more: each its own seed)")
    a = ap.parse_args(argv)
    write_model(a.out, a.name, a.seed, a.f16, reranker=a.reranker)
    for i, lora in enumerate(a.lora):
        write_lora(lora, f"{a.name}-lora{i}", seed=a.seed + i)
    if a.mmproj:
        write_mmproj(a.mmproj, a.name, a.seed)


if __name__ == "__main__":
    main()
