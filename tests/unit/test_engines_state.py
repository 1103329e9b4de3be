"""The engine state machine, driven by the events systemd and the health probe produce."""

from __future__ import annotations

import signal

import pytest

from gatewayd.core.engines import (
    CLD_EXITED,
    CLD_KILLED,
    Engine,
    EngineState,
    Event,
    HealthReady,
    LoadTimedOut,
    LogsRead,
    Reconciled,
    StartFailed,
    StartRequested,
    StopRequested,
    UnitChanged,
    UnitGone,
    Unresponsive,
    apply,
)

S = EngineState


def run(*events: Event, start: EngineState = S.STOPPED) -> Engine:
    engine = Engine("m", "llm-engine-m.service", "/run/llm-engine-m/engine.sock", state=start)
    for event in events:
        engine = apply(engine, event)
    return engine


def unit(active: str, sub: str = "", **kw: object) -> UnitChanged:
    return UnitChanged(1.0, active_state=active, sub_state=sub, **kw)  # type: ignore[arg-type]


def test_happy_path_start_to_ready() -> None:
    engine = run(StartRequested(0.0), unit("inactive", "dead"), unit("activating", "start"),
                 unit("active", "running", main_pid=42), HealthReady(2.0))
    assert engine.state is S.READY and engine.main_pid == 42 and engine.ready_since == 2.0


@pytest.mark.parametrize("start,event,expected", [
    (S.STOPPED, HealthReady(1), S.STOPPED),          # health from a stopped engine: ignored
    (S.READY, StartRequested(1), S.READY),           # a second start changes nothing
    (S.LOADING, LoadTimedOut(1, 300), S.FAILED),
    (S.READY, LoadTimedOut(1, 300), S.READY),
    (S.STARTING, StartFailed(1, "no such file"), S.FAILED),
    (S.READY, StopRequested(1), S.STOPPING),
    (S.STOPPING, unit("inactive", "dead"), S.STOPPED),
    (S.STOPPING, unit("failed", "failed"), S.STOPPED),  # killed by the stop: not a failure
    (S.STOPPING, unit("active", "running"), S.STOPPING),
    (S.READY, unit("deactivating", "stop-sigterm"), S.STOPPING),
    (S.READY, unit("inactive", "dead"), S.STOPPED),  # stopped behind our back
    (S.STARTING, unit("inactive", "dead"), S.STARTING),  # unit being created
    (S.FAILED, StartRequested(1), S.STARTING),
    (S.READY, UnitGone(1), S.STOPPED),
])
def test_transitions(start: EngineState, event: Event, expected: EngineState) -> None:
    assert run(event, start=start).state is expected


def test_crash_and_systemd_restart_is_counted() -> None:
    engine = run(StartRequested(0), unit("active", "running", main_pid=42), HealthReady(1))
    engine = apply(engine, unit("activating", "auto-restart", exec_code=CLD_KILLED,
                                exec_status=signal.SIGKILL, n_restarts=0))
    assert engine.state is S.RESTARTING and engine.holds_place and engine.restarting
    assert engine.failure is not None
    assert engine.failure.reason == "killed by SIGKILL" and engine.failure.signal == 9
    engine = apply(engine, unit("activating", "start", n_restarts=1, main_pid=43))
    assert engine.state is S.RESTARTING and engine.restarts == 1   # the restart's start job
    engine = apply(engine, unit("active", "running"))
    assert engine.state is S.LOADING and engine.main_pid == 43
    engine = apply(engine, HealthReady(5))
    assert engine.state is S.READY and engine.main_pid == 43 and engine.failure is None


def test_one_kill_is_one_restart_whatever_order_its_signals_come_in() -> None:
    """Killed as hung: the dead process's own late "active" (the kill not landed yet)
    and its exit are its own; the state goes ready → restarting → loading → ready."""
    ready = run(StartRequested(0), unit("active", "running", main_pid=42), HealthReady(1))
    seen = [ready.state]
    engine = ready
    for event in (Unresponsive(2, 15), unit("active", "running"),
                  unit("active", "running", main_pid=42),
                  UnitChanged(3, main_pid=0, exec_code=CLD_KILLED, exec_status=9),
                  unit("activating", "auto-restart", exec_code=CLD_KILLED, exec_status=9),
                  unit("activating", "start", n_restarts=1),
                  UnitChanged(4, main_pid=43), unit("active", "running"), HealthReady(5)):
        engine = apply(engine, event)
        if engine.state is not seen[-1]:
            seen.append(engine.state)
    assert seen == [S.READY, S.RESTARTING, S.LOADING, S.READY]
    assert engine.main_pid == 43 and engine.restarts == 1


def test_a_crash_with_processes_left_in_the_cgroup_is_a_restart_not_a_stop() -> None:
    """The main process died; systemd stops the rest of its cgroup (deactivating, with a
    failed result) before the auto-restart."""
    ready = run(StartRequested(0), unit("active", "running", main_pid=42), HealthReady(1))
    going = apply(ready, unit("deactivating", "stop-sigterm", result="signal",
                              exec_code=CLD_KILLED, exec_status=11))
    assert going.state is S.RESTARTING and going.failure is not None
    assert going.failure.reason == "killed by SIGSEGV"
    assert apply(going, unit("activating", "auto-restart")).state is S.RESTARTING
    # a stop by hand (no failed result) is still a stop
    assert apply(ready, unit("deactivating", "stop-sigterm", result="success")).state \
        is S.STOPPING


def test_the_start_limit_ends_a_restart_in_failed_with_both_reasons() -> None:
    engine = run(StartRequested(0), unit("active", "running", main_pid=42),
                 unit("activating", "auto-restart", exec_code=CLD_EXITED, exec_status=3))
    assert engine.state is S.RESTARTING
    # the restarted process dies too, before it is ready: its own exit is the reason
    engine = apply(engine, unit("activating", "start", main_pid=43, n_restarts=1))
    engine = apply(engine, unit("activating", "auto-restart", exec_code=CLD_EXITED,
                                exec_status=4))
    assert engine.state is S.RESTARTING and engine.failure is not None
    assert engine.failure.reason == "exited with status 4" and engine.dead_pid == 43
    failed = apply(engine, unit("failed", "failed", result="start-limit-hit",
                                exec_code=CLD_EXITED, exec_status=4))
    assert failed.state is S.FAILED and not failed.restarting and failed.failure is not None
    assert failed.failure.reason == ("exited with status 4; systemd gave up restarting it "
                                     "after 1 restart(s) (start limit hit)")
    assert failed.holds_place and failed.exit_unconfirmed   # until systemd confirms it


def test_systemd_252s_failed_on_the_way_to_auto_restart_is_a_restart_it_confirms() -> None:
    """systemd 252 signals "failed" before "auto-restart" (and the same "failed", with the
    last process's result, when it gives up at the start limit): a restart until systemd,
    asked, says otherwise."""
    ready = run(StartRequested(0), unit("active", "running", main_pid=42), HealthReady(1))
    failed = apply(ready, unit("failed", "failed", result="signal", exec_code=CLD_KILLED,
                               exec_status=9))
    assert failed.state is S.RESTARTING and failed.exit_unconfirmed   # asked
    assert failed.failure is not None and failed.failure.reason == "killed by SIGKILL"
    restarting = apply(failed, unit("activating", "auto-restart", result="signal"))
    assert restarting.state is S.RESTARTING
    confirmed = apply(restarting, Reconciled(2, "activating", n_restarts=0))
    assert confirmed.state is S.RESTARTING and not confirmed.exit_unconfirmed
    for listed in ("failed", None):    # systemd gave up (the unit may be collected already)
        gave_up = apply(failed, Reconciled(2, listed, n_restarts=4))
        assert gave_up.state is S.FAILED and gave_up.failure is not None
        assert gave_up.failure.reason == ("killed by SIGKILL; systemd gave up restarting it "
                                          "after 4 restart(s)")
    # a listing that is no confirmation (nothing asked) finding the unit gone: stopped
    assert apply(confirmed, Reconciled(3, None)).state is S.STOPPED
    # 252's restart job: its stop half says inactive, then its start activating
    walk = [confirmed := apply(confirmed, event) for event in (
        unit("inactive", "dead", result="signal"), unit("activating", "start", main_pid=43),
        unit("active", "running"))]
    assert [e.state for e in walk] == [S.RESTARTING, S.RESTARTING, S.LOADING]
    assert walk[-1].main_pid == 43


def test_a_listing_during_a_restart_waits_for_a_new_process() -> None:
    killed = run(StartRequested(0), unit("active", "running", main_pid=42), HealthReady(1),
                 Unresponsive(2, 15))
    assert apply(killed, Reconciled(3, "active", main_pid=42)).state is S.RESTARTING
    assert apply(killed, Reconciled(3, "activating")).state is S.RESTARTING
    running = apply(killed, Reconciled(3, "active", main_pid=43, n_restarts=1))
    assert running.state is S.LOADING and running.main_pid == 43 and running.restarts == 1
    assert apply(killed, Reconciled(3, "failed")).state is S.FAILED
    assert apply(killed, Reconciled(3, None)).state is S.STOPPED


def test_exit_status_arriving_after_the_state_fills_in_the_reason() -> None:
    engine = run(StartRequested(0), unit("active", "running", main_pid=42))
    engine = apply(engine, unit("failed", "failed"))
    assert engine.failure is not None and engine.failure.reason == "stopped unexpectedly"
    engine = apply(engine, UnitChanged(2, exec_code=CLD_EXITED, exec_status=1))
    assert engine.failure is not None and engine.failure.reason == "exited with status 1"
    assert engine.failure.exit_code == 1
    assert engine.holds_place and engine.exit_unconfirmed   # until systemd confirms it
    engine = apply(engine, Reconciled(3, "failed"))
    assert engine.state is S.FAILED and engine.failure is not None
    assert engine.failure.exit_code == 1
    assert not engine.holds_place


def test_a_listing_that_finds_the_unit_deactivating_keeps_the_place_taken() -> None:
    """Stopped by hand (`systemctl stop`), seen by the reconciler mid-stop: the unit still
    exists, so its place stays taken and no new start may be sent yet."""
    ready = run(StartRequested(0), unit("active", "running", main_pid=42), HealthReady(1))
    going = apply(ready, Reconciled(2, "deactivating", main_pid=42))
    assert going.state is S.STOPPING and going.holds_place
    gone = apply(going, Reconciled(3, None))
    assert gone.state is S.STOPPED and not gone.holds_place


def test_a_late_deactivating_of_the_previous_instance_leaves_a_start_alone() -> None:
    engine = run(StartRequested(0), unit("deactivating", "stop-sigterm"),
                 unit("inactive", "dead"))
    assert engine.state is S.STARTING


def test_an_end_we_did_not_ask_for_keeps_the_place_until_systemd_confirms_it() -> None:
    ready = run(StartRequested(0), unit("active", "running", main_pid=42), HealthReady(1))
    reordered = apply(ready, unit("inactive", "dead"))   # e.g. the creation's, arriving late
    assert reordered.state is S.STOPPED and reordered.holds_place
    running = apply(reordered, Reconciled(2, "active", main_pid=42))
    assert running.state is S.LOADING and not running.exit_unconfirmed and running.holds_place
    gone = apply(reordered, Reconciled(2, None))
    assert gone.state is S.STOPPED and not gone.holds_place
    ours = apply(apply(ready, StopRequested(3)), unit("inactive", "dead"))
    assert ours.state is S.STOPPED and ours.holds_place   # until our stop sees the unit gone
    assert not apply(ours, UnitGone(4)).holds_place


def test_restart_we_did_not_see_fails_back_to_loading() -> None:
    engine = run(StartRequested(0), unit("active", "running", main_pid=42), HealthReady(1))
    engine = apply(engine, unit("active", "running", main_pid=77))
    assert engine.state is S.LOADING and engine.main_pid == 77


def test_failed_start_limit_result_is_named() -> None:
    engine = run(StartRequested(0), unit("failed", "failed", result="start-limit-hit"))
    assert engine.failure is not None and "start-limit-hit" in engine.failure.reason


def test_logs_attach_to_a_failure_only() -> None:
    assert run(LogsRead(("x",))).failure is None
    engine = run(StartRequested(0), StartFailed(1, "boom"), LogsRead(("line 1", "line 2")))
    assert engine.failure is not None and engine.failure.log_tail == ("line 1", "line 2")


def test_a_stopped_engine_is_not_restarting_whatever_its_last_failure_said() -> None:
    crashed = run(StartRequested(0), unit("active", "running", main_pid=42),
                  unit("activating", "auto-restart", exec_code=CLD_KILLED, exec_status=9))
    assert crashed.state is S.RESTARTING and crashed.restarting
    stopping = apply(crashed, StopRequested(1))
    assert stopping.state is S.STOPPING and not stopping.restarting


def test_a_load_timeout_stays_failed_while_its_unit_is_stopped() -> None:
    """Past load_timeout_s the engine is failed and its unit stopped; systemd repeats
    ActiveState=active as the stop job is queued: that is not a restart. A new process
    (a new MainPID) is."""
    loading = run(StartRequested(0), unit("active", "running", main_pid=42))
    failed = apply(loading, LoadTimedOut(5, 4))
    assert failed.state is S.FAILED
    assert apply(failed, unit("active", "running")).state is S.FAILED
    assert apply(failed, unit("active", "running", main_pid=42)).state is S.FAILED
    stopped = apply(apply(failed, unit("deactivating", "stop-sigterm")),
                    unit("inactive", "dead"))
    assert stopped.state is S.FAILED and "load timeout" in (stopped.failure.reason
                                                            if stopped.failure else "")
    assert stopped.main_pid == 0
    assert apply(failed, unit("active", "running", main_pid=77)).state is S.LOADING
