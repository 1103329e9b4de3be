"""Which model a request may go to, by what the model is: its kind and, for a chat
model, what its projector encodes. The headers are real GGUF files written here and
read by the gateway's own reader."""

from __future__ import annotations

from pathlib import Path

import gguf
import make_tiny_model
import pytest

from gatewayd.adapters.model_files import load_catalog
from gatewayd.core.catalog import Catalog
from gatewayd.core.config import Backend, GatewayConfig, ModelConfig, ModelKind
from gatewayd.core.errors import InvalidRequest
from gatewayd.core.routing import choose_model, why_cannot_serve


def _audio_projector(path: Path) -> Path:
    """The header keys of an audio mmproj (no tensors: only the header is read)."""
    w = gguf.GGUFWriter(str(path), arch="clip")
    w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", False)
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.audio.projector_type", "ultravox")
    make_tiny_model.finish(w)
    return path


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Catalog:
    root = tmp_path_factory.mktemp("routing")
    for name in ("chat", "seeing", "hearing", "ranker", "embedder"):
        make_tiny_model.write_model(str(root / f"{name}.gguf"), name=name,
                                    reranker=name == "ranker")
    make_tiny_model.write_mmproj(str(root / "mmproj-seeing.gguf"), "seeing")
    _audio_projector(root / "mmproj-hearing.gguf")
    (root / "whisper.bin").write_bytes(b"lmgg")
    return load_catalog(GatewayConfig(models=(
        ModelConfig(name="chat", path=root / "chat.gguf"),
        ModelConfig(name="seeing", path=root / "seeing.gguf",
                    mmproj=root / "mmproj-seeing.gguf"),
        ModelConfig(name="hearing", path=root / "hearing.gguf",
                    mmproj=root / "mmproj-hearing.gguf"),
        ModelConfig(name="ranker", path=root / "ranker.gguf"),           # from its header
        ModelConfig(name="embedder", path=root / "embedder.gguf", kind=ModelKind.EMBEDDING),
        ModelConfig(name="whisper", path=root / "whisper.bin", backend=Backend.WHISPER))))


def test_capabilities_follow_kind_and_projector(catalog: Catalog) -> None:
    got = {m.id: (m.kind.value, m.capabilities) for m in catalog}
    assert got == {
        "chat": ("chat", ("completion",)),
        "seeing": ("chat", ("completion", "vision")),
        "hearing": ("chat", ("completion", "transcription")),
        "ranker": ("rerank", ("rerank",)),
        "embedder": ("embedding", ("embeddings",)),
        "whisper": ("audio", ("transcription", "translation")),
    }


@pytest.mark.parametrize(("path", "can"), [
    ("/v1/chat/completions", {"chat", "seeing", "hearing"}),
    ("/v1/messages", {"chat", "seeing", "hearing"}),
    ("/v1/audio/transcriptions", {"hearing", "whisper"}),
    ("/v1/audio/translations", {"whisper"}),
    ("/inference", {"whisper"}),
    ("/v1/embeddings", {"embedder"}),
    ("/v1/rerank", {"ranker"}),
    ("/reranking", {"ranker"}),
    ("/tokenize", {"chat", "seeing", "hearing", "ranker", "embedder"}),
])
def test_each_path_goes_only_to_models_that_answer_it(catalog: Catalog, path: str,
                                                      can: set[str]) -> None:
    assert {m.id for m in catalog if why_cannot_serve(m, path) is None} == can
    for model in catalog:
        if model.id not in can:
            with pytest.raises(InvalidRequest) as refused:
                choose_model(path, model.id, catalog=catalog, engines=(), default_model=None)
            assert model.id in refused.value.message and path in refused.value.message
