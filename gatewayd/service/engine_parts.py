"""The engine layer's parts as their users see them: what each part answers, as the
Protocols its users type it by. A user names the part it asks (`engines.lifecycle.start`,
`engines.registry.get`) and the call goes straight to the part that does it:
service/engine_registry, engine_lifecycle, engine_capacity and engine_hooks, built
together by service/engine_manager.

`EngineParts` is the three a user of starts, stops and room asks together. Each user
declares which parts it asks in a Protocol of its own (the dispatcher's in
service/room_line, eviction, loader and dispatcher; restore's; the admin API's), whose
members are these views: the mutators the parts keep for each other are not in them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from gatewayd.core.budget import Need
from gatewayd.core.catalog import Model
from gatewayd.core.engines import Engine
from gatewayd.core.errors import EngineFailed
from gatewayd.core.placement import Placement
from gatewayd.core.ports import EngineUnitInfo, MemoryUse
from gatewayd.core.ram_budget import RamLedger
from gatewayd.service.engine_hooks import ReadyHook
from gatewayd.service.engine_registry import EngineListener


class EngineReads(Protocol):
    """The engines as they are now (engine_registry.EngineRegistry)."""

    @property
    def last_release(self) -> float | None:
        """When an engine last gave up its place (its GPU memory shows as free later)."""

    def engines(self) -> list[Engine]: ...

    def get(self, model_id: str) -> Engine | None: ...

    def versions(self) -> dict[str, int]: ...

    def subscribe(self, listener: EngineListener) -> Callable[[], None]: ...

    def backoff_left(self, model_id: str) -> float: ...

    def failed_error(self, model_id: str, *, retry_after: int | None = None
                     ) -> EngineFailed: ...

    def load_seconds(self, model_id: str) -> float | None: ...


class EngineStarts(Protocol):
    """Starts, stops and what systemd says (engine_lifecycle.EngineLifecycle)."""

    @property
    def stop_reasons(self) -> Mapping[str, str]:
        """Why each engine was last stopped."""

    @property
    def evicted_for(self) -> Mapping[str, str]:
        """The model each engine's last stop, an eviction, made room for."""

    def busy(self, model_id: str) -> bool: ...

    async def start(self, model_id: str, *, wait: bool = True, force: bool = False
                    ) -> Engine: ...

    async def wait_ready(self, model_id: str, timeout: float | None = None) -> Engine: ...

    async def stop(self, model_id: str, *, reason: str = "requested",
                   evicted_for: str | None = None) -> Engine: ...

    async def kill_unresponsive(self, model_id: str, main_pid: int, silent_s: float
                                ) -> None: ...

    async def coming_back(self, model_id: str, main_pid: int) -> bool: ...

    def take_over(self, info: EngineUnitInfo) -> Engine | None: ...

    def observe(self, model_id: str, info: EngineUnitInfo | None) -> None: ...

    async def info(self, unit: str) -> EngineUnitInfo | None: ...


class EngineRoom(Protocol):
    """Memory: what an engine needs, where it goes, what engines hold
    (engine_capacity.EngineCapacity)."""

    def need(self, model: Model) -> Need: ...

    def need_mib(self, model: Model) -> int: ...

    def measured_mib(self, model: Model) -> int | None: ...

    def place(self, model: Model) -> Placement | None: ...

    def ram(self, model: Model | None = None) -> RamLedger | None: ...

    def check_ram_ceiling(self, model: Model) -> None: ...

    def ram_measured(self, model_id: str) -> MemoryUse | None: ...

    def read_ram(self) -> None: ...

    def vram_held(self) -> dict[str, int]: ...

    def has_gpu(self) -> bool: ...

    def forget(self, model_id: str) -> int: ...


class EngineHooksView(Protocol):
    """What runs around readiness and stops, and the KV cache (engine_hooks.EngineHooks)."""

    def before_ready(self, hook: ReadyHook) -> Callable[[], None]: ...

    async def drop_unconfigured_kv_caches(self) -> list[str]: ...

    def kv_cache_counts(self) -> Mapping[tuple[str, str], int]: ...


class EngineParts(Protocol):
    """The engines, their starts and stops, and their room: what eviction, the loaders and
    the admin API ask by name."""

    @property
    def registry(self) -> EngineReads: ...

    @property
    def lifecycle(self) -> EngineStarts: ...

    @property
    def capacity(self) -> EngineRoom: ...
