"""Which models exist, what they are called, and what they are.

Models come from `[models.NAME]` tables and from `models_dir` (each top-level
`*.gguf` is a model; each subdirectory is one model, with an `mmproj*.gguf`
inside attached). Each model answers to several names, compared
case-insensitively:

- strong names: its id, its file name, the file name without `.gguf`/`.bin`,
  the subdirectory name, and configured aliases. Two models claiming one
  strong name is a configuration error that names both.
- a weak name: `general.name` from the GGUF header. Two quantisations of one
  model commonly share it, so a clash makes that name ambiguous (resolving it
  says which models it could mean) instead of refusing to start.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from gatewayd.core.config import Backend, GatewayConfig, ModelConfig, ModelKind
from gatewayd.core.errors import ConfigError, ModelNotFound
from gatewayd.core.model_facts import GgufFacts

RANK_POOLING = 4   # LLAMA_POOLING_TYPE_RANK
CAPABILITIES: Mapping[ModelKind, tuple[str, ...]] = {
    ModelKind.CHAT: ("completion",), ModelKind.EMBEDDING: ("embeddings",),
    ModelKind.RERANK: ("rerank",), ModelKind.AUDIO: ("transcription", "translation"),
    ModelKind.IMAGE: ("image",), ModelKind.SPEECH: ("speech",)}
HEALTH_PATH = "/health"   # llama-server's and whisper-server's readiness


@dataclass(frozen=True)
class Model:
    """One servable model: its configuration, the names it answers to, its header facts."""
    id: str
    config: ModelConfig
    names: frozenset[str]           # casefolded names that resolve to this model
    facts: GgufFacts | None = None
    size_bytes: int = 0             # bytes on disk of everything it loads (model + mmproj)
    mmproj_facts: GgufFacts | None = None   # the projector's header: which media it encodes

    @property
    def path(self) -> Path | None:
        return self.config.path

    @property
    def backend(self) -> Backend:
        return self.config.backend

    @cached_property   # asked on every request's routing; config and header never change
    def kind(self) -> ModelKind:
        """The configured kind, else what the header says: a pooling type is written only
        into embedding models (rank: rerankers); whisper models are audio."""
        if self.config.kind is not None:
            return self.config.kind
        if self.backend is Backend.WHISPER:
            return ModelKind.AUDIO
        pooling = self.facts.pooling_type if self.facts else None
        if pooling == RANK_POOLING:
            return ModelKind.RERANK
        if pooling is not None and pooling > 0:
            return ModelKind.EMBEDDING
        return ModelKind.CHAT

    @property
    def kinds(self) -> tuple[ModelKind, ...]:
        """Its kind, and an openai server's further ones."""
        return (self.kind, *self.config.also)

    @property
    def health(self) -> tuple[str, int]:
        """How to tell its engine is ready: the status GET path answers when it is (and
        any answer at all while it runs means it is alive)."""
        if self.backend is Backend.OPENAI:
            return self.config.ready_path, self.config.ready_status
        return HEALTH_PATH, 200

    @cached_property
    def capabilities(self) -> tuple[str, ...]:
        """What its engine answers (as /v1/models lists it). A chat model's projector adds
        what it encodes: images ("vision"), sound ("transcription": llama-server answers
        /v1/audio/transcriptions with such a model)."""
        own = tuple(dict.fromkeys(c for kind in self.kinds for c in CAPABILITIES[kind]))
        projector = self.mmproj_facts
        if self.kind is not ModelKind.CHAT or projector is None:
            return own
        return (*own, *(["vision"] if projector.has_vision_encoder else []),
                *(["transcription"] if projector.has_audio_encoder else []))

    def describe(self) -> dict[str, object]:
        facts = self.facts
        return {
            "id": self.id,
            "backend": self.backend.value,
            "kind": self.kind.value,
            "capabilities": list(self.capabilities),
            "path": None if self.path is None else str(self.path),
            "mmproj": str(self.config.mmproj) if self.config.mmproj else None,
            "size_bytes": self.size_bytes,
            "architecture": facts.architecture if facts else None,
            "general_name": facts.name if facts else None,
            "context_length": self.config.ctx_size or (facts.context_length if facts else None),
            "quantization": facts.quantization if facts else None,
            "parameter_count": facts.parameter_count if facts else None,
            "header_error": facts.error if facts else None,
            "aliases": sorted(self.names),
            "source": self.config.source,
            "downloaded": self.config.downloaded,
        }


def health_of(catalog: Catalog, model_id: str) -> tuple[str, int]:
    """How to tell model_id's engine is ready (an engine adopted for a model no longer
    configured: llama-server's way)."""
    model = catalog.get(model_id)
    return model.health if model is not None else (HEALTH_PATH, 200)


class Catalog:
    def __init__(self, models: Iterable[Model], ambiguous: dict[str, tuple[str, ...]]) -> None:
        self._models = {m.id: m for m in models}
        self._index = {name: m.id for m in self._models.values() for name in m.names}
        self._ambiguous = ambiguous

    def replace(self, other: Catalog) -> None:
        """Become other, in place: everyone holding this catalog sees the new models
        (a configuration reload)."""
        self._models, self._index, self._ambiguous = (
            other._models, other._index, other._ambiguous)

    def __iter__(self) -> Iterator[Model]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._models

    def get(self, model_id: str) -> Model | None:
        return self._models.get(model_id)

    @property
    def ids(self) -> list[str]:
        return list(self._models)

    def find(self, name: str) -> Model | None:
        """The model a name means, or None (no error: for names from elsewhere)."""
        model_id = self._index.get(name.strip().casefold())
        return None if model_id is None else self._models[model_id]

    def resolve(self, name: str) -> Model:
        """The model a client's name means; ModelNotFound says what exists."""
        key = name.strip().casefold()
        model_id = self._index.get(key)
        if model_id is not None:
            return self._models[model_id]
        if key in self._ambiguous:
            raise ModelNotFound(
                f"model {name!r} is ambiguous: it is the GGUF name of "
                f"{', '.join(self._ambiguous[key])}; use one of their ids",
                param="model", available_models=self.ids)
        raise ModelNotFound(f"model {name!r} does not exist", param="model",
                            available_models=self.ids)


@dataclass(frozen=True)
class ModelFile:
    """What the disk says about one model: sizes and (llama models) the GGUF header."""

    size_bytes: int
    facts: GgufFacts | None = None
    mmproj_facts: GgufFacts | None = None


def build_catalog(config: GatewayConfig, discovered: Sequence[ModelConfig],
                  files: Mapping[Path, ModelFile]) -> Catalog:
    """Validate names and attach each model's file facts.

    discovered: the models found in models_dir (adapters.model_files.discover),
    already without those an explicit [models.NAME] entry names; files: the
    facts of every model's path (missing entries: size 0, no facts).
    """
    configured = [*config.models, *discovered]

    ids: dict[str, ModelConfig] = {}
    for m in configured:
        if m.name in ids:
            raise ConfigError(f"two models are called {m.name!r}: {ids[m.name].path} and "
                              f"{m.path}; rename one (or give it a [models.NAME] entry)")
        ids[m.name] = m

    strong_owner: dict[str, str] = {}
    facts: dict[str, GgufFacts | None] = {}
    strong: dict[str, set[str]] = {}
    for model_id, m in ids.items():
        names = {model_id, *m.aliases}
        if m.path is not None:
            names |= {m.path.name, _strip_ext(m.path.name)}
        if m.path is not None and config.models_dir and m.path.parent.parent == config.models_dir:
            names.add(m.path.parent.name)   # a model that is a subdirectory of models_dir
        strong[model_id] = {n.casefold() for n in names if n.strip()}
        for name in strong[model_id]:
            other = strong_owner.setdefault(name, model_id)
            if other != model_id:
                raise ConfigError(
                    f"models {other!r} ({ids[other].path}) and {model_id!r} ({m.path}) both "
                    f"claim the name {name!r}; change an alias or a file name")
        found = files.get(m.path) if m.path is not None else None
        facts[model_id] = found.facts if found and m.backend is Backend.LLAMA else None

    weak_claims: dict[str, list[str]] = {}
    for model_id, f in facts.items():
        if f is not None and f.name and f.name.casefold() not in strong_owner:
            weak_claims.setdefault(f.name.casefold(), []).append(model_id)
    ambiguous = {n: tuple(owners) for n, owners in weak_claims.items() if len(owners) > 1}
    models = []
    for model_id, m in ids.items():
        names = set(strong[model_id])
        names |= {n for n, owners in weak_claims.items() if owners == [model_id]}
        found = files.get(m.path) if m.path is not None else None
        models.append(Model(id=model_id, config=m, names=frozenset(names),
                            facts=facts[model_id], size_bytes=found.size_bytes if found else 0,
                            mmproj_facts=found.mmproj_facts if found else None))
    return Catalog(models, ambiguous)


def _strip_ext(name: str) -> str:
    for ext in (".gguf", ".bin"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name
