"""The engines the gateway knows, by model and by unit, and everyone who follows them.

Every change of an engine is an `engines` event applied here (the state machine
is core/engines.py): systemd's signals (merged per unit, because the Unit and
Service interfaces signal separately), what systemd says when asked, and the
gateway's own operations. A change is counted (the retry backoff, the last
release of a place), goes to the subscribers in order, is logged, and goes last
to the lifecycle's own follow-up (service/engine_lifecycle.py). Nothing here
awaits, except a waiter for an engine to be ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from gatewayd.core.engines import (
    COMING_STATES,
    Engine,
    EngineState,
    Event,
    Reconciled,
    UnitChanged,
    apply,
)
from gatewayd.core.errors import EngineFailed, EngineNotRunning, EngineOutOfMemory, GatewayError
from gatewayd.core.ports import EngineUnitInfo

log = logging.getLogger("gatewayd.engines")
RETRY_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)   # after 1, 2, 3... failed starts in a row

EngineListener = Callable[[Engine, Engine], None]


class EngineRegistry:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._engines: dict[str, Engine] = {}
        self._by_unit: dict[str, str] = {}
        self._unit_props: dict[str, dict[str, Any]] = {}
        self._versions: dict[str, int] = {}         # bumped by every event and operation
        self._listeners: list[EngineListener] = []
        self._react: EngineListener | None = None
        self._waiters: dict[str, list[asyncio.Future[Engine]]] = {}
        self._failures: dict[str, tuple[int, float]] = {}   # model -> (in a row, retry at)
        self._state_since: dict[str, float] = {}   # model -> when it entered its state
        # model -> when its way to ready began (a start, or systemd's restart), and how
        # long the last one took
        self._coming_since: dict[str, float] = {}
        self._load_s: dict[str, float] = {}
        self.last_release: float | None = None   # when an engine last gave up its place

    # -- queries ---------------------------------------------------------------------

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def get(self, model_id: str) -> Engine | None:
        return self._engines.get(model_id)

    def __getitem__(self, model_id: str) -> Engine:
        return self._engines[model_id]

    def versions(self) -> dict[str, int]:
        """Per model, a number that changes with every event and every start or stop: a
        listing taken between two equal readings saw nothing newer than the gateway."""
        return dict(self._versions)

    def backoff_left(self, model_id: str) -> float:
        """Seconds before a failed model may be started again by a request (0: now)."""
        engine = self._engines.get(model_id)
        failed = self._failures.get(model_id)
        if engine is None or engine.state is not EngineState.FAILED or failed is None:
            return 0.0
        return max(0.0, failed[1] - self._clock())

    def failed_error(self, model_id: str, *, retry_after: int | None = None) -> EngineFailed:
        engine = self._engines[model_id]
        failure = engine.failure
        reason = failure.reason if failure else "failed"
        if failure is not None and failure.out_of_memory:
            return EngineOutOfMemory(
                f"engine for {model_id!r} ran out of memory: {reason}. "
                f"Logs: journalctl -u {engine.unit}", retry_after=retry_after,
                model=model_id, unit=engine.unit, failure=failure.describe(),
                memory="ram", required_mib=dict(failure.memory).get("required_mib"),
                free_mib=dict(failure.memory).get("free_mib"),
                memory_max_mib=dict(failure.memory).get("memory_max_mib"))
        # with its cause (a fixed sentence, core/logs.failure_cause): the caller learns
        # why without the journal's lines, which only the admin API gives
        return EngineFailed(f"engine for {model_id!r} failed: "
                            f"{failure.said() if failure else reason}. "
                            f"Logs: journalctl -u {engine.unit}", retry_after=retry_after,
                            model=model_id, unit=engine.unit,
                            failure=failure.describe() if failure else None)

    # -- followers -------------------------------------------------------------------

    def subscribe(self, listener: EngineListener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def react_with(self, reaction: EngineListener) -> None:
        """The lifecycle's own follow-up to a change, after every subscriber has heard
        of it (the order the gateway has always kept)."""
        self._react = reaction

    # -- changes ---------------------------------------------------------------------

    def bump(self, model_id: str) -> None:
        self._versions[model_id] = self._versions.get(model_id, 0) + 1

    def register(self, engine: Engine, *,
                 unit_props: Mapping[str, Any] | None = None) -> None:
        """A new engine for its model (replacing the one before); unit_props: what a
        listing said of its unit, for the signals that follow to merge into."""
        old = self._engines.get(engine.model_id)
        if old is not None:
            self._by_unit.pop(old.unit, None)
        self._engines[engine.model_id] = engine
        self._by_unit[engine.unit] = engine.model_id
        self._unit_props.pop(engine.unit, None)
        if unit_props is not None:
            self._unit_props[engine.unit] = dict(unit_props)
        if old is not None:
            self._changed(old, engine)

    def forget(self, model_id: str) -> Engine:
        # whoever began to wait during the stop (a late signal can make a stopping engine
        # look loading for a moment) hears now, not at its deadline
        self.fail_waiters(model_id, EngineNotRunning(
            f"the engine for {model_id!r} was stopped", model=model_id))
        stopped = self._engines.pop(model_id)
        self._by_unit.pop(stopped.unit, None)
        self._unit_props.pop(stopped.unit, None)
        return stopped

    def event(self, model_id: str, event: Event) -> None:
        old = self._engines.get(model_id)
        if old is None:
            return
        self.bump(model_id)
        new = apply(old, event)
        if new is not old:
            self._engines[model_id] = new
            self._changed(old, new)

    def unit_changed(self, unit: str, changed: Mapping[str, Any]) -> None:
        """systemd's PropertiesChanged for a unit (adapters/systemd's watchers)."""
        model_id = self._by_unit.get(unit)
        if model_id is None:
            return
        props = self._unit_props.setdefault(unit, {})
        props.update(changed)
        self.event(model_id, UnitChanged(
            self._clock(),
            active_state=changed.get("ActiveState"),
            sub_state=props.get("SubState") if "ActiveState" in changed else None,
            main_pid=changed.get("MainPID"),
            n_restarts=changed.get("NRestarts"),
            result=props.get("Result"),
            exec_code=props.get("ExecMainCode"),
            exec_status=props.get("ExecMainStatus")))

    def apply_info(self, model_id: str, info: EngineUnitInfo) -> None:
        """What systemd said of the model's unit when asked, as a signal would say it."""
        self.event(model_id, UnitChanged(
            self._clock(), active_state=info.active_state, sub_state=info.sub_state,
            main_pid=info.main_pid, n_restarts=info.n_restarts))

    def reconcile(self, model_id: str, info: EngineUnitInfo | None) -> None:
        """systemd's whole truth about the model's unit (None: no such unit)."""
        self.event(model_id, Reconciled(
            self._clock(), info.active_state if info else None,
            main_pid=info.main_pid if info else 0, n_restarts=info.n_restarts if info else 0))

    def load_seconds(self, model_id: str) -> float | None:
        """Seconds from the start (or systemd's restart) to ready, of the engine's last
        way to ready; None if the gateway did not see it begin (an adopted engine)."""
        return self._load_s.get(model_id)

    def _changed(self, old: Engine, new: Engine) -> None:
        if old.holds_place and not new.holds_place:
            self.last_release = self._clock()   # its GPU memory shows as free a bit later
        self._time_load(old, new)
        if new.state is EngineState.READY:
            self._failures.pop(new.model_id, None)
        elif new.state is EngineState.FAILED and old.state is not EngineState.FAILED:
            count = self._failures.get(new.model_id, (0, 0.0))[0] + 1
            backoff = RETRY_BACKOFF_S[min(count, len(RETRY_BACKOFF_S)) - 1]
            self._failures[new.model_id] = (count, self._clock() + backoff)
        for listener in list(self._listeners):
            listener(old, new)
        if new.state is not old.state:
            self._log_transition(old, new)
        if self._react is not None:
            self._react(old, new)

    def _time_load(self, old: Engine, new: Engine) -> None:
        """Before the subscribers hear of it: a ready event carries its load time."""
        if new.state is old.state:
            return
        model_id = new.model_id
        if new.state in COMING_STATES and old.state not in COMING_STATES:
            self._coming_since[model_id] = self._clock()
            self._load_s.pop(model_id, None)
        elif new.state is EngineState.READY:
            since = self._coming_since.pop(model_id, None)
            if since is None:
                self._load_s.pop(model_id, None)
            else:
                self._load_s[model_id] = self._clock() - since
        elif new.state not in COMING_STATES:
            self._coming_since.pop(model_id, None)

    def _log_transition(self, old: Engine, new: Engine) -> None:
        now = self._clock()
        since = self._state_since.get(new.model_id)
        self._state_since[new.model_id] = now
        # how long the unit took to start and the model to load: where a cold start went
        took = (f" after {(now - since) * 1000:.0f} ms" if since is not None
                and old.state in COMING_STATES else "")
        failure = new.failure
        why = failure.reason if failure and new.state in (
            EngineState.FAILED, EngineState.RESTARTING) else None
        log.info("%s: %s -> %s%s%s", new.model_id, old.state.value, new.state.value, took,
                 f" ({why})" if why else "")

    # -- waiters ---------------------------------------------------------------------

    async def wait_ready(self, model_id: str, limit: float) -> Engine:
        """The engine once ready; its failure, its stop, or the deadline otherwise."""
        engine = self._engines.get(model_id)
        if engine is None:
            raise EngineNotRunning(f"no engine for {model_id!r} is running or starting",
                                   model=model_id)
        if engine.state is EngineState.READY:
            return engine
        if engine.state is EngineState.FAILED:
            raise self.failed_error(model_id)
        if engine.state in (EngineState.STOPPING, EngineState.STOPPED):
            raise EngineNotRunning(f"the engine for {model_id!r} is {engine.state.value}",
                                   model=model_id)
        fut: asyncio.Future[Engine] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(model_id, []).append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), limit)
        except TimeoutError:
            raise self._late_error(model_id, limit) from None
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.get(model_id, []).remove(fut)

    def _late_error(self, model_id: str, limit: float) -> EngineFailed:
        engine = self._engines.get(model_id)
        why = ""
        if engine is not None and engine.restarting and engine.failure is not None:
            # the wait ran out while systemd restarted it: say why it is restarting
            why = (f": systemd is restarting it ({engine.failure.said()}; restarted "
                   f"{engine.restarts} time(s)). Logs: journalctl -u {engine.unit}")
        return EngineFailed(f"the engine for {model_id!r} was not ready within {limit:g}s"
                            f"{why}", model=model_id)

    def wake_waiters(self, engine: Engine) -> None:
        for fut in self._waiters.pop(engine.model_id, []):
            if not fut.done():
                fut.set_result(engine)

    def fail_waiters(self, model_id: str, error: GatewayError) -> None:
        for fut in self._waiters.pop(model_id, []):
            if not fut.done():
                fut.set_exception(error)

    def close(self) -> None:
        for fut in (f for futs in self._waiters.values() for f in futs):
            if not fut.done():
                fut.cancel()
