"""What is done over an engine's socket at the edges of its life.

Before it is ready: its saved KV cache goes back into its parallel slots, and the
hooks run (the front door learns how many it has), together and bounded, so that the
first request finds them done and does not share the engine with them. Before its stop:
its KV cache is saved. Neither ever stops the start or the stop (adapters/kv_cache).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.engine_units import keeps_kv_cache
from gatewayd.core.engines import Engine
from gatewayd.core.ports import KvCacheStore, UnitControl

log = logging.getLogger("gatewayd.engines")

ReadyHook = Callable[[Model, str], Awaitable[object]]


class EngineHooks:
    def __init__(self, catalog: Catalog, units: UnitControl, kv_cache: KvCacheStore | None) -> None:
        self._catalog = catalog
        self._units = units
        self._kv_cache = kv_cache
        self._ready_hooks: list[ReadyHook] = []

    def before_ready(self, hook: ReadyHook) -> Callable[[], None]:
        """hook(model, socket) is awaited when an engine answers /health, before it is
        ready: what the first request must find done (its own deadline; an exception is
        logged, and the engine is ready all the same)."""
        self._ready_hooks.append(hook)
        return lambda: self._ready_hooks.remove(hook)

    async def ready(self, engine: Engine | None) -> None:
        """The engine answered /health: its KV cache restored and the hooks run."""
        model = self._catalog.get(engine.model_id) if engine is not None else None
        if engine is None or model is None:
            return
        work = [hook(model, engine.socket) for hook in self._ready_hooks]
        if self._kv_cache is not None and keeps_kv_cache(model):
            work.append(self._kv_cache.restore(engine.model_id, engine.socket,
                                            self._units.layout(engine.model_id).instance))
        for failed in await asyncio.gather(*work, return_exceptions=True):
            if isinstance(failed, Exception):   # ready all the same, never stuck loading
                log.warning("%s: before it was ready: %s: %s", engine.model_id,
                            type(failed).__name__, failed)

    async def stopping(self, engine: Engine) -> None:
        """The ready engine is about to be stopped: its KV cache saved (bounded:
        kv_cache.SAVE_TIMEOUT_S)."""
        model = self._catalog.get(engine.model_id)
        if self._kv_cache is not None and model is not None and keeps_kv_cache(model):
            await self._kv_cache.save(engine.model_id, engine.socket,
                                   self._units.layout(engine.model_id).instance)

    async def drop_unconfigured_kv_caches(self) -> list[str]:
        """The saved KV caches of models no longer in the catalog, deleted (off the loop):
        nothing would restore them, and kv_cache_max_mb bounds each model's directory
        only when it stops. At the start and after a reload; the instances deleted."""
        if self._kv_cache is None:
            return []
        keep = {self._units.layout(model.id).instance for model in self._catalog}
        return await asyncio.to_thread(self._kv_cache.prune, keep)

    def kv_cache_counts(self) -> Mapping[tuple[str, str], int]:
        """(save|restore|prune, result) -> how many (empty: no KV caches kept)."""
        return self._kv_cache.counts if self._kv_cache is not None else {}
