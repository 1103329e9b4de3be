"""systemd is the truth about which engines exist: adopt, restore, reconcile.

- adopt (gateway start): take over the engine units already running, without
  restarting them (same MainPID); the model id and socket are read back from
  each unit.
- restore (after adopt, in the background): start the desired engines, then the
  preload ones, one at a time, each ready or failed before the next.
- reconcile (every few seconds, and whenever something looks off): list the
  engine units and make the gateway's view equal systemd's — a unit running
  for a model the gateway thinks stopped or failed is adopted; an engine whose
  unit is gone or inactive is moved on; more units than max_engines makes the
  dispatcher evict the surplus. Signals normally keep the view right; this
  catches what signals cannot say (a unit started or removed behind our back,
  a bus reconnect) so that no divergence outlives one period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from gatewayd.core.catalog import Catalog
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engines import RUNNING_STATES as RUNNING
from gatewayd.core.engines import Engine
from gatewayd.core.errors import GatewayError
from gatewayd.core.ports import EngineUnitInfo
from gatewayd.service.engine_parts import EngineReads, EngineStarts

log = logging.getLogger("gatewayd.restore")
RECONCILE_PERIOD_S = 5.0


class RestoredEngines(Protocol):
    """What adopt, restore and the reconciler ask of the engine layer (service/
    engine_manager has it): systemd's units, the gateway's engines, and a start."""

    catalog: Catalog
    config: GatewayConfig

    @property
    def registry(self) -> EngineReads: ...

    @property
    def lifecycle(self) -> EngineStarts: ...

    async def list_units(self) -> list[EngineUnitInfo]: ...

    def desired(self) -> list[str]: ...

    def learn_memory(self) -> list[str]: ...

async def adopt(engines: RestoredEngines) -> list[Engine]:
    """Take over the engine units that are already running, without restarting them."""
    adopted = []
    for info in await engines.list_units():
        if info.model_id is None or info.socket is None:
            log.warning("ignoring %s: not started by llm-gateway (no model id in its "
                        "environment)", info.unit)
            continue
        if info.active_state == "inactive" or engines.registry.get(info.model_id) is not None:
            continue
        engine = engines.lifecycle.take_over(info)
        if engine is None:
            continue
        if info.model_id not in engines.catalog:
            log.warning("adopted %s serves %r, which is not in the catalog (config "
                        "changed?); it can be listed and stopped", info.unit, info.model_id)
        adopted.append(engine)
    for engine in adopted:
        log.info("adopted %s (%s, pid %d, %s)", engine.model_id, engine.unit,
                 engine.main_pid, engine.state.value)
    return adopted


async def restore(engines: RestoredEngines) -> None:
    """Start the desired engines, then the preload ones, one at a time, in order."""
    desired = engines.desired()
    preload = [m.id for m in engines.catalog if m.config.preload]
    for model_id in [*desired, *(p for p in preload if p not in desired)]:
        current = engines.registry.get(model_id)
        if current is not None and current.holds_place:
            continue
        if model_id not in engines.catalog:
            log.warning("restore: %r is no longer in the catalog; skipped", model_id)
            continue
        if (model := engines.catalog.get(model_id)) and not model.config.downloaded:
            log.info("restore: %s waits for its download (started once it is here)",
                     model_id)
            continue
        log.info("restore: starting %s", model_id)
        try:
            engine = await engines.lifecycle.start(model_id)
            log.info("restore: %s ready", engine.model_id)
        except GatewayError as e:
            log.warning("restore: %s failed: %s", model_id, e.message)


class Reconciler:
    """Keeps the gateway's view of engines equal to systemd's (see the module doc)."""

    def __init__(self, engines: RestoredEngines, *, on_over_limit: Callable[[], None],
                 period_s: float = RECONCILE_PERIOD_S) -> None:
        self._engines = engines
        self._on_over_limit = on_over_limit
        self._period_s = period_s
        self._task: asyncio.Task[None] | None = None
        self._soon = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def poke(self) -> None:
        """Reconcile now rather than at the next period."""
        self._soon.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._soon.wait(), self._period_s)
            self._soon.clear()
            try:
                await self.reconcile()
            except GatewayError as e:
                log.warning("reconcile: cannot list the engine units: %s", e.message)
            except Exception:
                log.exception("reconcile failed")

    async def reconcile(self) -> list[str]:
        """One pass; returns what it changed (for the log and the tests)."""
        mgr = self._engines
        before = mgr.registry.versions()
        listed = {i.model_id: i for i in await mgr.list_units()
                  if i.model_id is not None and i.socket is not None}
        changes: list[str] = []
        for model_id in sorted({*listed, *(e.model_id for e in mgr.registry.engines())}):
            if mgr.lifecycle.busy(model_id) \
                    or mgr.registry.versions().get(model_id, 0) != before.get(model_id, 0):
                continue   # a start, stop or signal since the listing began: it is newer
            info = listed.get(model_id)
            engine = mgr.registry.get(model_id)
            if engine is None:
                if info is not None and info.active_state in RUNNING \
                        and mgr.lifecycle.take_over(info):
                    changes.append(f"adopted {info.unit} ({info.active_state})")
                continue
            if info is not None and info.unit != engine.unit:
                continue
            mgr.lifecycle.observe(model_id, info)
            after = mgr.registry.get(model_id)
            if after is not None and after.state is not engine.state:
                changes.append(f"{model_id}: {engine.state.value} -> {after.state.value} "
                               f"(systemd: {info.active_state if info else 'no unit'})")
        if sum(1 for e in mgr.registry.engines() if e.holds_place) > mgr.config.max_engines:
            changes.append("more engines than max_engines: evicting the surplus")
            self._on_over_limit()
        for change in changes:
            log.warning("reconcile: %s", change)
        mgr.learn_memory()   # what ready engines really hold, for the next admission
        return changes
