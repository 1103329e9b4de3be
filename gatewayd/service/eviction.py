"""Evicting: stopping a victim for a waiting model, and waiting until its memory shows as
free; and evicting the surplus where more engines run than max_engines (the reconciler
found them).

A victim is stopped through the engine layer's lifecycle.stop, which serialises it with any
start of the same model: a victim's own loader can start it again only once its unit is
gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from gatewayd.core import scheduler
from gatewayd.core.budget import model_need_mib
from gatewayd.core.catalog import Catalog
from gatewayd.core.config import GatewayConfig
from gatewayd.core.errors import EngineNotRunning, GatewayError
from gatewayd.core.placement import total
from gatewayd.core.ports import GpuProbe
from gatewayd.service.engine_parts import EngineParts
from gatewayd.service.turns import Turns
from gatewayd.service.wake_up import WakeUp

log = logging.getLogger("gatewayd.dispatcher")
MEMORY_SETTLE_S = 10.0   # how long a stopped engine's GPU memory may take to show as free
MEMORY_POLL_S = 0.1


class EvictedEngines(EngineParts, Protocol):
    """What eviction asks of the engines (service/engine_manager has it): when an engine
    last let go of its place (registry), what one holds (capacity), and a stop
    (lifecycle)."""

class Evictor:
    def __init__(self, engines: EvictedEngines, *, catalog: Catalog, gpu: GpuProbe,
                 config: GatewayConfig, turns: Turns,
                 usages: Callable[[], list[scheduler.Usage]], wake_up: WakeUp,
                 clock: Callable[[], float]) -> None:
        self._engines = engines
        self._catalog = catalog
        self._gpu = gpu
        self._config = config
        self._turns = turns
        self._usages = usages
        self._wake_up = wake_up
        self._clock = clock
        self._limit_task: asyncio.Task[None] | None = None

    def reconfigure(self, config: GatewayConfig) -> None:
        self._config = config

    async def evict(self, victim: str, reason: str, room_for: int | None = None, *,
                    evicted_for: str | None = None, why: str = "") -> None:
        """Stop the victim; then wait (up to MEMORY_SETTLE_S) until its memory shows as free
        or room_for MiB are free, whichever comes first: room enough already (a count-only
        eviction, or a victim whose process was gone before its stop: stopped behind our
        back, crashed) is no reason to wait for memory that will not show up again."""
        before = self.room()
        log.info("evicting %s (%s)", victim, reason)
        try:
            await self._engines.lifecycle.stop(
                victim, reason=eviction_reason(victim, evicted_for, why),
                evicted_for=evicted_for)
        except EngineNotRunning:
            pass
        except GatewayError as e:
            log.warning("evicting %s failed: %s", victim, e.message)
        finally:
            if (use := self._turns.peek(victim)) is not None:
                use.draining_for = None
        if before is not None:   # wait until its memory really shows as free
            model = self._catalog.get(victim)
            expect = (self._engines.capacity.measured_mib(model) or model_need_mib(model, 0)) \
                if model else 0
            deadline = self._clock() + MEMORY_SETTLE_S
            while self._clock() < deadline:
                now = self.room()
                if now is None or now >= before + expect * 0.9 or (
                        room_for is not None and now >= room_for):
                    break
                await asyncio.sleep(MEMORY_POLL_S)

    def room(self) -> int | None:
        """Free GPU memory less what loads in progress will still take (may be negative):
        it rises by what a stopped engine held, even while another engine loads. None:
        no GPU."""
        devices = self._gpu.devices()
        if devices is None:
            return None
        ledger = scheduler.memory_ledger(*total(devices), self._usages())
        return ledger.free_mib - ledger.pending_mib

    def memory_coming_back(self) -> bool:
        """Whether an engine went away so recently that its memory may not show as free
        yet."""
        released = self._engines.registry.last_release
        return released is not None and self._clock() - released < MEMORY_SETTLE_S

    # -- more engines than max_engines (found by the reconciler) ------------------------

    def enforce_limit(self) -> None:
        if self._limit_task is None or self._limit_task.done():
            self._limit_task = asyncio.get_running_loop().create_task(self._enforce_limit())

    async def _enforce_limit(self) -> None:
        deadline = self._clock() + self._config.eviction_wait_s
        while self._clock() < deadline:
            usages = self._usages()
            holders = [u for u in usages if u.holds_place]
            if len(holders) <= self._config.max_engines:
                return
            victims = sorted((u for u in holders if u.why_not_evictable() is None),
                             key=lambda u: u.last_used)
            if victims:
                await self.evict(victims[0].model_id, "more engines than max_engines",
                                 why="more engines than max_engines")
            else:
                await self._wake_up.wait(deadline)

    async def close(self) -> None:
        if self._limit_task is not None:
            self._limit_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._limit_task


def eviction_reason(victim: str, evicted_for: str | None, why: str) -> str:
    """A victim's stop reason, what the events and the log say: always "evicted" first
    (the metrics' reason), then for whom and why, e.g. "evicted for 'b' (needs 300 MiB of
    GPU memory, 120 MiB free; 'a' least recently used)". Victims are chosen among the
    engines that serve nobody, least recently used first (grouped: of the lowest class,
    core/scheduler)."""
    if evicted_for is None:
        return f"evicted ({why})" if why else "evicted"
    because = f"{why}; " if why else ""
    return f"evicted for {evicted_for!r} ({because}{victim!r} least recently used)"
