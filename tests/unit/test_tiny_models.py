"""The generated test models are real, deterministic, and tell themselves apart."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import make_tiny_model
import make_tiny_whisper


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_llama_is_deterministic_and_seeded(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    make_tiny_model.write_model(str(a), "same", seed=1)
    make_tiny_model.write_model(str(b), "same", seed=1)
    make_tiny_model.write_model(str(c), "same", seed=2)
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)


def test_tiny_llama_metadata_tokenizer_and_template(tiny_models: dict[str, Path]) -> None:
    names = set()
    for path in tiny_models.values():
        reader = gguf.GGUFReader(path)
        fields = reader.fields
        assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
        names.add(bytes(fields["general.name"].parts[-1]).decode())
        template = bytes(fields["tokenizer.chat_template"].parts[-1]).decode()
        assert "<|im_start|>" in template
        assert len(fields["tokenizer.ggml.tokens"].data) > 600
        assert 300_000 < path.stat().st_size < 2_000_000
    assert names == {"tiny-alpha", "tiny-beta", "tiny-gamma"}


def test_mmproj_is_a_clip_projector(tiny_models: dict[str, Path]) -> None:
    mmproj = tiny_models["alpha"].with_name("mmproj-tiny-alpha.gguf")
    fields = gguf.GGUFReader(mmproj).fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "clip"
    assert bytes(fields["clip.projector_type"].parts[-1]).decode() == "mlp"


def test_tiny_whisper_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    digest_a, n_tensors = make_tiny_whisper.build(str(a), seed=0)
    digest_b, _ = make_tiny_whisper.build(str(b), seed=0)
    assert digest_a == digest_b == _sha(a)
    assert a.read_bytes()[:4] == (0x67676D6C).to_bytes(4, "little")  # ggml magic
    assert n_tensors > 20
    other, _ = make_tiny_whisper.build(str(tmp_path / "c.bin"), seed=1)
    assert other != digest_a


def test_sized_model_is_q8_0_of_its_shape_with_silent_rows_zero(tmp_path: Path) -> None:
    """make_sized_model (the bench's realistic models): every matrix Q8_0 in its preset's
    shape, the vocabulary padded to size, control and byte tokens' output rows zero (so
    they are never sampled), and the same seed the same bytes."""
    import make_sized_model
    shape = make_sized_model.PRESETS["tiny-q8"]
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    make_sized_model.write_model(str(a), "q8", shape, seed=5)
    make_sized_model.write_model(str(b), "q8", shape, seed=5)
    assert _sha(a) == _sha(b)
    reader = gguf.GGUFReader(a)
    tensors = {t.name: t for t in reader.tensors}
    q8 = gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.1.ffn_up.weight"].tensor_type == q8
    assert list(tensors["blk.1.ffn_up.weight"].shape) == [shape.n_embd, shape.n_ff]
    assert list(tensors["token_embd.weight"].shape) == [shape.n_embd, shape.n_vocab]
    assert len(tensors) == 2 + 9 * shape.n_layer + 1
    types = reader.fields["tokenizer.ggml.token_type"]
    kinds = [int(types.parts[i][0]) for i in types.data]
    assert len(kinds) == shape.n_vocab
    out = tensors["output.weight"].data   # rows of Q8_0 blocks, as bytes
    silent = [i for i, k in enumerate(kinds) if k != gguf.TokenType.NORMAL]
    spoken = [i for i, k in enumerate(kinds) if k == gguf.TokenType.NORMAL]
    assert silent and spoken
    assert not out[silent].any()
    assert all(out[i].any() for i in spoken[:50])
