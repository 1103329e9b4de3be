"""Facts about a GGUF model from a bounded read of its header.

gguf's GGUFReader memory-maps the file and parses every key and tensor; the
tokenizer arrays alone hold hundreds of thousands of strings. The catalog
needs a handful of facts, so this reader walks the key/value section and
stops at the first `tokenizer.*` key (the general and architecture keys come
first in files written by llama.cpp's converters), after MAX_KVS keys or
MAX_HEADER_BYTES bytes, and gives up on a file claiming more than MAX_N_KV
keys. A parse error returns what was read so far, with the error.

The gguf package supplies the constants (magic, value types, file types). It
imports numpy and costs ~130 ms, so it is imported here lazily, on the first
model read (catalog load), never on the request path.
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

_SCALARS = {  # GGUFValueType value -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9


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
        from gguf.constants import LlamaFileType
        try:
            name = LlamaFileType(value).name
        except ValueError:
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
    from gguf.constants import GGUF_MAGIC

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
    if vtype in _SCALARS:
        return r.unpack(_SCALARS[vtype])
    if vtype == _STRING:
        return r.string()
    if vtype == _ARRAY:
        etype, n = r.unpack("<I"), r.unpack("<Q")
        if etype in _SCALARS:
            size = struct.calcsize(_SCALARS[etype])
            if n <= 64:
                return [r.unpack(_SCALARS[etype]) for _ in range(n)]
            r.skip(n * size)  # big arrays are not facts we need: skip, don't parse
            return f"<array of {n}>"
        if etype == _STRING:
            items = [r.string() for _ in range(n)]
            return items if n <= 64 else f"<array of {n}>"
        raise ValueError(f"unsupported array element type {etype}")
    raise ValueError(f"unknown value type {vtype}")
