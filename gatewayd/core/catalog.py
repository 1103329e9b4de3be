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

Besides the models (each with an engine of its own), a name may mean a variant:
another name for a model's engine with its own request defaults and limits, or one of
its LoRA adapters (`BASE:ADAPTER`), core/variants. `served` resolves both kinds of
name; `resolve` and `find` only the models (what has an engine to start or stop).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from gatewayd.core.config import Backend, GatewayConfig, ModelConfig, ModelKind
from gatewayd.core.errors import ConfigError, ModelNotFound
from gatewayd.core.model_facts import GgufFacts
from gatewayd.core.variants import (
    NO_CHANGE,
    SEPARATOR,
    Applied,
    Shape,
    VariantConfig,
    check_defaults,
)

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
    size_bytes: int = 0             # bytes on disk of everything it loads (model, mmproj,
                                    # adapters)
    mmproj_facts: GgufFacts | None = None   # the projector's header: which media it encodes
    adapter_bytes: int = 0          # of size_bytes: its LoRA adapters' files

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
            "adapters": [a.name for a in self.config.adapters],
        }


@dataclass(frozen=True)
class Variant:
    """Another name for a model's engine (core/variants): a configured variant (config),
    or one of the model's LoRA adapters by its own name, BASE:ADAPTER (config None)."""
    id: str
    base: Model
    names: frozenset[str]
    shape: Shape
    adapter: str | None = None
    config: VariantConfig | None = None

    def describe(self) -> dict[str, object]:
        config = self.config
        return {"id": self.id, "variant_of": self.base.id, "adapter": self.adapter,
                "aliases": sorted(self.names),
                "defaults": dict(config.defaults) if config is not None else {},
                "system_prompt": config.system_prompt if config is not None else None,
                "limits": {"max_tokens": config.max_tokens}
                if config is not None and config.max_tokens is not None else {}}


@dataclass(frozen=True)
class Served:
    """What a request's name means: its name as recorded (id), the names a key is checked
    against, the model whose engine answers, what its body gets, and its class."""
    id: str
    names: frozenset[str]
    model: Model
    shape: Shape
    priority: int
    variant: Variant | None = None

    @classmethod
    def of_model(cls, model: Model) -> Served:
        return cls(model.id, model.names, model, NO_CHANGE, model.config.priority)

    @classmethod
    def of_variant(cls, variant: Variant) -> Served:
        config = variant.config
        priority = config.priority if config is not None and config.priority is not None \
            else variant.base.config.priority
        return cls(variant.id, variant.names, variant.base, variant.shape, priority, variant)


def named_for_engine(model: Model, payload: dict[str, Any]) -> bool:
    """payload's `model` made the name model's engine knows it by, where that matters;
    whether it changed. An openai server was told the model's id (its command's {model})
    and a strict one (vLLM) refuses any other name: an alias's or a variant's request is
    sent with the id. llama-server answers any name."""
    if model.backend is not Backend.OPENAI or not isinstance(payload.get("model"), str) \
            or payload["model"] == model.id:
        return False
    payload["model"] = model.id
    return True


def health_of(catalog: Catalog, model_id: str) -> tuple[str, int]:
    """How to tell model_id's engine is ready (an engine adopted for a model no longer
    configured: llama-server's way)."""
    model = catalog.get(model_id)
    return model.health if model is not None else (HEALTH_PATH, 200)


class Catalog:
    def __init__(self, models: Iterable[Model], ambiguous: dict[str, tuple[str, ...]],
                 variants: Iterable[Variant] = ()) -> None:
        self._models = {m.id: m for m in models}
        self._index = {name: m.id for m in self._models.values() for name in m.names}
        self._ambiguous = ambiguous
        self._variants = {v.id: v for v in variants}
        self._variant_index = {name: v.id for v in self._variants.values() for name in v.names}
        # what each name means, made once: the request path asks for it several times
        self._served = {**{m.id: Served.of_model(m) for m in self._models.values()},
                        **{v.id: Served.of_variant(v) for v in self._variants.values()}}

    def replace(self, other: Catalog) -> None:
        """Become other, in place: everyone holding this catalog sees the new models
        (a configuration reload)."""
        self._models, self._index, self._ambiguous = (
            other._models, other._index, other._ambiguous)
        self._variants, self._variant_index, self._served = (
            other._variants, other._variant_index, other._served)

    @property
    def variants(self) -> list[Variant]:
        return list(self._variants.values())

    def served_ids(self) -> list[str]:
        """Every name a client may send as it is recorded: models, then variants."""
        return [*self._models, *self._variants]

    def engine_names(self, model_id: str) -> tuple[str, ...]:
        """Every name a client may send that model_id's engine answers: its id and names,
        its variants' and adapters' (ids as configured, other names casefolded)."""
        model = self._models.get(model_id)
        if model is None:
            return (model_id,)
        names = {model.id, *model.names}
        for v in self._variants.values():
            if v.base.id == model_id:
                names |= {v.id, *v.names}
        return tuple(sorted(names))

    def find_served(self, name: str) -> Served | None:
        """What a name means, a model or a variant, or None."""
        key = name.strip().casefold()
        served_id = self._index.get(key) or self._variant_index.get(key)
        return None if served_id is None else self._served[served_id]

    def served(self, name: str) -> Served:
        """What a client's name means; ModelNotFound (as resolve's) otherwise."""
        found = self.find_served(name)
        if found is not None:
            return found
        self.resolve(name)   # raises: ambiguous, or does not exist
        raise AssertionError("unreachable")

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
        if (variant_id := self._variant_index.get(key)) is not None:
            base = self._variants[variant_id].base.id
            raise ModelNotFound(f"model {name!r} is a variant of {base!r}: it has no engine "
                                f"of its own (it runs on {base!r}'s); name {base!r}",
                                param="model", available_models=self.ids)
        raise ModelNotFound(f"model {name!r} does not exist", param="model",
                            available_models=self.served_ids())


@dataclass(frozen=True)
class ModelFile:
    """What the disk says about one model: sizes and (llama models) the GGUF header."""

    size_bytes: int
    facts: GgufFacts | None = None
    mmproj_facts: GgufFacts | None = None
    adapter_bytes: int = 0


def build_catalog(config: GatewayConfig, discovered: Sequence[ModelConfig],
                  files: Mapping[Path, ModelFile]) -> Catalog:
    """Validate names and attach each model's file facts.

    discovered: the models found in models_dir (adapters.model_files.discover),
    already without those an explicit [models.NAME] entry names; files: the
    facts of every model's path (missing entries: size 0, no facts).
    """
    def adapter_file(m: ModelConfig) -> bool:
        found = files.get(m.path) if m.path is not None else None
        return m.backend is Backend.LLAMA and found is not None and found.facts is not None \
            and found.facts.is_adapter
    where = str(config.source) if config.source else "config"
    for m in config.models:
        if adapter_file(m):
            raise ConfigError(f"{where}: [models.{m.name}] path {m.path} is a LoRA adapter, "
                              "not a model: name it in its base model's adapters "
                              "(docs/variants.md)")
    # a LoRA adapter in models_dir (pulled there, or put beside its base) is no model
    configured = [*config.models, *(m for m in discovered if not adapter_file(m))]

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
                            mmproj_facts=found.mmproj_facts if found else None,
                            adapter_bytes=found.adapter_bytes if found else 0))
    variants = _variants(config, models, strong_owner)
    taken = {name for v in variants for name in v.names}
    for name in taken & set(ambiguous):   # a variant's name is strong: it wins
        del ambiguous[name]
    models = [replace(m, names=m.names - taken) if m.names & taken else m for m in models]
    variants = [replace(v, base=next(m for m in models if m.id == v.base.id))
                for v in variants]
    return Catalog(models, ambiguous, variants)


def _variants(config: GatewayConfig, models: Sequence[Model],
              strong_owner: dict[str, str]) -> list[Variant]:
    """Each model's adapters by their own names, and the configured variants, checked:
    a variant of a model that exists (not of a variant: no chains), an adapter its base
    has, defaults its base's requests take, names no model or variant claims."""
    where = str(config.source) if config.source else "config"
    by_id = {m.id: m for m in models}
    # name -> who claims it: ("model", id) for the models' strong names, then variants
    owner = {name: ("model", model_id) for name, model_id in strong_owner.items()}
    out: list[Variant] = []

    def claim(variant_id: str, names: Iterable[str]) -> frozenset[str]:
        folded = {n.casefold() for n in names if n.strip()}
        for name in folded:
            kind, other = owner.setdefault(name, ("variant", variant_id))
            if (kind, other) != ("variant", variant_id):
                raise ConfigError(f"{where}: {kind} {other!r} and variant {variant_id!r} "
                                  f"both claim the name {name!r}; change an alias or a name")
        return frozenset(folded)

    for model in models:
        for adapter in model.config.adapters:
            variant_id = f"{model.id}{SEPARATOR}{adapter.name}"
            out.append(Variant(
                id=variant_id, base=model, adapter=adapter.name,
                names=claim(variant_id, (variant_id, *adapter.aliases)),
                shape=Shape(adapter=Applied(adapter.name, adapter.scale))))
    adapter_ids = {v.id.casefold(): v for v in out}
    for vc in config.variants:
        key = f"models.{vc.name}.variant_of"
        named = vc.variant_of.casefold()
        if named in adapter_ids or any(named == other.name.casefold()
                                       for other in config.variants):
            base_of = adapter_ids[named].base.id if named in adapter_ids else next(
                o.variant_of for o in config.variants if o.name.casefold() == named)
            raise ConfigError(
                f"{where}: {key} = {vc.variant_of!r} is itself a variant (of {base_of!r}): "
                f"a variant names a model with an engine of its own; say variant_of = "
                f"{base_of!r}" + (f" and adapter = {adapter_ids[named].adapter!r}"
                                  if named in adapter_ids else " with the defaults it needs"))
        base_id = strong_owner.get(named)
        if base_id is None:
            raise ConfigError(f"{where}: {key} = {vc.variant_of!r}: no model is called "
                              f"that; the models: {', '.join(sorted(by_id)) or 'none'}")
        base = by_id[base_id]
        adapters = base.config.adapters
        applied = None
        if vc.adapter is not None:
            found = [a for a in adapters if a.name.casefold() == vc.adapter.casefold()]
            if not found:
                has = f"the adapters {', '.join(a.name for a in adapters)}" if adapters \
                    else "no adapters"
                raise ConfigError(f"{where}: models.{vc.name}.adapter = {vc.adapter!r}: "
                                  f"{base_id!r} has {has}")
            applied = Applied(found[0].name, found[0].scale)
        check_defaults(vc, base.kinds, where)
        out.append(Variant(
            id=vc.name, base=base, adapter=applied.name if applied else None, config=vc,
            names=claim(vc.name, (vc.name, *vc.aliases)),
            shape=Shape(defaults=vc.defaults, system_prompt=vc.system_prompt,
                        max_tokens=vc.max_tokens, adapter=applied)))
    return out


def _strip_ext(name: str) -> str:
    for ext in (".gguf", ".bin"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name
