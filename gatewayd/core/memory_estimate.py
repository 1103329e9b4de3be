"""What a llama-server engine will hold, per device (RAM and VRAM), from its model's GGUF
header and its command line. Pure: the header is read by gatewayd.adapters.gguf_meta
(with tensors=True, for the per-block weight bytes).

The seam for admission:

    estimate_for(model, gpu=...) -> MemoryEstimate | None   # None: no usable header
    estimate(facts, settings, gpu=..., mmproj_bytes=...) -> MemoryEstimate
    EngineSettings.parse(args, ctx_size=...) -> EngineSettings

It follows what the llama-server we build (scripts/get_llama_server.sh) does, read from
its source and checked against its own log (tests/integration/test_memory_estimate_real.py):

- context: -c N, else 0 = the model's trained context. The total context is padded up to
  a multiple of 256 cells.
- parallel slots: -np N, else "auto": 4 slots sharing one unified KV cache of the whole
  context. An explicit -np without --kv-unified gives each slot its own stream of
  ctx/np cells (padded to 256), so the cache still holds about ctx cells in all, except
  where the context is unset or 0 and --fit is on (the default): then fit sizes it to
  the trained context for every stream (trained ctx x np).
- --fit (on by default) may also lower an unset context and choose -ngl where memory is
  short; the estimate is the figure before fit trims anything (what the engine holds
  where it fits).
- -ngl N puts the output layer and then the last N-1 repeating blocks on the GPU (llama.cpp
  counts the output layer as one); "all"/"auto" (the default): everything. Token
  embeddings always stay in RAM; a tied output (no output.weight) is a copy of them on
  the output layer's device.
- KV cache: per layer with KV heads, K and V rows of head_count_kv x key/value_length
  elements in the cache type (f16 unless -ctk/-ctv), on the device of the layer's
  weights (RAM with --no-kv-offload). Sliding-window layers hold min(ctx, window x
  streams + n_ubatch) cells (padded to 256) unless --swa-full.
- compute buffer: fitted to what llama-server reports on the CPU (see the test for the
  table): per ubatch token max(3 n_ff + 5 n_embd, (11 n_embd + 5 n_q + 8 n_kv)/3) + 10
  floats, plus the attention mask (f16, cells x ubatch) with flash attention (on by
  default where the device has it), or one layer's f32 KQ matrix and the f32 mask
  without it.

Not covered (the figure is then low or high, never refused): MLA caches (deepseek2's
kv_lora_rank), recurrent/SSM state (mamba, hybrid models), KV shared across layers
(gemma3n), --kv-unified-per-slot (not read), tensor overrides (-ot)
other than --cpu-moe/--n-cpu-moe, several GPUs (-ts), embeddings models' larger output
buffer, and split GGUF files (estimate_for gives None: the table covers part one only).
The GPU side (VRAM compute buffer, the host's pinned compute buffer) is by the same
formula as the CPU's and has not been measured on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gatewayd.core.model_facts import GgufFacts

if TYPE_CHECKING:
    from gatewayd.core.catalog import Model

MIB = 1024 * 1024
CTX_PAD = 256            # llama_context pads n_ctx (and each stream) to this many cells
DEFAULT_PARALLEL = 4     # llama-server's -np auto
DEFAULT_UBATCH = 512
DEFAULT_BATCH = 2048

# KV cache types llama-server accepts (-ctk/-ctv) -> (elements per block, bytes per block)
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}

# architectures whose sliding-window layers llama.cpp lays out by a fixed pattern when the
# file does not say (llama_model::load_swa_pattern's default): every n-th layer is a full
# one, the others use the window
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "gpt-oss": 2,
                "llama4": 4, "exaone4": 4, "olmo2": 4, "afmoe": 4}

_ON, _OFF = frozenset({"on", "1", "true", "enabled"}), frozenset({"off", "0", "false",
                                                                   "disabled"})


@dataclass(frozen=True)
class EngineSettings:
    """What in a llama-server command line decides its memory. None: llama-server's
    default (see the module docstring for what that is)."""
    ctx_size: int | None = None          # -c; 0 (or None): the trained context
    parallel: int | None = None          # -np; None: auto (4, unified KV)
    kv_unified: bool | None = None       # -kvu / -no-kvu
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    gpu_layers: int | None = None        # -ngl; None: all (also "all" and "auto")
    n_cpu_moe: int = 0                   # --n-cpu-moe N; --cpu-moe: every block
    kv_offload: bool = True              # -nkvo: False
    swa_full: bool = False
    flash_attn: bool = True              # -fa auto resolves to on where supported
    n_ubatch: int = DEFAULT_UBATCH
    n_batch: int = DEFAULT_BATCH
    fit: bool = True
    mmproj_offload: bool = True          # --no-mmproj-offload: the projector stays in RAM
    warnings: tuple[str, ...] = ()       # values that were not understood (default kept)

    @classmethod
    def parse(cls, args: Sequence[str], *, ctx_size: int | None = None) -> EngineSettings:
        """From ModelConfig.args (and ctx_size, which the unit passes as -c before the
        args: a -c in args wins, as it does on llama-server's command line). Reads
        `--flag value` and `--flag=value`, although llama-server itself refuses the
        second form (the engine would then not start at all)."""
        values: dict[str, Any] = {}
        warnings: list[str] = []
        if ctx_size:
            values["ctx_size"] = ctx_size
        for flag, value in _pairs(args):
            name = _FLAGS.get(flag)
            if name is None:
                continue
            try:
                values.update(_convert(name, flag, value))
            except ValueError as e:
                warnings.append(f"{flag}: {e}")
        return cls(**values, warnings=tuple(warnings))

    @property
    def unified(self) -> bool:
        """One KV stream shared by all slots: -kvu, else where -np is auto."""
        return self.kv_unified if self.kv_unified is not None else self.parallel is None

    @property
    def slots(self) -> int:
        return DEFAULT_PARALLEL if self.parallel is None else max(1, self.parallel)


# flag -> setting; flags that take no value are in _SWITCHES
_FLAGS = {
    "-c": "ctx_size", "--ctx-size": "ctx_size",
    "-np": "parallel", "--parallel": "parallel",
    "-kvu": "kv_unified", "--kv-unified": "kv_unified",
    "-no-kvu": "no_kv_unified", "--no-kv-unified": "no_kv_unified",
    "-ctk": "cache_type_k", "--cache-type-k": "cache_type_k",
    "-ctv": "cache_type_v", "--cache-type-v": "cache_type_v",
    "-ngl": "gpu_layers", "--gpu-layers": "gpu_layers", "--n-gpu-layers": "gpu_layers",
    "-ncmoe": "n_cpu_moe", "--n-cpu-moe": "n_cpu_moe",
    "-cmoe": "cpu_moe", "--cpu-moe": "cpu_moe",
    "-nkvo": "no_kv_offload", "--no-kv-offload": "no_kv_offload",
    "-kvo": "kv_offload", "--kv-offload": "kv_offload",
    "--swa-full": "swa_full",
    "-fa": "flash_attn", "--flash-attn": "flash_attn",
    "-ub": "n_ubatch", "--ubatch-size": "n_ubatch",
    "-b": "n_batch", "--batch-size": "n_batch",
    "-fit": "fit", "--fit": "fit",
    "--mmproj-offload": "mmproj_offload", "--no-mmproj-offload": "no_mmproj_offload",
}
_SWITCHES = {"-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified", "-cmoe", "--cpu-moe",
             "-nkvo", "--no-kv-offload", "-kvo", "--kv-offload", "--swa-full",
             "--mmproj-offload", "--no-mmproj-offload"}
_OPTIONAL_VALUE = {"-fa", "--flash-attn"}   # llama-server: -fa alone means on
# switch -> (setting, whether the switch turns it on)
_BOOLEANS = {"kv_unified": ("kv_unified", True), "no_kv_unified": ("kv_unified", False),
             "kv_offload": ("kv_offload", True), "no_kv_offload": ("kv_offload", False),
             "swa_full": ("swa_full", True), "cpu_moe": ("n_cpu_moe", True),
             "mmproj_offload": ("mmproj_offload", True),
             "no_mmproj_offload": ("mmproj_offload", False)}
ALL_BLOCKS = 1 << 30     # --cpu-moe: the experts of every block stay in RAM


def _pairs(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """(flag, value) for each flag we know, in order: `--flag value` and `--flag=value`."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, inline = arg.partition("=")
        i += 1
        if flag not in _FLAGS:
            continue
        if eq:
            out.append((flag, inline))
        elif flag in _SWITCHES:
            out.append((flag, None))
        elif flag in _OPTIONAL_VALUE and (i >= len(args) or args[i].startswith("-")):
            out.append((flag, "on"))
        elif i < len(args):
            out.append((flag, args[i]))
            i += 1
    return out


def _convert(name: str, flag: str, value: str | None) -> dict[str, Any]:
    text = (value or "").strip().lower()
    if name in ("ctx_size", "n_ubatch", "n_batch", "n_cpu_moe"):
        number = int(text)
        if number < 0:
            raise ValueError(f"{value!r} is negative")
        return {name: number}
    if name == "parallel":
        number = int(text)
        return {"parallel": None if number < 0 else number}
    if name in ("cache_type_k", "cache_type_v"):
        if text not in CACHE_TYPES:
            raise ValueError(f"unknown cache type {value!r}")
        return {name: text}
    if name == "gpu_layers":
        if text in ("all", "auto", "-1", "-2"):
            return {"gpu_layers": None}
        return {"gpu_layers": max(0, int(text))}
    if name in _BOOLEANS:
        if value is not None and text not in _ON | _OFF:
            raise ValueError(f"not a boolean: {value!r}")
        on = value is None or text in _ON
        setting, means = _BOOLEANS[name]
        result = on if means else not on
        if setting == "n_cpu_moe":
            return {setting: ALL_BLOCKS if result else 0}
        return {setting: result}
    if name in ("flash_attn", "fit"):
        if text == "auto" and name == "flash_attn":
            return {name: True}
        if text in _ON:
            return {name: True}
        if text in _OFF:
            return {name: False}
        raise ValueError(f"expected on/off, not {value!r}")
    raise ValueError(f"unhandled flag {flag}")   # pragma: no cover - _FLAGS lists these


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes an engine is expected to hold, by part and device; ram_mib and vram_mib are
    the totals, rounded up."""
    weights_ram: int
    weights_vram: int
    kv_ram: int
    kv_vram: int
    compute_ram: int
    compute_vram: int
    output_ram: int          # the logits/embeddings output buffer (host memory)
    mmproj: int              # the projector's file (its own compute buffer not counted)
    mmproj_on_gpu: bool
    ctx_cells: int           # KV cells in all streams of a full-attention layer
    embeddings: int = 0      # of weights_ram: the token embeddings (always in RAM)
    output_layer: int = 0    # of the weights on the output layer's device
    notes: tuple[str, ...] = field(default=())

    @property
    def ram_bytes(self) -> int:
        return (self.weights_ram + self.kv_ram + self.compute_ram + self.output_ram
                + (0 if self.mmproj_on_gpu else self.mmproj))

    @property
    def vram_bytes(self) -> int:
        return (self.weights_vram + self.kv_vram + self.compute_vram
                + (self.mmproj if self.mmproj_on_gpu else 0))

    @property
    def ram_mib(self) -> int:
        return -(-self.ram_bytes // MIB)

    @property
    def vram_mib(self) -> int:
        return -(-self.vram_bytes // MIB)

    def describe(self) -> dict[str, object]:
        """For status JSON: totals and parts in MiB (one decimal)."""
        def mib(n: int) -> float:
            return round(n / MIB, 1)
        return {
            "ram_mib": self.ram_mib, "vram_mib": self.vram_mib,
            "ctx_cells": self.ctx_cells,
            "token_embeddings": mib(self.embeddings), "output_layer": mib(self.output_layer),
            "ram": {"weights": mib(self.weights_ram), "kv_cache": mib(self.kv_ram),
                    "compute": mib(self.compute_ram), "output": mib(self.output_ram),
                    "mmproj": 0.0 if self.mmproj_on_gpu else mib(self.mmproj)},
            "vram": {"weights": mib(self.weights_vram), "kv_cache": mib(self.kv_vram),
                     "compute": mib(self.compute_vram),
                     "mmproj": mib(self.mmproj) if self.mmproj_on_gpu else 0.0},
            "notes": list(self.notes),
        }


def estimate_for(model: Model, *, gpu: bool,
                 facts: GgufFacts | None = None) -> MemoryEstimate | None:
    """The estimate for a catalog model's engine as configured; None where its header
    or tensor table could not be read (whisper models, unreadable or split files): then
    the files-plus-margin figure stands. facts: its header with the tensor table, where
    the catalog's (model.facts) has none (adapters/model_files.TensorTables)."""
    facts = facts or model.facts
    if facts is None or facts.tensors is None or _layout(facts) is None:
        return None
    split = facts.metadata.get("split.count")
    if isinstance(split, int) and split > 1:
        return None
    mmproj = model.mmproj_facts.file_size if model.mmproj_facts else 0
    if not mmproj and model.config.mmproj is not None:
        mmproj = max(0, model.size_bytes - facts.file_size - model.adapter_bytes)
    settings = EngineSettings.parse(model.config.args, ctx_size=model.config.ctx_size)
    return estimate(facts, settings, gpu=gpu, mmproj_bytes=mmproj,
                    adapter_bytes=model.adapter_bytes)


@dataclass(frozen=True)
class _Layout:
    """The header's numbers the estimate needs."""
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    head_k: int
    head_v: int
    ctx_train: int
    n_swa: int
    is_swa: tuple[bool, ...]


def _layout(facts: GgufFacts) -> _Layout | None:
    arch = facts.architecture
    meta = facts.metadata
    if arch is None:
        return None

    def num(key: str) -> int | None:
        value = meta.get(f"{arch}.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    n_layer, n_embd = num("block_count"), num("embedding_length")
    if not n_layer or not n_embd:
        return None
    n_head = _per_layer(meta.get(f"{arch}.attention.head_count"), n_layer)
    n_head_kv = _per_layer(meta.get(f"{arch}.attention.head_count_kv"), n_layer) or n_head
    if not n_head or not n_head_kv:
        return None
    first = next((h for h in n_head if h), 0)
    head_k = num("attention.key_length") or (n_embd // first if first else 0)
    head_v = num("attention.value_length") or head_k
    n_ff = _per_layer(meta.get(f"{arch}.feed_forward_length"), n_layer)
    n_swa = num("attention.sliding_window") or 0
    return _Layout(n_layer=n_layer, n_embd=n_embd, n_ff=max(n_ff or (0,)),
                   n_head=n_head, n_head_kv=n_head_kv, head_k=head_k, head_v=head_v,
                   ctx_train=num("context_length") or 0, n_swa=n_swa,
                   is_swa=_swa_layers(arch, meta, n_layer, n_swa))


def _per_layer(value: object, n_layer: int) -> tuple[int, ...] | None:
    """A per-layer count: one number for every layer, or an array of one per layer."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * n_layer
    if isinstance(value, list) and len(value) == n_layer and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return None


def _swa_layers(arch: str, meta: dict[str, Any], n_layer: int, n_swa: int) -> tuple[bool, ...]:
    """Which layers attend within the sliding window: the file's own pattern (a bool per
    layer, or every n-th layer full), else the architecture's default."""
    if n_swa <= 0:
        return (False,) * n_layer
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == n_layer:
        return tuple(bool(p) for p in pattern)
    n = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) \
        else SWA_PATTERNS.get(arch)
    if n is None:
        return (False,) * n_layer   # not known to use the window: sized as full (high)
    return tuple(n == 0 or i % n < n - 1 for i in range(n_layer))


def _pad(n: int, to: int = CTX_PAD) -> int:
    return -(-n // to) * to


def _row_bytes(cache_type: str, n: int) -> int:
    block, size = CACHE_TYPES[cache_type]
    return -(-n // block) * size


def estimate(facts: GgufFacts, settings: EngineSettings, *, gpu: bool,
             mmproj_bytes: int, adapter_bytes: int = 0) -> MemoryEstimate:
    """facts must carry the tensor table (facts.tensors) and the architecture's keys;
    ValueError otherwise. gpu: whether the engine sees a GPU (no GPU: all in RAM).
    adapter_bytes: its LoRA adapters' files, loaded whole beside the weights (on the
    GPU where the output layer is: a rough placement, as adapters are small)."""
    layout = _layout(facts)
    sizes = facts.tensors
    if layout is None or sizes is None:
        raise ValueError(f"{facts.path}: no layout or tensor table to estimate from")
    s = settings
    notes: list[str] = list(s.warnings)
    slots = s.slots
    streams = 1 if s.unified else slots

    # cells: llama_context's n_ctx, padded; per stream where each slot has its own
    ctx = s.ctx_size or 0
    if ctx == 0:
        ctx = layout.ctx_train * (streams if s.fit else 1)
        if not ctx:
            raise ValueError(f"{facts.path}: no context size given and none trained")
    n_ctx = _pad(ctx)
    per_stream = n_ctx if s.unified else _pad(n_ctx // slots)
    n_ubatch = min(s.n_ubatch, s.n_batch)
    swa_cells = per_stream if s.swa_full else min(
        per_stream, _pad(layout.n_swa * (slots if s.unified else 1) + n_ubatch))

    # devices: -ngl N = the output layer, then the last N-1 blocks (llama_model::load_tensors)
    n_layer = layout.n_layer
    n_gpu = 0 if not gpu else (n_layer + 1 if s.gpu_layers is None
                               else min(s.gpu_layers, n_layer + 1))
    first_gpu = n_layer + 1 - n_gpu
    on_gpu = [i >= first_gpu for i in range(n_layer)]
    output_on_gpu = n_gpu > 0

    weights_ram, weights_vram = sizes.token_embd, 0
    for i, nbytes in enumerate(sizes.blocks):
        gpu_here = i < n_layer and on_gpu[i]
        experts = sizes.experts[i] if i < len(sizes.experts) and i < s.n_cpu_moe else 0
        if gpu_here:
            weights_vram += nbytes - experts
            weights_ram += experts
        else:
            weights_ram += nbytes
    output = sizes.output + (0 if sizes.has_output else sizes.token_embd)
    if output_on_gpu:
        weights_vram += output + adapter_bytes
    else:
        weights_ram += sizes.output + adapter_bytes  # a tied output shares token_embd's

    kv_ram = kv_vram = 0
    for i in range(n_layer):
        kv_heads = layout.n_head_kv[i]
        # without flash attention V is stored transposed, every layer's as wide as the
        # widest (llama_kv_cache: n_embd_v_gqa_max), even a layer without KV heads
        width_v = layout.head_v * (kv_heads if s.flash_attn else max(layout.n_head_kv))
        if kv_heads == 0 and (s.flash_attn or width_v == 0):
            continue
        cells = (swa_cells if layout.is_swa[i] else per_stream) * streams
        nbytes = cells * (_row_bytes(s.cache_type_k, layout.head_k * kv_heads)
                          + _row_bytes(s.cache_type_v, width_v))
        if on_gpu[i] and s.kv_offload:
            kv_vram += nbytes
        else:
            kv_ram += nbytes

    compute = _compute_bytes(layout, s, per_stream, swa_cells, n_ubatch,
                             sizes.n_vocab or 0, slots)
    n_vocab = sizes.n_vocab or 0
    output_buf = 4 * slots * n_vocab     # one row of logits per slot
    if n_gpu > 0:
        # the graph runs on the GPU; the host keeps a pinned buffer for its inputs (the
        # token embeddings are looked up in RAM) and, with layers left in RAM, a full one
        tokens = min(n_ctx, n_ubatch)
        host = 4 * tokens * layout.n_embd + 2 * tokens * per_stream
        compute_ram = compute if n_gpu <= n_layer else host
        compute_vram = compute
        notes.append("GPU compute buffers: not measured on a GPU (CPU formula)")
    else:
        compute_ram, compute_vram = compute, 0
    if any(layout.is_swa) and not s.swa_full:
        notes.append(f"sliding-window layers hold {swa_cells} cells per stream")
    return MemoryEstimate(
        weights_ram=weights_ram, weights_vram=weights_vram, kv_ram=kv_ram, kv_vram=kv_vram,
        compute_ram=compute_ram, compute_vram=compute_vram, output_ram=output_buf,
        mmproj=mmproj_bytes, mmproj_on_gpu=gpu and s.mmproj_offload,
        ctx_cells=per_stream * streams,
        embeddings=sizes.token_embd, output_layer=output if output_on_gpu else sizes.output,
        notes=tuple(notes))


def _compute_bytes(layout: _Layout, s: EngineSettings, per_stream: int, swa_cells: int,
                   n_ubatch: int, n_vocab: int, slots: int) -> int:
    """The scheduler's compute buffer, as fitted to llama-server's own report (CPU)."""
    tokens = min(per_stream * (1 if s.unified else slots), n_ubatch)   # n_ctx, ubatch
    n_q = max(layout.n_head) * layout.head_k
    n_kv = max(layout.n_head_kv) * max(layout.head_k, layout.head_v)
    floats = max(3 * layout.n_ff + 5 * layout.n_embd,
                 (11 * layout.n_embd + 5 * n_q + 8 * n_kv) // 3) + 10
    base = 4 * tokens * floats + 4 * slots * n_vocab
    has_swa, has_full = any(layout.is_swa), not all(layout.is_swa)
    kv_views = (per_stream if has_full else 0) + (swa_cells if has_swa else 0)
    if s.flash_attn:
        return base + 2 * tokens * kv_views            # the f16 attention masks
    # without flash attention: the f32 masks, and one layer's whole KQ matrix, beside
    # about half of what the rest of the graph needs
    kq = 4 * tokens * per_stream * max(layout.n_head)
    return 4 * tokens * kv_views + max(base, kq + base // 2)
