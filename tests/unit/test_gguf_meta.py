"""The bounded GGUF header reader touches only the header, even of a huge file."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np

from gatewayd.adapters.gguf_meta import MAX_KVS, read_gguf_facts


def _write(path: Path, build: object) -> Path:
    w = gguf.GGUFWriter(str(path), arch="llama")
    build(w)  # type: ignore[operator]
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_stops_at_the_tokenizer_of_a_big_file(tmp_path: Path) -> None:
    def build(w: gguf.GGUFWriter) -> None:
        w.add_name("Big Vocab")
        w.add_context_length(131072)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
        w.add_uint64("general.parameter_count", 7_000_000_000)
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"token-{i:06d}-with-some-padding" for i in range(150_000)])
        w.add_chat_template("{{ messages }}")
    path = _write(tmp_path / "big.gguf", build)
    facts = read_gguf_facts(path)
    assert facts.error is None
    assert facts.file_size > 4_000_000
    assert facts.bytes_read < 1_000        # the 150k-string array is never touched
    assert facts.name == "Big Vocab" and facts.architecture == "llama"
    assert facts.context_length == 131072 and facts.quantization == "Q4_K_M"
    assert facts.parameter_count == 7_000_000_000
    assert not any(k.startswith("tokenizer.") for k in facts.metadata)


def test_gives_up_on_an_absurd_key_count(tmp_path: Path) -> None:
    path = tmp_path / "absurd.gguf"
    path.write_bytes(struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, 10**9) + b"\0" * 64)
    facts = read_gguf_facts(path)
    assert facts.error is not None and "claims 1000000000" in facts.error
    assert facts.bytes_read == 24


def test_reads_at_most_max_kvs(tmp_path: Path) -> None:
    def build(w: gguf.GGUFWriter) -> None:
        w.add_name("many keys")
        for i in range(MAX_KVS + 100):
            w.add_uint32(f"general.filler_{i:04d}", i)
    facts = read_gguf_facts(_write(tmp_path / "many.gguf", build))
    assert facts.kvs_read == MAX_KVS
    assert facts.name == "many keys"


def test_truncated_file_returns_what_was_read(tmp_path: Path) -> None:
    def build(w: gguf.GGUFWriter) -> None:
        w.add_name("cut short")
        w.add_context_length(4096)
        w.add_string("general.description", "x" * 500)
    full = _write(tmp_path / "full.gguf", build).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[: full.index(b"x" * 500) + 10])
    facts = read_gguf_facts(cut)
    assert facts.error == "file ends inside the header"
    assert facts.name == "cut short" and facts.context_length == 4096


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"ggml" + b"\0" * 100)
    facts = read_gguf_facts(path)
    assert facts.error is not None and "bad magic" in facts.error
    assert facts.metadata == {}


def test_mirrored_constants_match_the_gguf_package() -> None:
    from gatewayd.adapters import gguf_meta

    assert gguf.GGUF_MAGIC == gguf_meta.GGUF_MAGIC
    packing = {t.value: "<" + f for t, f in gguf.GGUFWriter._simple_value_packing.items()}
    assert packing == gguf_meta.VALUE_FORMATS
    assert (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY) == (8, 9)
    assert {t.value: t.name for t in gguf.LlamaFileType
            if t is not gguf.LlamaFileType.GUESSED} == gguf_meta.FILE_TYPES


def test_the_gateway_does_not_import_gguf_or_numpy() -> None:
    import subprocess
    import sys

    code = ("import sys, gatewayd.app, gatewayd.core.catalog, gatewayd.adapters.gguf_meta; "
            "print('gguf' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


# -- the tensor table (read_gguf_facts(tensors=True)) ---------------------------------


def _with_tensors(path: Path, *, vocab: int = 100, tied: bool = False) -> Path:
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("with tensors")
    w.add_block_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"token-{i:06d}" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_chat_template("{{ messages }}")
    w.add_uint32("llama.context_length", 4096)      # a model key after the tokenizer
    w.add_tensor("token_embd.weight", np.zeros((vocab, 32), dtype=np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((32, 32), dtype=np.float16))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.zeros((4, 64, 32), dtype=np.float32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("blk.1.ffn_down.weight",
                 gguf.quants.quantize(np.zeros((32, 64), dtype=np.float32), q8), raw_dtype=q8)
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((vocab, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_the_tensor_table_past_a_big_tokenizer(tmp_path: Path) -> None:
    path = _with_tensors(tmp_path / "t.gguf", vocab=150_000)
    facts = read_gguf_facts(path, tensors=True)
    assert facts.error is None and facts.tensors is not None
    t = facts.tensors
    assert t.token_embd == 150_000 * 32 * 4 and t.n_vocab == 150_000
    experts = 4 * 64 * 32 * 4
    assert t.experts == (experts, experts)
    assert t.blocks == (32 * 32 * 2 + experts, 32 * 32 * 2 + experts + 64 * 34)   # q8_0 rows
    assert t.output == 32 * 4 + 150_000 * 32 * 4 and t.has_output
    assert facts.metadata["llama.context_length"] == 4096      # kept after the tokenizer
    assert not any(k.startswith("tokenizer.") for k in facts.metadata)
    assert facts.bytes_read < 4_000_000                        # the header, not the weights
    # the plain read still stops at the tokenizer and reads no table
    plain = read_gguf_facts(path)
    assert plain.tensors is None and plain.bytes_read < 1_000


def test_a_tied_output_is_told_apart(tmp_path: Path) -> None:
    facts = read_gguf_facts(_with_tensors(tmp_path / "t.gguf", tied=True), tensors=True)
    assert facts.tensors is not None and not facts.tensors.has_output
    assert facts.tensors.output == 32 * 4


def test_a_truncated_tensor_table_keeps_the_metadata(tmp_path: Path) -> None:
    full = _with_tensors(tmp_path / "full.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[: full.index(b"blk.1.ffn_up_exps") + 5])
    facts = read_gguf_facts(cut, tensors=True)
    assert facts.error == "file ends inside the header" and facts.tensors is None
    assert facts.name == "with tensors"


def test_a_tokenizer_array_that_runs_off_the_end(tmp_path: Path) -> None:
    full = _with_tensors(tmp_path / "full.gguf", vocab=5000).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[: full.index(b"token-002500")])
    facts = read_gguf_facts(cut, tensors=True)
    assert facts.error == "file ends inside the header" and facts.tensors is None


def test_the_table_read_is_bounded(tmp_path: Path) -> None:
    path = _with_tensors(tmp_path / "t.gguf", vocab=150_000)
    facts = read_gguf_facts(path, tensors=True, max_bytes=100_000)
    assert facts.error == "header larger than 100000 bytes" and facts.tensors is None
    assert facts.bytes_read <= 100_000


def _hostile_table(path: Path, n_tensors: int, tensor_info: bytes) -> Path:
    def string(s: bytes) -> bytes:
        return struct.pack("<Q", len(s)) + s
    header = struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, n_tensors, 1)
    kv = string(b"general.architecture") + struct.pack("<I", 8) + string(b"llama")
    path.write_bytes(header + kv + tensor_info)
    return path


def test_hostile_tensor_tables(tmp_path: Path) -> None:
    def info(name: bytes, dims: list[int], ggml_type: int, n_dims: int | None = None) -> bytes:
        n = len(dims) if n_dims is None else n_dims
        return (struct.pack("<Q", len(name)) + name + struct.pack("<I", n)
                + b"".join(struct.pack("<Q", d) for d in dims)
                + struct.pack("<IQ", ggml_type, 0))
    cases = {
        "claims 10000000 tensors": (10_000_000, b""),
        "has 9 dimensions": (1, info(b"x", [1] * 9, 0)),
        "unknown ggml type 99": (1, info(b"x", [4], 99)),
        "bad block number": (1, info(b"blk.x.attn_q.weight", [4], 0)),
        "tensor name of": (1, struct.pack("<Q", 10**12)),
        "file ends inside the header": (2, info(b"blk.0.a", [4], 0)),
    }
    for expected, (n, table) in cases.items():
        facts = read_gguf_facts(_hostile_table(tmp_path / "h.gguf", n, table), tensors=True)
        assert facts.error is not None and expected in facts.error, (expected, facts.error)
        assert facts.tensors is None and facts.architecture == "llama"


def test_mirrored_ggml_types_match_the_gguf_package() -> None:
    from gatewayd.core.model_facts import GGML_TYPES
    assert {t.value: (t.name, *gguf.GGML_QUANT_SIZES[t])
            for t in gguf.GGMLQuantizationType} == GGML_TYPES
