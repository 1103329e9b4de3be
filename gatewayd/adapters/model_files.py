"""Model files on disk: what models_dir holds, file sizes and GGUF headers.

The core's catalog (gatewayd.core.catalog) validates names and answers
`resolve()`; this adapter does the directory listing and the reads it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from gatewayd.adapters.gguf_meta import read_gguf_facts
from gatewayd.core.catalog import Catalog, Model, ModelFile, build_catalog
from gatewayd.core.config import Backend, GatewayConfig, ModelConfig
from gatewayd.core.errors import ConfigError
from gatewayd.core.model_facts import GgufFacts

if TYPE_CHECKING:
    from gatewayd.core.memory_estimate import MemoryEstimate

FactsReader = Callable[[Path], GgufFacts]


def read_header(path: Path) -> GgufFacts:
    """The header's key/value facts, up to the tokenizer: what the catalog needs."""
    return read_gguf_facts(path)


class TensorTables:
    """Each model's header with its tensor table, read once per file (path, size, mtime)
    when first needed, for the memory estimate (core/memory_estimate.estimate_for places
    each block's weights on a device).

    Not in the catalog's read: reaching the table means skipping the tokenizer arrays
    string by string, ~0.1 s for a 150k-token vocabulary with its merges (0.05 ms for the
    header alone), and the catalog load is what a socket-activated gateway's first answer
    waits for. The gateway reads every table in a thread once it serves (warm); a model
    asked about before that is read on the spot, once."""

    def __init__(self) -> None:
        self._tables: dict[tuple[str, int, int], GgufFacts] = {}

    def facts(self, model: Model) -> GgufFacts | None:
        if model.backend is not Backend.LLAMA or model.path is None:
            return None
        try:
            stat = model.path.stat()
        except OSError:
            return None
        key = (str(model.path), stat.st_size, stat.st_mtime_ns)
        if (facts := self._tables.get(key)) is None:
            facts = self._tables[key] = read_gguf_facts(model.path, tensors=True)
        return facts

    def estimate(self, model: Model, *, gpu: bool) -> MemoryEstimate | None:
        # imported at the first estimate (an engine's start), off the socket-activated
        # start's path (docs/benchmarks.md, "Figures behind choices in the code")
        from gatewayd.core.memory_estimate import estimate_for
        return estimate_for(model, gpu=gpu, facts=self.facts(model))

    def warm(self, models: Iterable[Model]) -> None:
        """Read every model's table (blocking: run it in a thread)."""
        for model in models:
            self.facts(model)


def load_catalog(config: GatewayConfig, read_facts: FactsReader = read_header) -> Catalog:
    """The catalog of config: its [models.NAME] entries plus what models_dir holds."""
    config = with_pulled_files(config)
    explicit_paths = {m.path.resolve() for m in config.models if m.path is not None}
    discovered = [] if config.models_dir is None else [
        m for m in discover(config.models_dir)
        if m.path is not None and m.path.resolve() not in explicit_paths]
    files = {m.path: inspect(m, read_facts) for m in (*config.models, *discovered)
             if m.path is not None}
    return build_catalog(config, discovered, files)


def with_pulled_files(config: GatewayConfig) -> GatewayConfig:
    """A [models.NAME] with a source and no path gets the file pulled for it into
    models_dir/NAME/, once it is there (service/pulls lands it whole, in one rename)."""
    if config.models_dir is None or not any(m.source and m.path is None for m in config.models):
        return config
    models = []
    for m in config.models:
        if m.source and m.path is None:
            found = [d for d in discover_folder(config.models_dir / m.name, m.name) if d.path]
            if found:
                m = replace(m, path=found[0].path, mmproj=found[0].mmproj)
        models.append(m)
    return replace(config, models=tuple(models))


def inspect(model: ModelConfig, read_facts: FactsReader = read_header) -> ModelFile:
    """Sizes of everything the engine loads, and a llama model's GGUF header facts (its
    projector's too)."""
    adapters = sum(_size(a.path) for a in model.adapters)
    size = sum(_size(p) for p in (model.path, model.mmproj) if p) + adapters
    if model.backend is not Backend.LLAMA or model.path is None:
        return ModelFile(size_bytes=size)
    return ModelFile(size_bytes=size, facts=_facts(model.path, read_facts),
                     mmproj_facts=_facts(model.mmproj, read_facts) if model.mmproj else None,
                     adapter_bytes=adapters)


def _facts(path: Path, read_facts: FactsReader) -> GgufFacts | None:
    try:
        return read_facts(path)
    except OSError:
        return None  # a missing file is reported when the engine is started


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def discover(models_dir: Path) -> list[ModelConfig]:
    """Models in a directory: top-level *.gguf files and one model per subdirectory."""
    found: list[ModelConfig] = []
    try:
        entries = sorted(models_dir.iterdir())
    except OSError as e:
        raise ConfigError(f"models_dir {models_dir}: cannot list: {e.strerror}") from e
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.suffix == ".gguf" and not _is_mmproj(entry):
            if _is_later_split_part(entry):
                continue
            found.append(ModelConfig(name=entry.name.removesuffix(".gguf"), path=entry))
        elif entry.is_dir():
            found += discover_folder(entry, entry.name)
    return found


def discover_folder(folder: Path, name: str) -> list[ModelConfig]:
    """A subdirectory of models_dir: one model (its weights, a projector beside them)."""
    try:
        ggufs = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    except OSError:
        return []
    weights = [p for p in ggufs if not _is_mmproj(p) and not _is_later_split_part(p)]
    mmprojs = [p for p in ggufs if _is_mmproj(p)]
    if len(weights) > 1:
        raise ConfigError(
            f"models_dir: {folder} holds several models "
            f"({', '.join(p.name for p in weights)}); a subdirectory is one model "
            "(move the others out, or configure them as [models.NAME])")
    return [ModelConfig(name=name, path=weights[0], mmproj=mmprojs[0] if mmprojs else None)
            ] if weights else []


def _is_mmproj(path: Path) -> bool:
    return path.name.casefold().startswith("mmproj")


def _is_later_split_part(path: Path) -> bool:
    """llama.cpp split files: only -00001-of-000NN.gguf is loaded (it finds the rest)."""
    stem = path.name.removesuffix(".gguf")
    parts = stem.rsplit("-", 3)
    return (len(parts) == 4 and parts[2] == "of" and parts[1].isdigit()
            and parts[3].isdigit() and int(parts[1]) != 1)


