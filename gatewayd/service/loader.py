"""Loading: one loader task per model makes room and starts its engine.

A model whose engine is not ready gets a loader when its first request queues
(the queue itself is in turns.py). Loaders stand in one line (room_line.py: fifo, or
grouped by class, turn and count). Each asks the pure scheduler
(core.scheduler.plan_start) what to do with a fresh snapshot and carries out the
answer: start; evict one victim and wait for its memory to show as free (eviction.py);
mark one draining (it is evicted once it serves nobody); or wait for a change. Every
wait is bounded: eviction_wait_s for room (grouped: after the model's turn), then
load_timeout_s for the load. What can be checked of the start before it runs (the engine
server, the model's files) is checked before the first decision: a start that cannot
happen evicts nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gatewayd.core import scheduler
from gatewayd.core.budget import insufficient_gpu, insufficient_ram
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engines import COMING_STATES, EngineState
from gatewayd.core.errors import (
    AlreadyRunning,
    EngineFailed,
    EngineLimitReached,
    EngineNotRunning,
    GatewayError,
)
from gatewayd.core.placement import Placement
from gatewayd.core.ports import GpuProbe
from gatewayd.core.priority import NORMAL
from gatewayd.core.ram_budget import RamLedger
from gatewayd.core.waits import Swap, room_rule
from gatewayd.service.eviction import MEMORY_POLL_S, EvictedEngines, Evictor
from gatewayd.service.room_line import LineEngines, RoomLine
from gatewayd.service.turns import Turns
from gatewayd.service.wake_up import CHANGE_POLL_S, WakeUp

log = logging.getLogger("gatewayd.dispatcher")
LOOK_AGAIN_S = 0.01   # never spin: a retry always yields to the event loop first


@dataclass
class Bounds:
    """One loader's bounds: room is made by room_by (a turn that lasts moves it: room
    keeps its eviction_wait_s after the turn), and the engine is ready load_timeout_s
    after that."""

    began: float
    room_by: float


class LoadedEngines(LineEngines, EvictedEngines, Protocol):
    """What the loaders ask of the engines (service/engine_manager has it): besides the
    line's and eviction's parts, the checks before room is made for a start."""

    def check_startable(self, model: Model) -> None: ...

class Loader:
    def __init__(self, engines: LoadedEngines, *, catalog: Catalog, gpu: GpuProbe,
                 config: GatewayConfig,
                 turns: Turns, usages: Callable[[], list[scheduler.Usage]],
                 wake_up: WakeUp, clock: Callable[[], float]) -> None:
        self._engines = engines
        self._config = config
        self._turns = turns
        self._usages = usages
        self._wake_up = wake_up
        self._clock = clock
        self._line = RoomLine(engines, catalog=catalog, config=config, turns=turns,
                              clock=clock)
        self._evictor = Evictor(engines, catalog=catalog, gpu=gpu, config=config,
                                turns=turns, usages=usages, wake_up=wake_up, clock=clock)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def ensure(self, model: Model) -> None:
        """A loader for model, unless one runs already."""
        if model.id not in self._tasks:
            self._line.join(model.id)
            self._tasks[model.id] = asyncio.get_running_loop().create_task(self._load(model))

    @property
    def grouped(self) -> bool:
        return self._config.schedule == "grouped"

    @property
    def swaps(self) -> dict[str, Swap]:
        """Evicted engines: why each last gave its place."""
        return self._line.swaps

    def line(self) -> list[scheduler.Want]:
        """The models waiting for room, head first (room_line.RoomLine.order)."""
        return self._line.order()

    def enforce_limit(self) -> None:
        """More engines than max_engines (the reconciler found some): evict the surplus."""
        self._evictor.enforce_limit()

    def reconfigure(self, config: GatewayConfig) -> None:
        self._config = config
        self._line.reconfigure(config)
        self._evictor.reconfigure(config)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._evictor.close()

    # -- one model's loader ----------------------------------------------------------

    async def _load(self, model: Model) -> None:
        error: BaseException | None = None
        try:
            await self._make_room_and_start(model)
        except GatewayError as e:
            error = e
        except Exception as e:  # every waiter must hear about it
            log.exception("loading %s failed", model.id)
            error = EngineFailed(f"loading {model.id!r} failed: {e}", model=model.id)
        finally:
            self._tasks.pop(model.id, None)
            self._line.leave(model.id)   # room no longer wanted
            self._wake_up.notify()
        self._turns.wake(model.id, error)

    async def _make_room_and_start(self, model: Model) -> None:
        """Until model's engine is ready (or every client left): what its engine is doing
        decides first, then the scheduler's decision for a start, carried out."""
        self._engines.capacity.check_ram_ceiling(model)   # never fits: said at once
        # grouped, room may wait for the model's turn first: max_wait_s, then the drain;
        # a turn that lasts longer (a lower class than the busy engines' traffic waits to
        # be aged: Want.turn_by) moves room_by, so room keeps its eviction_wait_s
        began = self._clock()
        bounds = Bounds(began, began + self._config.eviction_wait_s + (
            self._line.want(model.id, began).max_wait_s if self.grouped else 0.0))
        checked = False
        while True:
            if not self._turns.queued(model.id):
                return   # every client left: nothing to make room for
            if self._clock() >= bounds.room_by + self._config.load_timeout_s:
                waited = self._clock() - began
                raise EngineFailed(f"{model.id!r} was not ready within {waited:.0f}s",
                                   retry_after=5, model=model.id)
            settled = await self._engine_as_it_is(model, bounds.room_by)
            if settled is not None:
                if settled:
                    return
                continue
            if (left := self._engines.registry.backoff_left(model.id)) > 0:
                raise self._engines.registry.failed_error(model.id, retry_after=math.ceil(left))
            if not checked:   # a start that cannot happen must evict nobody first
                try:
                    self._engines.check_startable(model)
                except GatewayError as e:
                    log.warning("%s cannot start: %s", model.id, e.message)
                    raise
                checked = True
            if await self._make_room_or_start(model, bounds):
                return

    async def _engine_as_it_is(self, model: Model, room_by: float) -> bool | None:
        """What model's engine is doing decides first. True: it is ready for the model's
        requests (the loader is done); False: it was waited for, look again; None: it
        needs a start."""
        engines = self._engines
        engine = engines.registry.get(model.id)
        use = self._turns.get_or_add(model.id)
        if engine is not None and engine.state is EngineState.READY:
            if not use.draining:
                return True
            if self.grouped and self.line()[0].model_id == model.id:
                # a request of a higher class came for the engine being drained for a
                # lower one: the drain is undone, its engine serves it
                log.info("%s is no longer drained: its own requests come first", model.id)
                use.draining_for = None
                self._wake_up.notify()
                return True
            await self._wait(room_by, model, "its engine is being evicted")
            return False
        if engine is not None and engine.state in COMING_STATES:
            try:
                # someone else started it, or systemd restarts it
                await engines.lifecycle.wait_ready(model.id)
                return True
            except EngineNotRunning:   # stopped meanwhile: look again (never spin)
                await asyncio.sleep(LOOK_AGAIN_S)
                return False
        if engines.lifecycle.busy(model.id) or (engine is not None and (
                engine.state is EngineState.STOPPING or engine.exit_unconfirmed)):
            await self._wait(room_by, model, "its engine is stopping")
            return False
        return None

    async def _make_room_or_start(self, model: Model, bounds: Bounds) -> bool:
        """One decision of the scheduler for model's start, carried out; True once its
        engine was started."""
        engines, line = self._engines, self._line
        needs = engines.capacity.need(model)
        where = engines.capacity.place(model)
        ram = engines.capacity.ram(model)
        usages = self._usages()
        ahead = line.ahead(model.id)
        want = line.want(model.id, self._clock())
        decision = scheduler.plan_start(
            model.id, usages, max_engines=self._config.max_engines, need_mib=needs.vram_mib,
            free_mib=None if where is None else where.free_mib, ahead=len(ahead),
            devices=None if where is None else frozenset(where.uuids),
            ram_need_mib=needs.ram_mib,
            ram_free_mib=None if ram is None else ram.plan_free_mib,
            ahead_ram_mib=line.ahead_ram_mib(ahead) if ahead and ram else 0,
            grouped=self.grouped, overdue=want.overdue(self._clock()),
            priority=want.priority, now=self._clock(), client=want.client)
        match decision:
            case scheduler.TryAnyway() if self._evictor.memory_coming_back():
                # an engine just went away: its memory may not show as free yet, so
                # what looks like "does not fit even alone" may fit in a moment
                await asyncio.sleep(MEMORY_POLL_S)
            case scheduler.Fits() | scheduler.TryAnyway():
                return await self._start(model, decision, needs.vram_mib)
            case scheduler.Evict(victim, reason, why):
                line.made_room(model.id)
                line.swaps[victim] = line.swap(victim, model.id, want)
                await self._evictor.evict(victim, reason, room_for=needs.vram_mib,
                                          evicted_for=model.id, why=why)
            case scheduler.Drain(victim, reason):
                self._drain(victim, model.id, reason, want, usages)
            case scheduler.Wait(why, turn=True) if want.turn_by is not None:
                # the order's own rules end a turn (overdue, then aged to the highest
                # class by turn_by); the poll's interval is its slack
                bounds.room_by = max(bounds.room_by, self._clock() + self._config.eviction_wait_s)
                await self._wait(want.turn_by + 2 * CHANGE_POLL_S, model, why)
            case scheduler.Wait(why) if ahead and self.grouped and want.turn_by is not None \
                    and self._clock() < want.turn_by:
                # the models ahead (of a higher class, or overdue first) come first: until
                # its turn_by that is its turn too, and room keeps its eviction_wait_s after
                bounds.room_by = max(bounds.room_by, self._clock() + self._config.eviction_wait_s)
                await self._wait(bounds.room_by, model, why)
            case scheduler.Wait(why):
                await self._wait(bounds.room_by, model, why)
            case scheduler.Blocked(limit, holders):
                if self._clock() >= bounds.room_by:
                    raise self._blocked(model, limit, holders, needs.vram_mib, needs.ram_mib,
                                        where, ram)
                await self._wake_up.wait(bounds.room_by)
        return False

    async def _start(self, model: Model, decision: scheduler.Decision, need_mib: int) -> bool:
        """Start model's engine; False where someone else started it, or it was stopped
        meanwhile (look again)."""
        anyway = isinstance(decision, scheduler.TryAnyway)
        if anyway:
            log.info("%s: %d MiB needed by estimate, more than is free with nothing else "
                     "running; trying anyway", model.id, need_mib)
        try:
            await self._engines.lifecycle.start(model.id, force=anyway)
        except (AlreadyRunning, EngineNotRunning):
            await asyncio.sleep(LOOK_AGAIN_S)
            return False
        return True

    def _drain(self, victim: str, model_id: str, reason: str, want: scheduler.Want,
               usages: list[scheduler.Usage]) -> None:
        """Mark victim draining for model_id: it is evicted once it serves nobody."""
        log.info("draining %s (%s)", victim, reason)
        rule = room_rule(drained=True, grouped=self.grouped, priority=want.priority,
                         overdue=want.overdue(self._clock()),
                         victim_priority=next((u.priority for u in usages
                                               if u.model_id == victim), NORMAL))
        self._line.drains[victim] = Swap(victim, model_id, self._line.waited(want), rule)
        self._turns.get_or_add(victim).draining_for = model_id
        self._line.made_room(model_id)

    def _blocked(self, model: Model, limit: str, holders: tuple[tuple[str, str], ...],
                 need_mib: int, ram_need_mib: int, where: Placement | None,
                 ram: RamLedger | None) -> GatewayError:
        """The refusal once room could not be made in time."""
        if limit == "ram" and ram is not None:
            return insufficient_ram(
                model.id, ram_need_mib, ram, retry_after=5, running=[m for m, _ in holders],
                held_by=", ".join(f"{m} ({why})" for m, why in holders),
                prefix=f"not enough RAM within {self._line.waited_s(model.id):.0f}s: ")
        return self._no_room(model, limit, holders, need_mib, where)

    async def _wait(self, deadline: float, model: Model, why: str) -> None:
        if self._clock() >= deadline:
            holders = tuple(
                (u.model_id, (u.why_not_evictable() or "idle")
                 + (", draining" if u.draining else ""))
                for u in self._usages() if u.holds_place and u.model_id != model.id)
            raise self._no_room(model, "engine_limit", holders, 0, None, why=why)
        await self._wake_up.wait(deadline)

    def _no_room(self, model: Model, limit: str, holders: tuple[tuple[str, str], ...],
                 need: int, where: Placement | None, why: str | None = None) -> GatewayError:
        held = ", ".join(f"{m} ({why})" for m, why in holders) or "nobody"
        wait_s = self._line.waited_s(model.id)
        if limit == "engine_limit" or where is None:
            return EngineLimitReached(
                f"no engine place for {model.id!r} within {wait_s:.0f}s"
                + (f" ({why})" if why else "") + ": max_engines is "
                f"{self._config.max_engines}, held by {held}",
                retry_after=5, running=[m for m, _ in holders])
        return insufficient_gpu(model.id, need, where, running=[m for m, _ in holders],
                                retry_after=5, held_by=held,
                                prefix=f"not enough GPU memory within {wait_s:.0f}s: ")

