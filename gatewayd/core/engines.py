"""The engine state machine. Pure: events in, a new Engine out; no I/O, no clocks.

    stopped ──start──▶ starting ──unit active──▶ loading ──/health 200──▶ ready
       ▲                  │                        │  ▲                    │
       │                  │    start failure /     │  └─ new process ─┐    │ crash, OOM,
       │                  │    load timeout        │                  │    │ killed as hung
       │                  ▼                        ▼                  │    ▼
       │               failed ◀── systemd gives up (start limit) ── restarting
       │                  │                                           ▲
       │                  │            a crash while starting/loading ┘
       └── unit gone ◀── stopping ◀── stop (from any state)

Unit facts arrive as UnitChanged events built from systemd's PropertiesChanged
signals (ActiveState, SubState, MainPID, NRestarts, ExecMainCode/Status, Result),
so a crash is seen the moment systemd sees it. While systemd restarts an engine
(Restart=on-failure) the engine is *restarting*: it keeps its place, and whoever
waits for it waits on, as for a cold start. The process that died is remembered
(`dead_pid`): its own late signals (its "active" before the kill lands, its exit)
are never read as the restarted process's; only a new process running again
(another MainPID) moves it on to loading. Only systemd giving up (the start limit,
or a unit that does not restart) makes it failed.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace
from enum import StrEnum

from gatewayd.core.logs import FailureCause, failure_cause

CLD_EXITED, CLD_KILLED, CLD_DUMPED = 1, 2, 3


class EngineState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    FAILED = "failed"


# States in which an engine's unit exists and holds (or is about to hold) memory.
PLACE_STATES = frozenset({EngineState.STARTING, EngineState.LOADING, EngineState.READY,
                         EngineState.RESTARTING, EngineState.STOPPING})
# States whose waiters wait on: the engine is on its way to ready.
COMING_STATES = frozenset({EngineState.STARTING, EngineState.LOADING,
                           EngineState.RESTARTING})


def holds_place(state: EngineState, exit_unconfirmed: bool = False) -> bool:
    """The one definition of "holds one of the max_engines places": the unit exists and
    runs or will run again — starting, loading, ready, restarting (Restart=on-failure:
    its unit is still there), stopping — or a signal said it ended and systemd has not
    confirmed that yet."""
    return exit_unconfirmed or state in PLACE_STATES


@dataclass(frozen=True)
class Failure:
    """Why an engine last failed (or is being restarted), with the tail of its journal."""
    reason: str
    exit_code: int | None = None
    signal: int | None = None
    log_tail: tuple[str, ...] = ()
    # killed for want of memory: what it was thought to need and what was free (MiB)
    out_of_memory: bool = False
    memory: tuple[tuple[str, int | None], ...] = ()

    def describe(self) -> dict[str, object]:
        cause = self.cause
        return {"reason": self.reason, "exit_code": self.exit_code, "signal": self.signal,
                "cause": None if cause is None else {"code": cause.code, "text": cause.text},
                "log_tail": list(self.log_tail),
                **({"out_of_memory": True, **dict(self.memory)} if self.out_of_memory else {})}

    @property
    def cause(self) -> FailureCause | None:
        """What its last journal lines (or systemd's exit status) say, in a fixed sentence
        a caller may be told (core/logs.failure_cause); None: nothing known."""
        return failure_cause(self.log_tail, self.exit_code)

    def said(self) -> str:
        """The reason, and its cause where one is known."""
        cause = self.cause
        return self.reason if cause is None else f"{self.reason} ({cause.text})"

    @property
    def oom_kill_said(self) -> bool:
        """systemd's Result=oom-kill (cgroup v2) is in the reason (_exit_failure)."""
        return "(oom-kill)" in self.reason

    @property
    def kind(self) -> str:
        """A closed set for metrics: why a process ended."""
        if "(hung)" in self.reason:
            return "hung"
        if self.out_of_memory or self.oom_kill_said:
            return "oom"
        if self.signal is not None:
            return "signal"
        if self.exit_code is not None:
            return "exit"
        return "other"


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
    # A signal (not our stop) said the unit ended. Until systemd confirms it, the place
    # stays counted: a late or reordered signal must never let a start exceed max_engines.
    exit_unconfirmed: bool = False
    devices: tuple[str, ...] = ()       # the GPUs it was placed on (UUIDs); (): all / none
    # the LoRA adapters it loaded, in --lora's order: its requests' lora list is made of
    # them (core/variants.with_adapters); None: not known (then the configuration's)
    adapters: tuple[str, ...] | None = None
    # restarting: the process that ended (0: unknown). Its signals are its own, never
    # the restarted process's: only another MainPID running is the restart
    dead_pid: int = 0

    @property
    def restarting(self) -> bool:
        """systemd is starting it again (after a crash, or our kill of a hung one)."""
        return self.state is EngineState.RESTARTING

    @property
    def holds_place(self) -> bool:
        return holds_place(self.state, self.exit_unconfirmed)


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
    systemd will restart it (restarting)."""

    now: float
    seconds: float


@dataclass(frozen=True)
class OutOfMemory:
    """Its process was killed for want of memory (the kernel's OOM killer, or its unit's
    MemoryMax=) and the gateway stopped systemd's restart: failed, not restarted into
    the same wall. memory: what it needed and what was free, for the error."""

    now: float
    reason: str
    memory: tuple[tuple[str, int | None], ...] = ()


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
    """The tail of the engine's journal, read after a failure or a crash."""
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
         | Unresponsive | OutOfMemory | StopRequested | UnitGone | LogsRead | Reconciled)
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
                return _to(engine, EngineState.RESTARTING, now, ready_since=None,
                           dead_pid=engine.main_pid, failure=Failure(
                               f"did not answer /health for {seconds:g}s (hung): killed, "
                               "and systemd restarts it"))
            return engine
        case OutOfMemory(now, reason, memory):
            if s in (EngineState.STOPPED, EngineState.STOPPING):
                return engine
            last = engine.failure
            return _to(engine, EngineState.FAILED, now, main_pid=0, dead_pid=0,
                       ready_since=None, exit_unconfirmed=False, failure=Failure(
                           reason, last.exit_code if last else None,
                           last.signal if last else None, out_of_memory=True,
                           memory=memory))
        case StopRequested(now):
            if s is EngineState.STOPPED:
                return engine
            return _to(engine, EngineState.STOPPING, now)
        case UnitGone(now):   # our stop is complete: the unit is gone, for certain
            if s is EngineState.FAILED:
                return replace(engine, main_pid=0, exit_unconfirmed=False)
            return _to(engine, EngineState.STOPPED, now, main_pid=0, exit_unconfirmed=False)
        case LogsRead(lines):
            if engine.failure is None:
                return engine
            return replace(engine, failure=replace(engine.failure, log_tail=lines))
        case UnitChanged():
            new = _unit_changed(engine, event)
            if engine.holds_place and not new.holds_place:
                # a signal alone never frees a place: it may be late or out of order (the
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
    if (s in (EngineState.FAILED, EngineState.RESTARTING) and failure is not None
            and ev.exec_code is not None and failure.exit_code is None
            and failure.signal is None and failure.reason == "stopped unexpectedly"):
        # the Service interface's signal (exit status) came after the Unit's
        text, code, sig = exit_reason(ev.exec_code, ev.exec_status)
        changes["failure"] = replace(failure, reason=text, exit_code=code, signal=sig)

    if s is EngineState.STOPPING:
        if active in ("inactive", "failed"):
            return _to(engine, EngineState.STOPPED, ev.now, main_pid=0)
        return _with(engine, changes)
    if s is EngineState.RESTARTING:
        return _while_restarting(engine, ev, changes)
    if s is EngineState.FAILED and active in ("deactivating", "inactive", "failed"):
        # a failed engine being stopped or collected stays failed, with its reason
        if active != "deactivating":
            changes["main_pid"] = 0   # no process any more
        return _with(engine, changes)
    if s is not EngineState.FAILED and (_ended_to_restart(s, active, sub, ev.result)
                                        or _failed_maybe_restarting(active, ev.result)):
        # its process ended and systemd starts it again: a wait, not a failure
        changes.pop("main_pid", None)
        if active == "failed":
            changes["exit_unconfirmed"] = True
        return _to(engine, EngineState.RESTARTING, ev.now, main_pid=0, ready_since=None,
                   dead_pid=engine.main_pid, failure=_exit_failure(ev), **changes)
    if active == "failed" or (active == "inactive" and ev.result not in (None, "success")):
        changes.pop("main_pid", None)
        return _to(engine, EngineState.FAILED, ev.now, main_pid=0, ready_since=None,
                   failure=_exit_failure(ev), **changes)
    if s is EngineState.STARTING and active in ("inactive", "deactivating"):
        # a unit being created reports inactive/dead before activating; a deactivating
        # one is the previous instance's signal arriving late (it was stopped and gone
        # before this start was sent)
        return _with(engine, changes)
    if active == "inactive":
        return _to(engine, EngineState.STOPPED, ev.now, main_pid=0, ready_since=None, **changes)
    if active == "deactivating":
        return _to(engine, EngineState.STOPPING, ev.now, **changes)
    if active == "activating":
        if s in (EngineState.STOPPED, EngineState.FAILED, EngineState.STARTING):
            return _to(engine, EngineState.STARTING, ev.now, **changes)
        return _with(engine, changes)
    restarted_unseen = s is EngineState.READY and pid_changed and bool(engine.main_pid)
    # a failed engine runs again as a new process (started behind our back): the unit's
    # "active" repeated while we stop a timed-out one (its stop job changes other
    # properties) is not that (a listing, Reconciled, sees any other)
    failed_runs_again = s is EngineState.FAILED and (pid_changed or not engine.main_pid)
    if active == "active" and (restarted_unseen or failed_runs_again or s in (
            EngineState.STOPPED, EngineState.STARTING)):
        # running but not necessarily loaded: /health decides when it is ready
        return _to(engine, EngineState.LOADING, ev.now, ready_since=None, **changes)
    return _with(engine, changes)


def _with(engine: Engine, changes: dict[str, object]) -> Engine:
    return replace(engine, **changes) if changes else engine  # type: ignore[arg-type]


def _ended_to_restart(s: EngineState, active: str | None, sub: str | None,
                      result: str | None) -> bool:
    """systemd says the process ended and a restart follows: auto-restart, or (a main
    process that failed while others of its cgroup still run) deactivating with a
    failed result first. A starting engine's "deactivating" is a late signal of the
    instance before it (see below), never this."""
    if active == "activating" and sub == "auto-restart":
        return True
    return (active == "deactivating" and s is not EngineState.STARTING
            and result not in (None, "success"))


def _failed_maybe_restarting(active: str | None, result: str | None) -> bool:
    """"failed" that may be followed by a restart: systemd 252 passes through failed on
    its way to auto-restart (254 names it failed-before-auto-restart), and says the same
    when it gives up at the start limit (Result keeps the last process's). Taken as a
    restart, to be confirmed with systemd (exit_unconfirmed): its auto-restart signal,
    or a listing, decides."""
    return active == "failed" and result not in (None, "success", "start-limit-hit")


def _exit_failure(ev: UnitChanged) -> Failure:
    text, code, sig = exit_reason(ev.exec_code, ev.exec_status)
    if ev.result and ev.result not in ("exit-code", "signal", "core-dump", "success"):
        text = f"{text} ({ev.result})"
    return Failure(text, code, sig)


def _while_restarting(engine: Engine, ev: UnitChanged, changes: dict[str, object]) -> Engine:
    active, sub = ev.active_state, ev.sub_state
    if _failed_maybe_restarting(active, ev.result):
        # the restarted process failed too, or systemd gave up: asked (exit_unconfirmed)
        if engine.main_pid not in (0, engine.dead_pid):
            changes.update(dead_pid=engine.main_pid, failure=_exit_failure(ev))
        changes.update(main_pid=0, exit_unconfirmed=True)
        return _with(engine, changes)
    if active == "failed":
        changes.pop("main_pid", None)
        return _to(engine, EngineState.FAILED, ev.now, main_pid=0, dead_pid=0,
                   failure=_gave_up(changes.pop("failure", engine.failure), ev.result,
                                    engine.restarts), **changes)
    if active == "inactive":
        # systemd 252's restart job passes through inactive (its stop half) before its
        # start; a stop by hand ends here too, and the reconciler's listing (inactive, or
        # the unit gone) then says so
        changes["main_pid"] = 0
        return _with(engine, changes)
    pid = changes.get("main_pid", engine.main_pid)
    if active == "active" and (pid != engine.dead_pid or not pid):
        # a new process runs (the dead one's own "active", before our kill lands, is
        # not that): loaded or not, /health decides when it is ready
        return _to(engine, EngineState.LOADING, ev.now, dead_pid=0, **changes)
    if _ended_to_restart(engine.state, active, sub, ev.result):
        if engine.main_pid not in (0, engine.dead_pid):
            # the restarted process ended too, before it was ready: its own reason
            changes.update(dead_pid=engine.main_pid, failure=_exit_failure(ev))
        changes["main_pid"] = 0
    return _with(engine, changes)


def _gave_up(failure: object, result: str | None, restarts: int) -> Failure:
    """The failure once systemd stops restarting the engine."""
    last = failure if isinstance(failure, Failure) else Failure("stopped unexpectedly")
    why = " (start limit hit)" if result == "start-limit-hit" else ""
    return replace(last, reason=f"{last.reason}; systemd gave up restarting it after "
                                f"{restarts} restart(s){why}")


def _reconciled(engine: Engine, ev: Reconciled) -> Engine:
    confirming = engine.exit_unconfirmed
    if confirming:   # this is the confirmation, whatever it says
        engine = replace(engine, exit_unconfirmed=False)
    s = engine.state
    if s is EngineState.RESTARTING:
        return _reconciled_restarting(engine, ev, confirming)
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
        # going away, not gone: it keeps its place (and a new start waits) until systemd
        # says inactive or the unit is gone
        return _to(engine, EngineState.STOPPING, ev.now, ready_since=None)
    if s is EngineState.FAILED:
        return engine
    if ev.active_state == "failed":
        return _to(engine, EngineState.FAILED, ev.now, main_pid=0, ready_since=None,
                   failure=Failure("stopped unexpectedly"))
    if s is EngineState.STOPPED:
        return engine
    return _to(engine, EngineState.STOPPED, ev.now, main_pid=0, ready_since=None)


def _reconciled_restarting(engine: Engine, ev: Reconciled, confirming: bool) -> Engine:
    """A listing while systemd restarts the engine: activating (the restart pending or
    its start job) and deactivating (the rest of the cgroup going) are that restart.
    confirming a "failed": failed, or the unit already collected, is systemd giving up."""
    if ev.active_state in ("active", "reloading") and ev.main_pid \
            and ev.main_pid != engine.dead_pid:
        return _to(engine, EngineState.LOADING, ev.now, main_pid=ev.main_pid, dead_pid=0,
                   restarts=ev.n_restarts)
    if ev.active_state in RUNNING_STATES or ev.active_state == "deactivating":
        return replace(engine, restarts=ev.n_restarts) \
            if ev.n_restarts != engine.restarts else engine
    if ev.active_state == "failed" or (confirming and ev.active_state is None):
        return _to(engine, EngineState.FAILED, ev.now, main_pid=0, dead_pid=0,
                   failure=_gave_up(engine.failure, None, ev.n_restarts or engine.restarts))
    return _to(engine, EngineState.STOPPED, ev.now, main_pid=0, dead_pid=0)
