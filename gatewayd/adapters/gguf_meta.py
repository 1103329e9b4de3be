"""Facts about a GGUF model from a bounded read of its header.

gguf's GGUFReader memory-maps the file and parses every key and tensor; the
tokenizer arrays alone hold hundreds of thousands of strings. The catalog
needs a handful of facts, so this reader walks the key/value section and
stops at the first `tokenizer.*` key (the general and architecture keys come
first in files written by llama.cpp's converters), after MAX_KVS keys or
MAX_HEADER_BYTES bytes, and gives up on a file claiming more than MAX_N_KV
keys. A parse error returns what was read so far, with the error.

With tensors=True it goes on to the tensor table (what the memory estimate needs:
gatewayd.core.memory_estimate): every key/value is walked, the tokenizer's
arrays skipped in chunks without being decoded, then each tensor's name, shape
and type are summed into per-block byte counts (TensorSizes). That walk is
bounded too: MAX_TABLE_BYTES of header (a 256k-token vocabulary with its merges
is a few MiB), MAX_N_TENSORS tensors, MAX_DIMS dimensions. A tensor table that
cannot be read leaves tensors None, with the error.

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

from gatewayd.core.model_facts import FILE_TYPES, GGML_TYPES, GgufFacts, TensorSizes, tensor_bytes

__all__ = ["FILE_TYPES", "GgufFacts", "read_gguf_facts"]

MAX_KVS = 300
MAX_N_KV = 200_000
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_STRING = 1024 * 1024
MAX_TABLE_BYTES = 64 * 1024 * 1024   # the whole header, tokenizer arrays included
MAX_N_TENSORS = 100_000
MAX_DIMS = 4                          # GGML_MAX_DIMS
MAX_NAME = 64 * 1024
MAX_INLINE_ARRAY = 1024               # numeric arrays kept as lists: per-layer head counts
_CHUNK = 256 * 1024

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

    def skip_strings(self, n: int) -> None:
        """Skip n length-prefixed strings, reading in chunks: a tokenizer array holds
        hundreds of thousands, and two reads per string would cost most of a second."""
        buf, pos = b"", 0
        for _ in range(n):
            if len(buf) - pos < 8:
                buf, pos = buf[pos:] + self._chunk(), 0
                if len(buf) < 8:
                    raise ValueError("file ends inside the header")
            size = int.from_bytes(buf[pos:pos + 8], "little")
            if size > MAX_STRING:
                raise ValueError(f"string of {size} bytes")
            pos += 8
            if size > len(buf) - pos:
                self.skip(size - (len(buf) - pos))
                buf, pos = b"", 0
            else:
                pos += size
        unread = len(buf) - pos
        if unread:     # give back what was read ahead
            self.f.seek(-unread, os.SEEK_CUR)
            self.count -= unread

    def _chunk(self) -> bytes:
        n = min(_CHUNK, self.limit - self.count)
        if n <= 0:
            raise ValueError(f"header larger than {self.limit} bytes")
        data = self.f.read(n)
        self.count += len(data)
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > MAX_STRING:
            raise ValueError(f"string of {n} bytes")
        return self.read(n).decode("utf-8", errors="replace")


def read_gguf_facts(path: str | os.PathLike[str], *, max_kvs: int = MAX_KVS,
                    max_bytes: int | None = None, tensors: bool = False) -> GgufFacts:
    """The header's facts; tensors: also the tensor table (facts.tensors)."""
    path = os.fspath(path)
    facts = GgufFacts(path=path, file_size=os.path.getsize(path))
    limit = max_bytes if max_bytes is not None else (
        MAX_TABLE_BYTES if tensors else MAX_HEADER_BYTES)
    with open(path, "rb", buffering=64 * 1024) as f:
        r = _Bounded(f, limit)
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
            if tensors:
                _all_kvs(r, facts, max_kvs)
                facts.tensors = _tensor_table(r, facts.n_tensors)
            else:
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


def _all_kvs(r: _Bounded, facts: GgufFacts, max_kvs: int) -> None:
    """Every key/value, to reach the tensor table behind them: tokenizer values and keys
    past max_kvs are skipped, the others kept."""
    assert facts.n_kv is not None
    for _ in range(facts.n_kv):
        key = r.string()
        vtype = r.unpack("<I")
        if key.startswith("tokenizer.") or facts.kvs_read >= max_kvs:
            _skip(r, vtype)
        else:
            facts.metadata[key] = _value(r, vtype)
            facts.kvs_read += 1


def _skip(r: _Bounded, vtype: int) -> None:
    if vtype in VALUE_FORMATS:
        r.skip(struct.calcsize(VALUE_FORMATS[vtype]))
    elif vtype == _STRING:
        size = r.unpack("<Q")
        if size > MAX_STRING:
            raise ValueError(f"string of {size} bytes")
        r.skip(size)
    elif vtype == _ARRAY:
        etype, n = r.unpack("<I"), r.unpack("<Q")
        if etype in VALUE_FORMATS:
            r.skip(n * struct.calcsize(VALUE_FORMATS[etype]))
        elif etype == _STRING:
            r.skip_strings(n)
        else:
            raise ValueError(f"unsupported array element type {etype}")
    else:
        raise ValueError(f"unknown value type {vtype}")


# MoE expert tensors (llama.cpp's LLM_FFN_EXPS_REGEX): what --cpu-moe keeps in RAM
_EXPERT_PARTS = tuple(f".ffn_{p}_{c}exps" for p in ("up", "down", "gate", "gate_up")
                      for c in ("", "ch"))


def _tensor_table(r: _Bounded, n_tensors: int | None) -> TensorSizes:
    if n_tensors is None or n_tensors > MAX_N_TENSORS:
        raise ValueError(f"claims {n_tensors} tensors (limit {MAX_N_TENSORS})")
    blocks: dict[int, int] = {}
    experts: dict[int, int] = {}
    token_embd = output = 0
    has_output = False
    n_vocab: int | None = None
    for _ in range(n_tensors):
        size = r.unpack("<Q")
        if size > MAX_NAME:
            raise ValueError(f"tensor name of {size} bytes")
        name = r.read(size).decode("utf-8", errors="replace")
        n_dims = r.unpack("<I")
        if not 0 < n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [r.unpack("<Q") for _ in range(n_dims)]
        ggml_type = r.unpack("<I")
        r.skip(8)   # offset into the data section
        if ggml_type not in GGML_TYPES:
            raise ValueError(f"tensor {name!r} has unknown ggml type {ggml_type}")
        n_elements = 1
        for d in dims:
            n_elements *= d
        nbytes = tensor_bytes(ggml_type, n_elements)
        if name.startswith("blk."):
            index = name.split(".", 2)[1]
            if not index.isdigit() or int(index) >= MAX_N_TENSORS:
                raise ValueError(f"tensor {name!r}: bad block number")
            blk = int(index)
            blocks[blk] = blocks.get(blk, 0) + nbytes
            if any(part in name for part in _EXPERT_PARTS):
                experts[blk] = experts.get(blk, 0) + nbytes
        elif name.startswith("token_embd."):
            token_embd += nbytes
            if name == "token_embd.weight" and n_dims >= 2:
                n_vocab = dims[1]
        else:
            output += nbytes
            has_output = has_output or name == "output.weight"
    n_blocks = max(blocks) + 1 if blocks else 0
    return TensorSizes(blocks=tuple(blocks.get(i, 0) for i in range(n_blocks)),
                       experts=tuple(experts.get(i, 0) for i in range(n_blocks)),
                       token_embd=token_embd, output=output, has_output=has_output,
                       n_vocab=n_vocab)


def _value(r: _Bounded, vtype: int) -> Any:
    if vtype in VALUE_FORMATS:
        return r.unpack(VALUE_FORMATS[vtype])
    if vtype == _STRING:
        return r.string()
    if vtype == _ARRAY:
        etype, n = r.unpack("<I"), r.unpack("<Q")
        if etype in VALUE_FORMATS:
            size = struct.calcsize(VALUE_FORMATS[etype])
            if n <= MAX_INLINE_ARRAY:
                return [r.unpack(VALUE_FORMATS[etype]) for _ in range(n)]
            r.skip(n * size)  # big arrays are not facts we need: skip, don't parse
            return f"<array of {n}>"
        if etype == _STRING:
            items = [r.string() for _ in range(n)]
            return items if n <= 64 else f"<array of {n}>"
        raise ValueError(f"unsupported array element type {etype}")
    raise ValueError(f"unknown value type {vtype}")
