"""What a model file's header says, as data. Pure: the bounded reader that fills it
is an adapter (gatewayd.adapters.gguf_meta)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# gguf.LlamaFileType value -> name (general.file_type)
FILE_TYPES = {
    0: "ALL_F32", 1: "MOSTLY_F16", 2: "MOSTLY_Q4_0", 3: "MOSTLY_Q4_1", 7: "MOSTLY_Q8_0",
    8: "MOSTLY_Q5_0", 9: "MOSTLY_Q5_1", 10: "MOSTLY_Q2_K", 11: "MOSTLY_Q3_K_S",
    12: "MOSTLY_Q3_K_M", 13: "MOSTLY_Q3_K_L", 14: "MOSTLY_Q4_K_S", 15: "MOSTLY_Q4_K_M",
    16: "MOSTLY_Q5_K_S", 17: "MOSTLY_Q5_K_M", 18: "MOSTLY_Q6_K", 19: "MOSTLY_IQ2_XXS",
    20: "MOSTLY_IQ2_XS", 21: "MOSTLY_Q2_K_S", 22: "MOSTLY_IQ3_XS", 23: "MOSTLY_IQ3_XXS",
    24: "MOSTLY_IQ1_S", 25: "MOSTLY_IQ4_NL", 26: "MOSTLY_IQ3_S", 27: "MOSTLY_IQ3_M",
    28: "MOSTLY_IQ2_S", 29: "MOSTLY_IQ2_M", 30: "MOSTLY_IQ4_XS", 31: "MOSTLY_IQ1_M",
    32: "MOSTLY_BF16", 36: "MOSTLY_TQ1_0", 37: "MOSTLY_TQ2_0", 38: "MOSTLY_MXFP4_MOE",
    39: "MOSTLY_NVFP4", 40: "MOSTLY_Q1_0",
}

# gguf.GGMLQuantizationType value -> (name, elements per block, bytes per block)
# (gguf.GGML_QUANT_SIZES): what a tensor of that type holds per element
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}


def tensor_bytes(ggml_type: int, n_elements: int) -> int:
    """Bytes a tensor of n_elements of ggml_type takes (ggml_row_size); KeyError for a type
    this table does not know."""
    _, block, size = GGML_TYPES[ggml_type]
    return -(-n_elements // block) * size


@dataclass(frozen=True)
class TensorSizes:
    """Where a model's weight bytes are, from the GGUF tensor table, grouped the way
    llama.cpp places them on devices: per repeating block (blk.N.*), the token embeddings
    (always kept in RAM) and the output layer (offloaded first)."""
    blocks: tuple[int, ...]            # bytes of blk.N.* by N
    experts: tuple[int, ...]           # of which MoE expert tensors (ffn_*_exps), by N
    token_embd: int                    # token_embd.*
    output: int                        # output.weight, output_norm.* and other non-block tensors
    has_output: bool                   # False: tied to token_embd, which llama.cpp copies
    n_vocab: int | None = None         # from token_embd's shape

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.token_embd + self.output


@dataclass
class GgufFacts:
    """What a GGUF file's header says about the model (read without loading it)."""
    path: str
    file_size: int
    version: int | None = None
    n_tensors: int | None = None
    n_kv: int | None = None
    kvs_read: int = 0
    bytes_read: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    tensors: TensorSizes | None = None   # read only when asked for (read_gguf_facts(tensors=))

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    @property
    def is_adapter(self) -> bool:
        """A LoRA adapter (general.type = "adapter"), loaded into a model, not one itself."""
        return self.metadata.get("general.type") == "adapter"

    @property
    def name(self) -> str | None:
        name = self.metadata.get("general.name")
        return name if isinstance(name, str) and name.strip() else None

    @property
    def context_length(self) -> int | None:
        value = self.metadata.get(f"{self.architecture}.context_length")
        return value if isinstance(value, int) else None

    @property
    def pooling_type(self) -> int | None:
        """llama.cpp's pooling for embeddings (1 mean, 2 cls, 3 last, 4 rank), written only
        into embedding and reranker models."""
        value = self.metadata.get(f"{self.architecture}.pooling_type")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def has_vision_encoder(self) -> bool:
        """A projector (mmproj) that encodes images."""
        return self.metadata.get("clip.has_vision_encoder") is True

    @property
    def has_audio_encoder(self) -> bool:
        """A projector (mmproj) that encodes sound."""
        return self.metadata.get("clip.has_audio_encoder") is True

    @property
    def parameter_count(self) -> int | None:
        value = self.metadata.get("general.parameter_count")
        return value if isinstance(value, int) else None

    @property
    def quantization(self) -> str | None:
        """llama.cpp's file type name, e.g. "Q4_K_M" (from general.file_type)."""
        value = self.metadata.get("general.file_type")
        if not isinstance(value, int):
            return None
        name = FILE_TYPES.get(value)
        if name is None:
            return f"type {value}"
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
