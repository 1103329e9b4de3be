"""`llm-gateway rm MODEL`: a model's files deleted from models_dir, and everything the
gateway kept for it (its KV folder, its learned memory) with them.

Only what the gateway found in models_dir itself is deleted: a model the configuration
names is the configuration's to drop, and a file elsewhere is not the gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from gatewayd.core.engines import EngineState
from gatewayd.core.errors import ModelInUse, ModelNotRemovable
from gatewayd.core.pull import split_of
from gatewayd.service.engine_manager import EngineManager
from gatewayd.service.pulls import Puller

log = logging.getLogger("gatewayd.pull")


@dataclass(frozen=True)
class Removed:
    model: str
    paths: tuple[str, ...]
    freed_bytes: int
    stopped_engine: bool = False
    cancelled_pull: bool = False

    def as_json(self) -> dict[str, object]:
        return {"removed": self.model, "paths": list(self.paths),
                "freed_bytes": self.freed_bytes, "stopped_engine": self.stopped_engine,
                "cancelled_pull": self.cancelled_pull}


async def remove_model(name: str, *, force: bool, engines: EngineManager, puller: Puller,
                       rescan: Callable[[], Awaitable[object]]) -> Removed:
    # a model still being pulled (not in the catalog yet), or whose pull failed: its pull
    # stopped and its bytes deleted
    if await puller.cancel(name) is not None or (
            engines.catalog.find(name) is None and puller.discard_unfinished(name)):
        return Removed(model=name, paths=(), freed_bytes=0, cancelled_pull=True)
    model = engines.catalog.resolve(name)
    config = engines.config
    if any(m.name == model.id for m in config.models):
        raise ModelNotRemovable(
            f"{model.id} is configured as [models.{model.id}] in "
            f"{config.source or 'the configuration'}: remove it there (and its file "
            "yourself), then reload")
    if variants := [v.id for v in engines.catalog.variants
                    if v.config is not None and v.base.id == model.id]:
        raise ModelNotRemovable(
            f"{model.id} is the base of the variant(s) {', '.join(variants)} in "
            f"{config.source or 'the configuration'}: remove them there first (the "
            "configuration would no longer load without it), then reload")
    paths = _owned_paths(model.path, config.models_dir)
    if paths is None:
        raise ModelNotRemovable(f"{model.id}'s file {model.path} is not in models_dir "
                                f"({config.models_dir}): the gateway deletes only its own")
    engine = engines.registry.get(model.id)
    running = engine is not None and engine.state not in (EngineState.STOPPED,
                                                          EngineState.FAILED)
    if (running or model.config.pin) and not force:
        why = (f"its engine is {engine.state.value}" if running and engine is not None
               else "it is pinned")
        raise ModelInUse(f"{model.id} is in use: {why}; stop it first, or remove it with "
                         "--force (which stops its engine)")
    if engine is not None and engine.state is not EngineState.STOPPED:
        await engines.lifecycle.stop(model.id, reason="removed (llm-gateway rm)")
    freed = await asyncio.to_thread(_delete, paths)
    engines.capacity.forget(model.id)
    await rescan()   # the catalog drops it; its KV folder goes with it (not configured)
    log.info("removed %s: %s (%d bytes)", model.id, ", ".join(map(str, paths)), freed)
    return Removed(model=model.id, paths=tuple(map(str, paths)), freed_bytes=freed,
                   stopped_engine=running)


def _owned_paths(path: Path | None, models_dir: Path | None) -> list[Path] | None:
    """What deleting the model means: its folder in models_dir, or its top-level file and
    a split model's other parts; None where it is not the gateway's to delete."""
    if path is None or models_dir is None:
        return None
    root = models_dir.resolve()
    folder = path.parent.resolve()
    if folder.parent == root and folder != root:
        return [path.parent]
    if folder != root:
        return None
    parts = [path]
    if (split := split_of(path.name)) is not None:
        stem, _, count = split
        parts += [p for p in sorted(path.parent.glob("*.gguf")) if p != path
                  and (other := split_of(p.name)) is not None and other[::2] == (stem, count)]
    return parts


def _delete(paths: list[Path]) -> int:
    freed = 0
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            freed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p)
        else:
            with contextlib.suppress(OSError):
                freed += p.stat().st_size
            p.unlink(missing_ok=True)
    return freed
