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

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

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
