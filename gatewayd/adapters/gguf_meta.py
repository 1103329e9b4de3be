"""Facts about a GGUF model from a bounded read of its header.

gguf's GGUFReader memory-maps the file and parses every key and tensor; the
tokenizer arrays alone hold hundreds of thousands of strings. The catalog
needs a handful of facts, so this reader walks the key/value section and
stops at the first `tokenizer.*` key (the general and architecture keys come
first in files written by llama.cpp's converters), after MAX_KVS keys or
MAX_HEADER_BYTES bytes, and gives up on a file claiming more than MAX_N_KV
keys. A parse error returns what was read so far, with the error.

The constants (magic, value types, file types) are gguf's: importing the
gguf package pulls in numpy, which costs the gateway's start-up time and idle
memory out of all proportion to three small tables (docs/benchmarks.md,
"Figures behind choices in the code").
So the tables are mirrored here, and tests/unit/test_gguf_meta.py checks them
against the installed gguf package, which stays the source of truth.
"""

from __future__ import annotations

import os
import struct
from typing import IO, Any

from gatewayd.core.model_facts import FILE_TYPES, GgufFacts

__all__ = ["FILE_TYPES", "GgufFacts", "read_gguf_facts"]

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
