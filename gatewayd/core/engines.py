"""The engine state machine. Pure: events in, a new Engine out; no I/O, no clocks.

    stopped ──start──▶ starting ──unit active──▶ loading ──/health 200──▶ ready
       ▲                  │                        │                       │
       │                  └──────── crash / start failure / load timeout ─┴─▶ failed
       │                                                                        │
       └──── unit gone ◀── stopping ◀── stop (from any state) ◀────────────────┘
                                              systemd restart: failed ─▶ starting/loading

Unit facts arrive as UnitChanged events built from systemd's PropertiesChanged
signals (ActiveState, SubState, MainPID, NRestarts, ExecMainCode/Status), so a
crash is seen the moment systemd sees it, and a systemd restart shows up as
failed (restarting) → starting → loading → ready with the restart counted.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace
from enum import StrEnum

CLD_EXITED, CLD_KILLED, CLD_DUMPED = 1, 2, 3


class EngineState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


# States in which an engine's unit exists and holds (or is about to hold) memory.
SLOT_STATES = frozenset({EngineState.STARTING, EngineState.LOADING, EngineState.READY,
                         EngineState.STOPPING})


def holds_slot(state: EngineState, restarting: bool, exit_unconfirmed: bool = False) -> bool:
    """The one definition of "holds one of the max_engines slots": the unit exists and
    runs or will run again — starting, loading, ready, stopping, or failed while
    systemd restarts it (Restart=on-failure: its unit is still there) — or a signal
    said it ended and systemd has not confirmed that yet."""
    return (exit_unconfirmed or state in SLOT_STATES
            or (state is EngineState.FAILED and restarting))


@dataclass(frozen=True)
class Failure:
    """Why an engine last failed, with the tail of its journal."""
    reason: str
    exit_code: int | None = None
    signal: int | None = None
    restarting: bool = False
    log_tail: tuple[str, ...] = ()

    def describe(self) -> dict[str, object]:
        return {"reason": self.reason, "exit_code": self.exit_code, "signal": self.signal,
                "restarting": self.restarting, "log_tail": list(self.log_tail)}


@dataclass(frozen=True)
class Engine:
    """One engine's state in the state machine (an immutable snapshot; events make new ones)."""
    model_id: str
    unit: str
    socket: str
    state: EngineState = EngineState.STOPPED
    main_pid: int = 0
    restarts: int = 0
    ready_since: float | None = None    # monotonic time it last became ready
    failure: Failure | None = None
    adopted: bool = False
    # A signal (not our stop) said the unit ended. Until systemd confirms it, the slot
    # stays counted: a late or reordered signal must never let a start exceed max_engines.
    exit_unconfirmed: bool = False
    devices: tuple[str, ...] = ()       # the GPUs it was placed on (UUIDs); (): all / none

    @property
    def restarting(self) -> bool:
        """Failed, and systemd is about to start it again."""
        return (self.state is EngineState.FAILED and self.failure is not None
                and self.failure.restarting)

    @property
    def holds_slot(self) -> bool:
        return holds_slot(self.state, self.restarting, self.exit_unconfirmed)


# -- events ----------------------------------------------------------------------


@dataclass(frozen=True)
class StartRequested:
    """The gateway asked systemd to start the engine's unit."""
    now: float


@dataclass(frozen=True)
class UnitChanged:
    """What systemd says about the unit (only the fields the signal carried)."""

    now: float
    active_state: str | None = None
    sub_state: str | None = None
    main_pid: int | None = None
    n_restarts: int | None = None
    result: str | None = None
    exec_code: int | None = None
    exec_status: int | None = None


@dataclass(frozen=True)
class HealthReady:
    """The engine answered its health check: it serves."""
    now: float


@dataclass(frozen=True)
class StartFailed:
    """The start could not be issued (systemd refused it, the unit could not be made)."""
    now: float
    reason: str


@dataclass(frozen=True)
class LoadTimedOut:
    """The engine did not become ready within its load timeout."""
    now: float
    seconds: float


@dataclass(frozen=True)
class Unresponsive:
    """A ready engine did not answer /health for a while: it is being killed, and
    systemd will restart it."""

    now: float
    seconds: float


@dataclass(frozen=True)
class StopRequested:
    """The gateway asked systemd to stop the engine's unit."""
    now: float


@dataclass(frozen=True)
class UnitGone:
    """systemd no longer knows the unit (stopped and garbage-collected)."""
    now: float


@dataclass(frozen=True)
class LogsRead:
    """The tail of the engine's journal, read after a failure."""
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Reconciled:
    """What a listing of systemd's units says, when no start or stop is under way and
    no signal arrived meanwhile: the whole truth, not a change. active_state None: no
    such unit. Corrects a state that lost or misread a signal."""

    now: float
    active_state: str | None
    main_pid: int = 0
    n_restarts: int = 0


Event = (StartRequested | UnitChanged | HealthReady | StartFailed | LoadTimedOut
         | Unresponsive | StopRequested | UnitGone | LogsRead | Reconciled)
RUNNING_STATES = frozenset({"active", "activating", "reloading"})


def exit_reason(code: int | None, status: int | None) -> tuple[str, int | None, int | None]:
    """(text, exit code, signal) from systemd's ExecMainCode/ExecMainStatus."""
    if code == CLD_EXITED:
        return f"exited with status {status}", status, None
    if code in (CLD_KILLED, CLD_DUMPED) and status is not None:
        try:
            name = signal.Signals(status).name
        except ValueError:
            name = f"signal {status}"
        dumped = " (core dumped)" if code == CLD_DUMPED else ""
        return f"killed by {name}{dumped}", None, status
    return "stopped unexpectedly", None, None


def _to(engine: Engine, state: EngineState, now: float, **changes: object) -> Engine:
    if state is engine.state and not changes:
        return engine
    return replace(engine, state=state, **changes)  # type: ignore[arg-type]


def apply(engine: Engine, event: Event) -> Engine:
    """The engine after event. Events that do not apply in a state change nothing."""
    s = engine.state
    match event:
        case StartRequested(now):
            if s in (EngineState.STOPPED, EngineState.FAILED):
                return _to(engine, EngineState.STARTING, now, failure=None, main_pid=0)
            return engine
        case HealthReady(now):
            if s in (EngineState.STARTING, EngineState.LOADING):
                return _to(engine, EngineState.READY, now, ready_since=now, failure=None)
            return engine
        case StartFailed(now, reason):
            if s in (EngineState.STARTING, EngineState.LOADING, EngineState.STOPPED):
                return _to(engine, EngineState.FAILED, now, failure=Failure(reason))
            return engine
        case LoadTimedOut(now, seconds):
            if s in (EngineState.STARTING, EngineState.LOADING):
                return _to(engine, EngineState.FAILED, now, failure=Failure(
                    f"not ready after {seconds:g}s (load timeout)"))
            return engine
        case Unresponsive(now, seconds):
            if s is EngineState.READY:
                return _to(engine, EngineState.FAILED, now, ready_since=None, failure=Failure(
                    f"did not answer /health for {seconds:g}s (hung): killed, and systemd "
                    "restarts it", restarting=True))
            return engine
        case StopRequested(now):
            if s is EngineState.STOPPED:
                return engine
            return _to(engine, EngineState.STOPPING, now)
        case UnitGone(now):   # our stop is complete: the unit is gone, for certain
            if s is EngineState.FAILED:
                failure = engine.failure
                if failure is not None and failure.restarting:
                    failure = replace(failure, restarting=False)
                return replace(engine, failure=failure, main_pid=0, exit_unconfirmed=False)
            return _to(engine, EngineState.STOPPED, now, main_pid=0, exit_unconfirmed=False)
        case LogsRead(lines):
            if engine.failure is None:
                return engine
            return replace(engine, failure=replace(engine.failure, log_tail=lines))
        case UnitChanged():
            new = _unit_changed(engine, event)
            if engine.holds_slot and not new.holds_slot:
                # a signal alone never frees a slot: it may be late or out of order (the
                # creation's "inactive" can even arrive while our stop waits its turn);
                # our stop's end (UnitGone) or systemd's answer (Reconciled) does
                new = replace(new, exit_unconfirmed=True)
            return new
        case Reconciled():
            return _reconciled(engine, event)
    raise TypeError(f"unknown event {event!r}")


def _unit_changed(engine: Engine, ev: UnitChanged) -> Engine:
    changes: dict[str, object] = {}
    if ev.n_restarts is not None and ev.n_restarts != engine.restarts:
        changes["restarts"] = ev.n_restarts
    pid_changed = bool(ev.main_pid) and ev.main_pid != engine.main_pid
    if ev.main_pid:
        changes["main_pid"] = ev.main_pid
    s, active, sub = engine.state, ev.active_state, ev.sub_state
    failure = engine.failure
    if (s is EngineState.FAILED and failure is not None and ev.exec_code is not None
            and failure.exit_code is None and failure.signal is None
            and failure.reason == "stopped unexpectedly"):
        # the Service interface's signal (exit status) came after the Unit's
        text, code, sig = exit_reason(ev.exec_code, ev.exec_status)
        changes["failure"] = replace(failure, reason=text, exit_code=code, signal=sig)

    if s is EngineState.STOPPING:
        if active in ("inactive", "failed"):
            return _to(engine, EngineState.STOPPED, ev.now, main_pid=0)
        return replace(engine, **changes) if changes else engine  # type: ignore[arg-type]

    if s is EngineState.FAILED and active in ("deactivating", "inactive", "failed"):
        # a failed engine being stopped or collected stays failed, with its reason
        settled = changes.get("failure", failure)
        if isinstance(settled, Failure) and settled.restarting and active != "deactivating":
            changes["failure"] = replace(settled, restarting=False)
        if active != "deactivating":
            changes["main_pid"] = 0   # no process any more
        return replace(engine, **changes) if changes else engine  # type: ignore[arg-type]
    if active == "activating" and sub == "auto-restart":
        if s is EngineState.FAILED and failure is not None and failure.restarting:
            # we know why already (we killed it as hung): keep that reason
            return replace(engine, **changes) if changes else engine  # type: ignore[arg-type]
        text, code, sig = exit_reason(ev.exec_code, ev.exec_status)
        return _to(engine, EngineState.FAILED, ev.now, main_pid=0, ready_since=None,
                   failure=Failure(text, code, sig, restarting=True), **changes)
    if active == "failed" or (active == "inactive" and ev.result not in (None, "success")):
        text, code, sig = exit_reason(ev.exec_code, ev.exec_status)
        if ev.result and ev.result not in ("exit-code", "signal", "core-dump", "success"):
            text = f"{text} ({ev.result})"
        return _to(engine, EngineState.FAILED, ev.now, main_pid=0, ready_since=None,
                   failure=Failure(text, code, sig), **changes)
    if s is EngineState.STARTING and active in ("inactive", "deactivating"):
        # a unit being created reports inactive/dead before activating; a deactivating
        # one is the previous instance's signal arriving late (it was stopped and gone
        # before this start was sent)
        return replace(engine, **changes) if changes else engine  # type: ignore[arg-type]
    if active == "inactive":
        return _to(engine, EngineState.STOPPED, ev.now, main_pid=0, ready_since=None, **changes)
    if active == "deactivating":
        return _to(engine, EngineState.STOPPING, ev.now, **changes)
    if active == "activating":
        if s in (EngineState.STOPPED, EngineState.FAILED, EngineState.STARTING):
            return _to(engine, EngineState.STARTING, ev.now, **changes)
        return replace(engine, **changes) if changes else engine  # type: ignore[arg-type]
    restarted_unseen = s is EngineState.READY and pid_changed and bool(engine.main_pid)
    # a failed engine runs again when systemd restarts it, or as a new process: the unit's
    # "active" repeated while we stop a timed-out one (its stop job changes other
    # properties) is not a restart (a listing, Reconciled, sees any other)
    failed_runs_again = s is EngineState.FAILED and (
        (failure is not None and failure.restarting) or pid_changed or not engine.main_pid)
    if active == "active" and (restarted_unseen or failed_runs_again or s in (
            EngineState.STOPPED, EngineState.STARTING)):
        # running but not necessarily loaded: /health decides when it is ready
        return _to(engine, EngineState.LOADING, ev.now, ready_since=None, **changes)
    return replace(engine, **changes) if changes else engine  # type: ignore[arg-type]


def _reconciled(engine: Engine, ev: Reconciled) -> Engine:
    if engine.exit_unconfirmed:   # this is the confirmation, whatever it says
        engine = replace(engine, exit_unconfirmed=False)
    s = engine.state
    if ev.active_state in RUNNING_STATES:
        pid = ev.main_pid or engine.main_pid
        if s in (EngineState.READY, EngineState.LOADING) and (
                not engine.main_pid or not ev.main_pid or ev.main_pid == engine.main_pid):
            return replace(engine, main_pid=pid, restarts=ev.n_restarts) \
                if (pid, ev.n_restarts) != (engine.main_pid, engine.restarts) else engine
        # running, whatever we thought (stopped, stopping, failed, or a new process):
        # loaded or not, /health decides when it is ready
        return _to(engine, EngineState.LOADING, ev.now, main_pid=pid, ready_since=None,
                   restarts=ev.n_restarts, failure=None)
    if ev.active_state == "deactivating":
        # going away, not gone: it keeps its slot (and a new start waits) until systemd
        # says inactive or the unit is gone
        return _to(engine, EngineState.STOPPING, ev.now, ready_since=None)
    if s is EngineState.FAILED:
        failure = engine.failure
        if failure is not None and failure.restarting:
            return replace(engine, failure=replace(failure, restarting=False), main_pid=0)
        return engine
    if ev.active_state == "failed":
        return _to(engine, EngineState.FAILED, ev.now, main_pid=0, ready_since=None,
                   failure=Failure("stopped unexpectedly"))
    if s is EngineState.STOPPED:
        return engine
    return _to(engine, EngineState.STOPPED, ev.now, main_pid=0, ready_since=None)
