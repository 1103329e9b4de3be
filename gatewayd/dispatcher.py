"""On-demand scheduling: who gets an engine, who waits, who makes room.

Requests for a ready engine take a slot (up to the model's max_concurrency,
else 429). Requests for a model whose engine is not running wait in that
model's queue (FIFO, up to its queue limit, else 503) while exactly one loader
task per model makes room and starts it. The loader asks the pure scheduler
what to do (scheduler.plan_start), carries out the answer (stop one victim,
wait for its memory to come back, ask again; or start), and wakes the queue.
A waiter whose client leaves just leaves the queue: the load goes on for the
others. Idle engines past their idle_ttl are stopped by a small timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gatewayd import budget, scheduler
from gatewayd.catalog import Model
from gatewayd.engine_manager import EngineManager
from gatewayd.engines import Engine, EngineState
from gatewayd.errors import (
    AlreadyRunning,
    ConcurrencyLimit,
    EngineFailed,
    EngineLimitReached,
    GatewayError,
    InsufficientGpu,
    ModelNotLoaded,
    QueueFull,
)

log = logging.getLogger("gatewayd.dispatcher")
MEMORY_SETTLE_S = 10.0


@dataclass
class _Use:
    in_flight: int = 0
    last_used: float = 0.0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)


class Dispatcher:
    def __init__(self, engines: EngineManager, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.engines = engines
        self.on_queue: Callable[[str, int], None] = lambda model, depth: None
        self.config = engines.config
        self._clock = clock
        self._use: dict[str, _Use] = {}
        self._loaders: dict[str, asyncio.Task[None]] = {}
        self._change: asyncio.Future[None] | None = None
        self._ttl_task: asyncio.Task[None] | None = None
        self.evictions: list[tuple[str, str]] = []   # (model, reason), most recent last
        engines.subscribe(self._on_engine_change)

    # -- the request path ----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serve(self, model_id: str, *, autoload: bool,
                    counts_as_use: bool = True) -> AsyncIterator[Engine]:
        engine = await self.acquire(model_id, autoload=autoload, counts_as_use=counts_as_use)
        try:
            yield engine
        finally:
            self.release(model_id, counts_as_use=counts_as_use)

    async def acquire(self, model_id: str, *, autoload: bool,
                      counts_as_use: bool = True) -> Engine:
        use = self._use.setdefault(model_id, _Use())
        model = self.engines.catalog.get(model_id)
        while True:
            engine = self.engines.get(model_id)
            if engine is not None and engine.state is EngineState.READY:
                limit = model.config.max_concurrency if model else None
                if limit is not None and use.in_flight >= limit:
                    raise ConcurrencyLimit(
                        f"{model_id!r} is serving {use.in_flight} requests, its limit "
                        f"(max_concurrency); try again shortly", retry_after=1,
                        model=model_id, max_concurrency=limit)
                use.in_flight += 1
                if counts_as_use:
                    use.last_used = self._clock()
                return engine
            state = engine.state.value if engine else EngineState.STOPPED.value
            if not autoload or model is None:
                raise ModelNotLoaded(
                    f"model {model_id!r} is not loaded (engine {state})"
                    + ("" if model else "; it is not in the catalog, so it cannot be loaded"),
                    param="model", model=model_id, state=state)
            limit = model.config.queue_limit
            limit = self.config.queue_limit if limit is None else limit
            if len(use.waiters) >= limit:
                raise QueueFull(f"{len(use.waiters)} requests already wait for {model_id!r} "
                                f"(queue limit {limit})", retry_after=5, model=model_id)
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            use.waiters.append(waiter)
            self.on_queue(model_id, len(use.waiters))
            self._ensure_loader(model)
            try:
                await waiter          # ready (then take a slot above), or the load error
            finally:
                with contextlib.suppress(ValueError):
                    use.waiters.remove(waiter)
                    self.on_queue(model_id, len(use.waiters))

    def release(self, model_id: str, *, counts_as_use: bool = True) -> None:
        use = self._use[model_id]
        use.in_flight -= 1
        if counts_as_use:
            use.last_used = self._clock()
        if use.in_flight == 0:
            self._changed()

    # -- loading -----------------------------------------------------------------------

    def _ensure_loader(self, model: Model) -> None:
        if model.id not in self._loaders:
            task = asyncio.get_running_loop().create_task(self._load(model))
            self._loaders[model.id] = task

    async def _load(self, model: Model) -> None:
        use = self._use.setdefault(model.id, _Use())
        try:
            await self._make_room_and_start(model)
            error: BaseException | None = None
        except GatewayError as e:
            error = e
        except Exception as e:  # every waiter must hear about it
            log.exception("loading %s failed", model.id)
            error = EngineFailed(f"loading {model.id!r} failed: {e}", model=model.id)
        finally:
            self._loaders.pop(model.id, None)
        for waiter in list(use.waiters):   # FIFO: they resume in arrival order
            if not waiter.done():
                if error is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(error)

    async def _make_room_and_start(self, model: Model) -> None:
        margin = model.config.vram_margin_mib
        need = budget.required_mib(model.size_bytes, self.config.vram_margin_mib
                                   if margin is None else margin)
        deadline = self._clock() + self.config.eviction_wait_s
        while True:
            engine = self.engines.get(model.id)
            if engine is not None and engine.state is EngineState.READY:
                return
            if engine is not None and engine.state in (EngineState.STARTING,
                                                       EngineState.LOADING):
                await self.engines.wait_ready(model.id)   # someone else started it
                return
            if engine is not None and engine.state is EngineState.STOPPING:
                await self._wait_change(deadline)
                continue
            gpu = self.engines.gpu.memory(model.config.cuda_visible_devices)
            usages = self.usages()
            free = None if gpu is None else scheduler.memory_ledger(
                gpu.total_mib, gpu.free_mib, usages).plan_free_mib
            decision = scheduler.plan_start(
                model.id, usages, max_engines=self.config.max_engines, need_mib=need,
                free_mib=free)
            match decision:
                case scheduler.Fits() | scheduler.TryAnyway():
                    if isinstance(decision, scheduler.TryAnyway):
                        log.info("%s: %d MiB needed by estimate, more than is free with "
                                 "nothing else running; trying anyway", model.id, need)
                    try:
                        await self.engines.start(model.id, force=isinstance(
                            decision, scheduler.TryAnyway))
                    except AlreadyRunning:
                        await self.engines.wait_ready(model.id)
                    return
                case scheduler.Evict(victim, reason):
                    await self._evict(victim, reason)
                case scheduler.Blocked(limit, holders):
                    if self._clock() >= deadline:
                        held = ", ".join(f"{m} ({why})" for m, why in holders)
                        if limit == "engine_limit":
                            raise EngineLimitReached(
                                f"no engine slot for {model.id!r} within "
                                f"{self.config.eviction_wait_s:g}s: max_engines is "
                                f"{self.config.max_engines}, held by {held}",
                                retry_after=5, running=[m for m, _ in holders])
                        raise InsufficientGpu(
                            f"not enough GPU memory for {model.id!r} within "
                            f"{self.config.eviction_wait_s:g}s: needs {need} MiB, "
                            f"{gpu.free_mib if gpu else '?'} MiB free; held by {held}",
                            retry_after=5, required_mib=need,
                            free_mib=gpu.free_mib if gpu else None,
                            running=[m for m, _ in holders])
                    await self._wait_change(deadline)

    async def _evict(self, victim: str, reason: str) -> None:
        before = self.engines.gpu.memory()
        engine = self.engines.get(victim)
        log.info("evicting %s (%s)", victim, reason)
        self.evictions.append((victim, reason))
        del self.evictions[:-100]
        if engine is not None:
            await self.engines.stop(victim, reason="evicted")
        if before is not None:   # wait until its memory really shows as free
            model = self.engines.catalog.get(victim)
            expect = budget.required_mib(model.size_bytes, 0) if model else 0
            deadline = self._clock() + MEMORY_SETTLE_S
            while self._clock() < deadline:
                now = self.engines.gpu.memory()
                if now is None or now.free_mib >= before.free_mib + expect * 0.9:
                    break
                await asyncio.sleep(0.1)

    # -- state ---------------------------------------------------------------------------

    def usages(self) -> list[scheduler.Usage]:
        per_process = self.engines.gpu.process_mib()
        rows = []
        for engine in self.engines.engines():
            use = self._use.get(engine.model_id) or _Use()
            model = self.engines.catalog.get(engine.model_id)
            estimate = 0
            if model is not None:
                margin = model.config.vram_margin_mib
                estimate = budget.required_mib(model.size_bytes, self.config.vram_margin_mib
                                               if margin is None else margin)
            measured = per_process.get(engine.main_pid) if per_process is not None else None
            rows.append(scheduler.Usage(
                model_id=engine.model_id, state=engine.state, in_flight=use.in_flight,
                queued=len(use.waiters), pinned=bool(model and model.config.pin),
                last_used=use.last_used or (engine.ready_since or 0.0),
                estimate_mib=estimate, measured_mib=measured,
                idle_ttl_s=model.config.idle_ttl_s if model else None))
        return rows

    def ledger(self) -> scheduler.Ledger | None:
        gpu = self.engines.gpu.memory()
        if gpu is None:
            return None
        return scheduler.memory_ledger(gpu.total_mib, gpu.free_mib, self.usages())

    def _on_engine_change(self, old: Engine, new: Engine) -> None:
        if old.state is not new.state:
            if new.state is EngineState.READY:
                use = self._use.setdefault(new.model_id, _Use())
                use.last_used = use.last_used or self._clock()
            self._changed()

    def _changed(self) -> None:
        if self._change is not None and not self._change.done():
            self._change.set_result(None)
        self._change = None

    async def _wait_change(self, deadline: float) -> None:
        if self._change is None:
            self._change = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._change),
                                   max(0.05, min(1.0, deadline - self._clock())))

    # -- idle TTL ------------------------------------------------------------------------

    def start_timers(self) -> None:
        if any(m.config.idle_ttl_s for m in self.engines.catalog):
            self._ttl_task = asyncio.get_running_loop().create_task(self._ttl_loop())

    async def _ttl_loop(self) -> None:
        period = max(0.2, min(m.config.idle_ttl_s or 60 for m in self.engines.catalog) / 4)
        while True:
            await asyncio.sleep(period)
            for model_id in scheduler.idle_expired(self.usages(), self._clock()):
                log.info("stopping %s: idle for its idle_ttl", model_id)
                with contextlib.suppress(GatewayError):
                    await self.engines.stop(model_id, reason="idle_ttl")

    async def close(self) -> None:
        for task in [*self._loaders.values(), *([self._ttl_task] if self._ttl_task else [])]:
            task.cancel()
