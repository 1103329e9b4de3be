"""The memory estimate on hand-made headers: settings parsing, devices, KV cache sizes.
(Its figures against a real llama-server: tests/integration/test_memory_estimate_real.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gatewayd.core.catalog import Model
from gatewayd.core.config import ModelConfig
from gatewayd.core.memory_estimate import (
    ALL_BLOCKS,
    MIB,
    EngineSettings,
    estimate,
    estimate_for,
)
from gatewayd.core.model_facts import GgufFacts, TensorSizes

BLOCK = 100 * MIB


def facts(arch: str = "llama", n_layer: int = 4, n_embd: int = 4096, n_head: Any = 32,
          n_head_kv: Any = 8, ctx: int = 8192, experts: int = 0, tied: bool = False,
          extra: dict[str, Any] | None = None) -> GgufFacts:
    meta = {"general.architecture": arch, f"{arch}.block_count": n_layer,
            f"{arch}.embedding_length": n_embd, f"{arch}.feed_forward_length": 4 * n_embd,
            f"{arch}.attention.head_count": n_head,
            f"{arch}.attention.head_count_kv": n_head_kv, f"{arch}.context_length": ctx}
    meta.update({f"{arch}.{k}": v for k, v in (extra or {}).items()})
    sizes = TensorSizes(blocks=(BLOCK,) * n_layer, experts=(experts,) * n_layer,
                        token_embd=50 * MIB, output=0 if tied else 60 * MIB,
                        has_output=not tied, n_vocab=32000)
    return GgufFacts(path="/m.gguf", file_size=sizes.total, metadata=meta, tensors=sizes)


def kv_bytes(cells: int, layers: int, width: int, per_element: float = 2) -> int:
    return int(cells * layers * 2 * width * per_element)


# -- settings ---------------------------------------------------------------------------


def test_defaults_are_llama_servers() -> None:
    s = EngineSettings.parse([])
    assert (s.ctx_size, s.parallel, s.slots, s.unified) == (None, None, 4, True)
    assert (s.cache_type_k, s.cache_type_v, s.gpu_layers, s.flash_attn, s.fit) == (
        "f16", "f16", None, True, True)


def test_both_flag_forms_and_aliases() -> None:
    s = EngineSettings.parse(["--ctx-size=8192", "-np", "2", "--cache-type-k", "q8_0",
                              "-ctv=q4_0", "--n-gpu-layers", "20", "-nkvo", "--swa-full",
                              "-fa", "off", "-ub", "256", "--fit", "off", "--jinja",
                              "--temp", "0.7"])
    assert (s.ctx_size, s.parallel, s.unified, s.cache_type_k, s.cache_type_v) == (
        8192, 2, False, "q8_0", "q4_0")
    assert (s.gpu_layers, s.kv_offload, s.swa_full, s.flash_attn, s.n_ubatch, s.fit) == (
        20, False, True, False, 256, False)
    assert s.warnings == ()


def test_ctx_size_from_config_and_args_win() -> None:
    assert EngineSettings.parse([], ctx_size=4096).ctx_size == 4096
    assert EngineSettings.parse(["-c", "16384"], ctx_size=4096).ctx_size == 16384


@pytest.mark.parametrize("value", ["all", "auto", "-1"])
def test_gpu_layers_all_and_auto(value: str) -> None:
    assert EngineSettings.parse(["-ngl", value]).gpu_layers is None


def test_moe_and_unified_switches() -> None:
    assert EngineSettings.parse(["--cpu-moe"]).n_cpu_moe == ALL_BLOCKS
    assert EngineSettings.parse(["--n-cpu-moe", "3"]).n_cpu_moe == 3
    assert EngineSettings.parse(["-np", "4", "-kvu"]).unified
    assert not EngineSettings.parse(["-no-kvu"]).unified


def test_nonsense_values_are_warned_about_and_defaults_kept() -> None:
    s = EngineSettings.parse(["-c", "lots", "-ctk", "q3_k", "-fa", "maybe", "-np"])
    assert s.ctx_size is None and s.cache_type_k == "f16" and s.flash_attn
    assert len(s.warnings) == 3 and any("q3_k" in w for w in s.warnings)


# -- devices ------------------------------------------------------------------------------


def test_no_gpu_keeps_everything_in_ram() -> None:
    e = estimate(facts(), EngineSettings.parse(["-c", "4096"]), gpu=False,
                 mmproj_bytes=10 * MIB)
    assert e.vram_bytes == 0 and e.vram_mib == 0
    assert e.weights_ram == 4 * BLOCK + 110 * MIB
    assert e.kv_ram == kv_bytes(4096, 4, 8 * 128)
    assert e.ram_bytes == (e.weights_ram + e.kv_ram + e.compute_ram + e.output_ram
                           + 10 * MIB)


def test_all_layers_offloaded_leaves_token_embeddings_in_ram() -> None:
    e = estimate(facts(), EngineSettings.parse(["-c", "4096"]), gpu=True,
                 mmproj_bytes=10 * MIB)
    assert e.mmproj_on_gpu and e.vram_bytes - e.weights_vram - e.kv_vram - e.compute_vram \
        == 10 * MIB
    kept = estimate(facts(), EngineSettings.parse(["-c", "4096", "--no-mmproj-offload"]),
                    gpu=True, mmproj_bytes=10 * MIB)
    assert not kept.mmproj_on_gpu and kept.ram_bytes == e.ram_bytes + 10 * MIB
    assert e.weights_ram == 50 * MIB                    # token_embd only
    assert e.weights_vram == 4 * BLOCK + 60 * MIB       # blocks + output
    assert e.kv_vram == kv_bytes(4096, 4, 8 * 128) and e.kv_ram == 0
    assert e.compute_vram > 0 and e.compute_ram < e.compute_vram


def test_partial_offload_moves_the_last_blocks_and_the_output_first() -> None:
    f = facts()
    assert f.tensors is not None
    ram, vram = [], []
    for ngl in range(0, 6):
        e = estimate(f, EngineSettings.parse(["-c", "4096", "-ngl", str(ngl)]), gpu=True,
                     mmproj_bytes=0)
        ram.append(e.weights_ram)
        vram.append(e.weights_vram)
        assert e.weights_ram + e.weights_vram == f.tensors.total
    assert vram[0] == 0 and vram[1] == 60 * MIB              # -ngl 1: the output layer
    assert vram[2] == 60 * MIB + BLOCK and vram[5] == 60 * MIB + 4 * BLOCK
    assert ram == sorted(ram, reverse=True) and vram == sorted(vram)
    # the KV cache follows its layer: -ngl 3 puts blocks 2 and 3 on the GPU
    e = estimate(f, EngineSettings.parse(["-c", "4096", "-ngl", "3"]), gpu=True,
                 mmproj_bytes=0)
    assert e.kv_vram == e.kv_ram == kv_bytes(4096, 2, 8 * 128)
    e = estimate(f, EngineSettings.parse(["-c", "4096", "-nkvo"]), gpu=True, mmproj_bytes=0)
    assert e.kv_vram == 0 and e.kv_ram == kv_bytes(4096, 4, 8 * 128)


def test_a_tied_output_is_copied_to_the_gpu() -> None:
    e = estimate(facts(tied=True), EngineSettings(ctx_size=4096), gpu=True, mmproj_bytes=0)
    assert e.weights_ram == 50 * MIB and e.weights_vram == 4 * BLOCK + 50 * MIB


def test_cpu_moe_keeps_expert_weights_in_ram() -> None:
    f = facts(experts=80 * MIB)
    e = estimate(f, EngineSettings.parse(["-c", "4096", "--n-cpu-moe", "2"]), gpu=True,
                 mmproj_bytes=0)
    assert e.weights_ram == 50 * MIB + 2 * 80 * MIB
    e = estimate(f, EngineSettings.parse(["-c", "4096", "--cpu-moe"]), gpu=True,
                 mmproj_bytes=0)
    assert e.weights_vram == 4 * 20 * MIB + 60 * MIB


# -- the KV cache -------------------------------------------------------------------------


def test_q8_0_cache_is_smaller_than_f16() -> None:
    f = facts()
    f16 = estimate(f, EngineSettings(ctx_size=8192), gpu=False, mmproj_bytes=0)
    q8 = estimate(f, EngineSettings(ctx_size=8192, cache_type_k="q8_0", cache_type_v="q8_0"),
                  gpu=False, mmproj_bytes=0)
    q4 = estimate(f, EngineSettings(ctx_size=8192, cache_type_k="q4_0", cache_type_v="q4_0"),
                  gpu=False, mmproj_bytes=0)
    assert q8.kv_ram == kv_bytes(8192, 4, 8 * 128, 34 / 32)
    assert q4.kv_ram < q8.kv_ram < f16.kv_ram


def test_gqa_holds_fewer_kv_heads() -> None:
    mha = estimate(facts(n_head_kv=32), EngineSettings(ctx_size=4096), gpu=False,
                   mmproj_bytes=0)
    gqa = estimate(facts(n_head_kv=8), EngineSettings(ctx_size=4096), gpu=False,
                   mmproj_bytes=0)
    assert mha.kv_ram == 4 * gqa.kv_ram


def test_per_layer_kv_head_arrays_and_explicit_head_sizes() -> None:
    f = facts(n_head_kv=[8, 0, 4, 2], extra={"attention.key_length": 256,
                                            "attention.value_length": 128})
    e = estimate(f, EngineSettings(ctx_size=1024), gpu=False, mmproj_bytes=0)
    assert e.kv_ram == 1024 * 2 * ((8 + 4 + 2) * 256 + (8 + 4 + 2) * 128)


def test_context_is_padded_and_shared_or_split_by_slots() -> None:
    f = facts()
    unified = estimate(f, EngineSettings(ctx_size=1000), gpu=False, mmproj_bytes=0)
    assert unified.ctx_cells == 1024
    # 3 slots of their own: 1024/3 cells each, padded to 512
    split = estimate(f, EngineSettings.parse(["-c", "1000", "-np", "3"]), gpu=False,
                     mmproj_bytes=0)
    assert split.ctx_cells == 3 * 512
    # unset context: the trained one; with fit on and own streams, one per slot
    assert estimate(f, EngineSettings(), gpu=False, mmproj_bytes=0).ctx_cells == 8192
    assert estimate(f, EngineSettings.parse(["-np", "2"]), gpu=False,
                    mmproj_bytes=0).ctx_cells == 2 * 8192
    assert estimate(f, EngineSettings.parse(["-np", "2", "--fit", "off"]), gpu=False,
                    mmproj_bytes=0).ctx_cells == 8192


def test_sliding_window_layers_hold_the_window() -> None:
    f = facts(arch="gemma2", n_layer=4, extra={"attention.sliding_window": 512})
    e = estimate(f, EngineSettings(ctx_size=16384), gpu=False, mmproj_bytes=0)
    window = 512 * 4 + 512          # window x slots (unified) + ubatch
    assert e.kv_ram == kv_bytes(16384, 2, 8 * 128) + kv_bytes(window, 2, 8 * 128)
    full = estimate(f, EngineSettings(ctx_size=16384, swa_full=True), gpu=False,
                    mmproj_bytes=0)
    assert full.kv_ram == kv_bytes(16384, 4, 8 * 128)
    # an explicit pattern in the file wins over the architecture's
    f = facts(arch="gemma2", n_layer=4, extra={"attention.sliding_window": 512,
                                               "attention.sliding_window_pattern":
                                               [True, True, True, False]})
    e = estimate(f, EngineSettings(ctx_size=16384), gpu=False, mmproj_bytes=0)
    assert e.kv_ram == kv_bytes(16384, 1, 8 * 128) + kv_bytes(window, 3, 8 * 128)


def test_compute_grows_with_context_and_without_flash_attention() -> None:
    f = facts()
    small = estimate(f, EngineSettings(ctx_size=4096), gpu=False, mmproj_bytes=0)
    big = estimate(f, EngineSettings(ctx_size=32768), gpu=False, mmproj_bytes=0)
    nofa = estimate(f, EngineSettings(ctx_size=32768, flash_attn=False), gpu=False,
                    mmproj_bytes=0)
    assert small.compute_ram < big.compute_ram < nofa.compute_ram


# -- the seam ------------------------------------------------------------------------------


def test_estimate_for_a_catalog_model() -> None:
    config = ModelConfig(name="m", path=Path("/m.gguf"), args=("-c", "4096"))
    model = Model(id="m", config=config, names=frozenset({"m"}), facts=facts(),
                  size_bytes=facts().file_size)
    e = estimate_for(model, gpu=True)
    assert e is not None and e.ctx_cells == 4096 and e.vram_mib > 400
    described = e.describe()
    assert described["ram_mib"] == e.ram_mib and described["vram_mib"] == e.vram_mib
    assert set(described) == {"ram_mib", "vram_mib", "ctx_cells", "token_embeddings",
                              "output_layer", "ram", "vram", "notes"}
    assert described["token_embeddings"] == 50.0 and described["output_layer"] == 60.0


def test_estimate_for_gives_none_without_a_usable_header() -> None:
    config = ModelConfig(name="m", path=Path("/m.gguf"))
    no_table = facts()
    no_table.tensors = None
    split = facts()
    split.metadata["split.count"] = 3
    for f in (None, no_table, split,
              GgufFacts(path="/m.gguf", file_size=4, error="bad magic")):
        model = Model(id="m", config=config, names=frozenset({"m"}), facts=f)
        assert estimate_for(model, gpu=False) is None


@pytest.mark.parametrize("gpu", [False, True])
def test_lora_adapters_are_counted_beside_the_weights(gpu: bool) -> None:
    settings = EngineSettings.parse([], ctx_size=4096)
    plain = estimate(facts(), settings, gpu=gpu, mmproj_bytes=0)
    with_adapters = estimate(facts(), settings, gpu=gpu, mmproj_bytes=0,
                             adapter_bytes=300 * MIB)
    grown = (with_adapters.vram_bytes - plain.vram_bytes if gpu
             else with_adapters.ram_bytes - plain.ram_bytes)
    assert grown == 300 * MIB
    assert (with_adapters.ram_bytes if gpu else with_adapters.vram_bytes) == \
        (plain.ram_bytes if gpu else plain.vram_bytes)
