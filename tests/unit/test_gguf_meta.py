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
