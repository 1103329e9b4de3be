"""Which model answers a request. Pure: names and engine states in, a model id out.

- `model` given (JSON body, multipart field or ?model=): resolved through the
  catalog's names, a variant's among them (its base's engine answers), or an adopted
  engine's id; unknown → 404 model_not_found with the available models. Whether
  its engine runs is the dispatcher's business (autoload, queue, or 503
  model_not_loaded).
- no `model` on a /v1 path: the one ready engine, else 400 model_required.
- no `model` elsewhere (/props, /metrics, /slots, …): the default engine — the
  configured default_model if it is ready, else the first ready engine.
Only engines that can answer the path count, by the model's capabilities
(catalog.Model.capabilities, which follow its kind): transcriptions go to
whisper models and to chat models whose mmproj encodes audio, translations to
whisper models; embeddings go only to embedding models and rerank only to
rerankers, which answer nothing that generates; generation goes to chat
models; images (generations, edits, variations) go to image models and speech
to speech models, which only an openai-backend server is (one server may be
several kinds). Other llama-server paths (/tokenize, /props, /metrics, ...) go
to any llama model, whisper-server's /inference to a whisper model; an openai
model's server is asked only on the OpenAI paths under /v1/. A model named for a
path its engine cannot serve is a 400 (never relayed to get the engine's
404/501).
"""

from __future__ import annotations

from collections.abc import Sequence

from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import Backend
from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.errors import InvalidRequest, ModelNotFound, ModelRequired, NoEngineReady

TRANSLATION_PATHS = frozenset({"/v1/audio/translations", "/audio/translations"})
WHISPER_PATHS = frozenset({"/v1/audio/transcriptions", "/audio/transcriptions", "/inference",
                           *TRANSLATION_PATHS})
EMBEDDING_PATHS = frozenset({"/v1/embeddings", "/embeddings", "/embedding"})
RERANK_PATHS = frozenset({"/v1/rerank", "/v1/reranking", "/rerank", "/reranking"})
# what only a chat model answers (llama-server with --embeddings or --rerank refuses them)
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions",
                              "/completions", "/completion", "/infill", "/v1/responses",
                              "/v1/messages"})
IMAGE_PATHS = frozenset({"/v1/images/generations", "/v1/images/edits",
                         "/v1/images/variations"})
SPEECH_PATHS = frozenset({"/v1/audio/speech"})
# the capability (catalog.Model.capabilities) a path needs; whisper-server's own
# /inference needs a whisper model; any other path needs a llama model
CAPABILITY_OF_PATH: dict[str, str] = {
    "/v1/audio/transcriptions": "transcription", "/audio/transcriptions": "transcription",
    **dict.fromkeys(TRANSLATION_PATHS, "translation"),
    **dict.fromkeys(EMBEDDING_PATHS, "embeddings"),
    **dict.fromkeys(RERANK_PATHS, "rerank"),
    **dict.fromkeys(GENERATION_PATHS, "completion"),
    **dict.fromkeys(IMAGE_PATHS, "image"),
    **dict.fromkeys(SPEECH_PATHS, "speech")}
# the paths on which an engine runs a model (and so applies LoRA adapters: core/variants)
INFERENCE_PATHS = frozenset(CAPABILITY_OF_PATH)
HOW_TO_MAKE = {"embeddings": "an embedding model (kind = \"embedding\")",
               "rerank": "a reranker (kind = \"rerank\")",
               "completion": "a chat model (kind = \"chat\")",
               "transcription": "a whisper model (backend = \"whisper\") or a chat model "
                                "whose mmproj encodes audio",
               "translation": "a whisper model (backend = \"whisper\")",
               "image": "an image server (backend = \"openai\", kind = \"image\")",
               "speech": "a speech server (backend = \"openai\", kind = \"speech\")"}


def speaks_anthropic(path: str) -> bool:
    """/v1/messages and /v1/messages/count_tokens: their clients are Anthropic SDKs,
    which read Anthropic's error shape and stream events."""
    return path.startswith("/v1/messages")


def why_cannot_serve(model: Model, path: str) -> str | None:
    """Why model's engine cannot answer path (None: it can)."""
    needed = CAPABILITY_OF_PATH.get(path)
    own = Backend.WHISPER if path in WHISPER_PATHS else Backend.LLAMA   # a non-/v1/ path's
    if model.backend is Backend.OPENAI and not path.startswith("/v1/"):
        # an OpenAI-compatible server answers OpenAI's API, not llama-server's or
        # whisper-server's own paths (they would get its 404, or something else's answer)
        return (f"model {model.id!r} is an openai model and cannot answer {path}: that is "
                f"{own.value}-server's own path (it needs a {own.value} model); an openai "
                f"model's server is asked only on the OpenAI paths under /v1/")
    if needed is None:
        if model.backend is own:
            return None
        return (f"model {model.id!r} is {_a(model.backend.value)} model and cannot answer "
                f"{path} (that needs a {own.value} model)")
    if needed in model.capabilities:
        return None
    kinds = "/".join(k.value for k in model.kinds)
    return (f"model {model.id!r} is {_a(kinds)} model ({model.backend.value}) and "
            f"cannot answer {path}: that needs {HOW_TO_MAKE[needed]}; a model's kind is set "
            f"by `kind` in its [models.{model.id}] table, or read from its GGUF header")


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def choose_model(path: str, model: str | None, *, catalog: Catalog,
                 engines: Sequence[Engine], default_model: str | None) -> str:
    """The id of what answers: a model's or a variant's (catalog.served says which), or
    an adopted engine's; the client's error otherwise."""
    if model is not None:
        try:
            found = catalog.served(model)
        except ModelNotFound:
            if any(e.model_id == model for e in engines):  # adopted, no longer configured
                return model
            raise
        if (why := why_cannot_serve(found.model, path)) is not None:
            raise InvalidRequest(why if found.variant is None else
                                 f"{found.id!r} is a variant of {found.model.id!r}: {why}",
                                 param="model")
        return found.id

    def can_answer(engine: Engine) -> bool:
        known = catalog.get(engine.model_id)
        return known is None or why_cannot_serve(known, path) is None
    ready = [e for e in engines if e.state is EngineState.READY and can_answer(e)]
    if path.startswith("/v1/"):
        if len(ready) == 1:
            return ready[0].model_id
        raise ModelRequired(
            "this request needs a \"model\": " + (
                f"{len(ready)} engines are ready" if ready else "no engine is ready"),
            param="model", available_models=[e.model_id for e in ready] or catalog.ids)
    if default_model is not None:
        try:   # (a variant names its base's engine)
            default_id = catalog.served(default_model).model.id
        except ModelNotFound:
            default_id = default_model
        for engine in ready:
            if engine.model_id == default_id:
                return engine.model_id
    if ready:
        return ready[0].model_id
    raise NoEngineReady("no engine is ready to answer this request; start one with "
                        "`llm-gateway start MODEL`", available_models=catalog.ids)
