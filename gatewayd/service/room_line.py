"""The line for room: the models whose loaders want room, and what its order reads of
each of them.

A model joins the line when its loader starts (its first request queued) and leaves it
when the loader ends. `order()` is core/scheduler.line_order over a fresh snapshot of each
(`Want`: its waiting requests' age and class, aged; whether room was made for it; whether
its own engine drains). Only the head makes room; `ahead()` says which models before one
still need room. The line also remembers why each engine gave its place (`swaps`, for the
events and the console) and for whom each draining engine drains (`drains`).
Synchronous bookkeeping only: the loader (loader.py) decides and awaits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

from gatewayd.core import scheduler
from gatewayd.core.catalog import Catalog
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engines import EngineState
from gatewayd.core.priority import NORMAL, aged, turn_bound_s
from gatewayd.core.waits import SERVED_NOBODY, Swap
from gatewayd.service.engine_parts import EngineReads, EngineRoom
from gatewayd.service.turns import Turns


class LineEngines(Protocol):
    """What the line reads of the engines (service/engine_manager has it): the engines,
    and what each needs."""

    @property
    def registry(self) -> EngineReads: ...

    @property
    def capacity(self) -> EngineRoom: ...

class RoomLine:
    def __init__(self, engines: LineEngines, *, catalog: Catalog, config: GatewayConfig,
                 turns: Turns, clock: Callable[[], float]) -> None:
        self._engines = engines
        self._catalog = catalog
        self._config = config
        self._turns = turns
        self._clock = clock
        self._line: list[str] = []        # models whose loaders want room, oldest first
        self._asked: dict[str, float] = {}   # when each joined the line
        self._room_made: list[str] = []      # models an engine was evicted or drained for
        self.drains: dict[str, Swap] = {}    # draining engines: for whom, and why
        self.swaps: dict[str, Swap] = {}     # evicted engines: why each last gave its place

    def reconfigure(self, config: GatewayConfig) -> None:
        self._config = config

    @property
    def grouped(self) -> bool:
        return self._config.schedule == "grouped"

    def join(self, model_id: str) -> None:
        self._line.append(model_id)
        self._asked[model_id] = self._clock()

    def leave(self, model_id: str) -> None:
        """model_id wants room no longer: it leaves the line, and an engine draining for
        it drains no more."""
        self._asked.pop(model_id, None)
        with contextlib.suppress(ValueError):
            self._room_made.remove(model_id)
        with contextlib.suppress(ValueError):
            self._line.remove(model_id)
        for use in self._turns.uses().values():
            if use.draining_for == model_id:
                use.draining_for = None

    def want(self, model_id: str, now: float) -> scheduler.Want:
        """model_id in the line, as its order sees it: its waiting requests' age and
        class (aged by how long each waited)."""
        use = self._turns.peek(model_id)
        waiters = list(use.waiters) if use is not None else []
        model = self._catalog.get(model_id)
        max_wait = self._config.max_wait_for(model.config if model is not None else None)
        aging = self._config.priority_aging_s
        return scheduler.Want(
            model_id, self._asked.get(model_id, now),
            min((w.since for w in waiters), default=None), len(waiters),
            max((aged(w.priority, now - w.since, aging) for w in waiters), default=NORMAL),
            max_wait, room_made=self._room_made.index(model_id)
            if model_id in self._room_made else None, draining=self._draining(model_id),
            turn_by=min((w.since + turn_bound_s(w.priority, max_wait, aging)
                         for w in waiters), default=None),
            client=scheduler.sole_client(w.client for w in waiters))

    def order(self) -> list[scheduler.Want]:
        """The models waiting for room, head first (core/scheduler.line_order: grouped,
        within a class the room made goes to its model, and a model whose engine drains
        goes behind). A draining model at the head all the same (a request of a higher
        class came for it) has its drain undone by its loader."""
        now = self._clock()
        return scheduler.line_order((self.want(m, now) for m in self._line),
                                    grouped=self.grouped, now=now)

    def made_room(self, model_id: str) -> None:
        """An engine was evicted or drained for model_id: the room is its."""
        if model_id not in self._room_made:
            self._room_made.append(model_id)

    def ahead(self, model_id: str) -> list[str]:
        """Models before model_id in the line that still need room."""
        ahead = []
        for other in (w.model_id for w in self.order()):
            if other == model_id:
                break
            engine = self._engines.registry.get(other)
            use = self._turns.peek(other)
            if engine is None or not engine.holds_place or engine.state is EngineState.STOPPING \
                    or (engine.state is EngineState.READY and use is not None and use.draining):
                ahead.append(other)
        return ahead

    def ahead_ram_mib(self, ahead: list[str]) -> int:
        """The RAM the models ahead need."""
        models = (self._catalog.get(m) for m in ahead)
        return sum(self._engines.capacity.need(m).ram_mib for m in models if m is not None)

    def swap(self, victim: str, model_id: str, want: scheduler.Want) -> Swap:
        """Why victim gives its place to model_id: the rule its drain was for, or (it
        serves nobody) that."""
        use = self._turns.peek(victim)
        drained = self.drains.pop(victim, None)
        if drained is not None and drained.model == model_id and use is not None \
                and use.draining_for == model_id:
            return drained
        return Swap(victim, model_id, self.waited(want), SERVED_NOBODY)

    def waited(self, want: scheduler.Want) -> float:
        """How long the oldest request of the model wanting room has waited."""
        return 0.0 if want.oldest_at is None else max(0.0, self._clock() - want.oldest_at)

    def waited_s(self, model_id: str) -> float:
        """How long model_id's oldest waiting request has waited: what a refusal says."""
        return self.waited(self.want(model_id, self._clock()))

    def _draining(self, model_id: str) -> bool:
        engine = self._engines.registry.get(model_id)
        use = self._turns.peek(model_id)
        return engine is not None and engine.state is EngineState.READY and \
            use is not None and use.draining
