"""Facts about a GGUF model from a bounded read of its header.

gguf's GGUFReader memory-maps the file and parses every key and tensor; the
tokenizer arrays alone hold hundreds of thousands of strings. The catalog
needs a handful of facts, so this reader walks the key/value section and
stops at the first `tokenizer.*` key (the general and architecture keys come
first in files written by llama.cpp's converters), after MAX_KVS keys or
MAX_HEADER_BYTES bytes, and gives up on a file claiming more than MAX_N_KV
keys. A parse error returns what was read so far, with the error.

The constants (magic, value types, file types) are gguf's: importing the
gguf package pulls in numpy and was measured to cost the gateway +75 ms of
start-up and +14.5 MB of idle RSS (40 MB without it), for three small tables.
So the tables are mirrored here, and tests/unit/test_gguf_meta.py checks them
against the installed gguf package, which stays the source of truth.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import IO, Any

MAX_KVS = 300
MAX_N_KV = 200_000
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_STRING = 1024 * 1024

GGUF_MAGIC = 0x46554747  # gguf.GGUF_MAGIC: b"GGUF" little-endian
# gguf.GGUFValueType value -> struct format (STRING = 8 and ARRAY = 9 are read apart)
VALUE_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9
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


class _Bounded:
    """Reads from a file, counting bytes and refusing to pass a limit."""

    def __init__(self, f: IO[bytes], limit: int) -> None:
        self.f, self.limit, self.count = f, limit, 0

    def read(self, n: int) -> bytes:
        if self.count + n > self.limit:
            raise ValueError(f"header larger than {self.limit} bytes")
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("file ends inside the header")
        self.count += n
        return data

    def skip(self, n: int) -> None:
        if self.count + n > self.limit:
            raise ValueError(f"header larger than {self.limit} bytes")
        self.f.seek(n, os.SEEK_CUR)
        self.count += n

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > MAX_STRING:
            raise ValueError(f"string of {n} bytes")
        return self.read(n).decode("utf-8", errors="replace")


def read_gguf_facts(path: str | os.PathLike[str], *, max_kvs: int = MAX_KVS,
                    max_bytes: int = MAX_HEADER_BYTES) -> GgufFacts:
    path = os.fspath(path)
    facts = GgufFacts(path=path, file_size=os.path.getsize(path))
    with open(path, "rb", buffering=64 * 1024) as f:
        r = _Bounded(f, max_bytes)
        try:
            if struct.unpack("<I", r.read(4))[0] != GGUF_MAGIC:
                raise ValueError("not a GGUF file (bad magic)")
            facts.version = r.unpack("<I")
            if facts.version < 2:
                raise ValueError(f"GGUF version {facts.version} is too old (llama.cpp needs 2+)")
            facts.n_tensors = r.unpack("<Q")
            facts.n_kv = r.unpack("<Q")
            if facts.n_kv > MAX_N_KV:
                raise ValueError(f"claims {facts.n_kv} metadata keys (limit {MAX_N_KV})")
            for _ in range(min(facts.n_kv, max_kvs)):
                key = r.string()
                if key.startswith("tokenizer."):
                    break
                facts.metadata[key] = _value(r, r.unpack("<I"))
                facts.kvs_read += 1
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            facts.error = str(e)
        facts.bytes_read = r.count
    return facts


def _value(r: _Bounded, vtype: int) -> Any:
    if vtype in VALUE_FORMATS:
        return r.unpack(VALUE_FORMATS[vtype])
    if vtype == _STRING:
        return r.string()
    if vtype == _ARRAY:
        etype, n = r.unpack("<I"), r.unpack("<Q")
        if etype in VALUE_FORMATS:
            size = struct.calcsize(VALUE_FORMATS[etype])
            if n <= 64:
                return [r.unpack(VALUE_FORMATS[etype]) for _ in range(n)]
            r.skip(n * size)  # big arrays are not facts we need: skip, don't parse
            return f"<array of {n}>"
        if etype == _STRING:
            items = [r.string() for _ in range(n)]
            return items if n <= 64 else f"<array of {n}>"
        raise ValueError(f"unsupported array element type {etype}")
    raise ValueError(f"unknown value type {vtype}")
