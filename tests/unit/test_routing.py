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
        ModelConfig(name="whisper", path=root / "whisper.bin", backend=Backend.WHISPER),
        ModelConfig(name="painter", path=None, backend=Backend.OPENAI, kind=ModelKind.IMAGE,
                    command=("/usr/bin/sd-server", "--port", "{port}")),
        ModelConfig(name="talker", path=None, backend=Backend.OPENAI, kind=ModelKind.CHAT,
                    also=(ModelKind.SPEECH,),
                    command=("/usr/bin/omni-server", "--socket", "{socket}")))))


def test_capabilities_follow_kind_and_projector(catalog: Catalog) -> None:
    got = {m.id: (m.kind.value, m.capabilities) for m in catalog}
    assert got == {
        "chat": ("chat", ("completion",)),
        "seeing": ("chat", ("completion", "vision")),
        "hearing": ("chat", ("completion", "transcription")),
        "ranker": ("rerank", ("rerank",)),
        "embedder": ("embedding", ("embeddings",)),
        "whisper": ("audio", ("transcription", "translation")),
        "painter": ("image", ("image",)),
        "talker": ("chat", ("completion", "speech")),
    }


@pytest.mark.parametrize(("path", "can"), [
    ("/v1/chat/completions", {"chat", "seeing", "hearing", "talker"}),
    ("/v1/messages", {"chat", "seeing", "hearing", "talker"}),
    ("/v1/audio/transcriptions", {"hearing", "whisper"}),
    ("/v1/audio/translations", {"whisper"}),
    ("/inference", {"whisper"}),
    ("/v1/embeddings", {"embedder"}),
    ("/v1/rerank", {"ranker"}),
    ("/reranking", {"ranker"}),
    ("/tokenize", {"chat", "seeing", "hearing", "ranker", "embedder"}),
    ("/v1/images/generations", {"painter"}),
    ("/v1/images/edits", {"painter"}),
    ("/v1/images/variations", {"painter"}),
    ("/v1/audio/speech", {"talker"}),
    ("/completion", {"chat", "seeing", "hearing"}),      # llama-server's own: not an openai
    ("/props", {"chat", "seeing", "hearing", "ranker", "embedder"}),   # server's
])
def test_each_path_goes_only_to_models_that_answer_it(catalog: Catalog, path: str,
                                                      can: set[str]) -> None:
    assert {m.id for m in catalog if why_cannot_serve(m, path) is None} == can
    for model in catalog:
        if model.id not in can:
            with pytest.raises(InvalidRequest) as refused:
                choose_model(path, model.id, catalog=catalog, engines=(), default_model=None)
            assert model.id in refused.value.message and path in refused.value.message


@pytest.mark.parametrize(("model", "path", "words"), [
    ("chat", "/v1/images/generations",
     "'chat' is a chat model (llama) and cannot answer /v1/images/generations: that needs "
     "an image server (backend = \"openai\", kind = \"image\")"),
    ("whisper", "/v1/audio/speech",
     "'whisper' is an audio model (whisper) and cannot answer /v1/audio/speech: that needs "
     "a speech server (backend = \"openai\", kind = \"speech\")"),
    ("talker", "/v1/images/edits", "'talker' is a chat/speech model (openai)"),
    ("painter", "/v1/audio/speech", "'painter' is an image model (openai)"),
    ("painter", "/props", "'painter' is an openai model and cannot answer /props: that is "
     "llama-server's own path"),
    ("talker", "/completion", "only on the OpenAI paths under /v1/"),
    ("talker", "/inference", "whisper-server's own path (it needs a whisper model)"),
    ("painter", "/v1/responses/input_tokens",
     "'painter' is an openai model and cannot answer /v1/responses/input_tokens (that needs "
     "a llama model)"),
])
def test_a_refusal_says_what_the_model_is_and_what_it_would_take(
        catalog: Catalog, model: str, path: str, words: str) -> None:
    model_ = catalog.get(model)
    assert model_ is not None
    why = why_cannot_serve(model_, path)
    assert why is not None and words in why, why
