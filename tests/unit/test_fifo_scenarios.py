"""First come, first served across models: fixed scenarios where the model at the head of
the line for room cannot use a place yet and a model behind it could take one.

The line (gatewayd/service/room_line.py) orders the models waiting for room by their first
request; the scheduler lets a model behind the head take only room beyond what the models
ahead need (core/scheduler.plan_start's `ahead`). In the model test's scenarios the head
is also the first loader to look again after every change, so the line's order is kept
by the event loop's order alone: these make the head wait for something of its own (its
previous engine still stopping), during which a model behind it must not evict an engine
to go first. tests/mutants.py (no-fifo-line, fifo-counts-those-behind) checks that they
catch a loader that ignores the line or counts those behind it.
"""

from __future__ import annotations

from typing import Any

from tests.unit.test_dispatcher_model import run_scenario


def request(model: str, hold: float = 0.0) -> tuple[str, dict[str, Any]]:
    return "requests", {"model": model, "hold": hold, "count": 1, "leave_after": None}


def wait(seconds: float) -> tuple[str, dict[str, Any]]:
    return "time_passes", {"seconds": seconds}


# a and c run; c is stopped by hand (3 s to exit) and asks again, then b asks
C_AHEAD_OF_B = [request("a"), request("c"), wait(1.0),
                ("stopped_by_hand", {"model": "c", "exit_s": 3.0}),
                wait(0.1), request("c", hold=0.1), wait(0.1), request("b", hold=0.1)]


def test_a_model_behind_in_the_line_does_not_overtake_a_head_waiting_for_its_own_stop(
        ) -> None:
    """a and c run (max_engines 2); c is stopped by hand and takes 3 s to exit. c asks
    again meanwhile: it is first in the line, and waits for its old engine to go. b asks
    next: the only place it could get is a's (idle), by evicting a, but c is ahead and
    there is no place beyond c's, so b waits; c is served (its own place back), then b."""
    run_scenario([*C_AHEAD_OF_B,
                  wait(8.0),
                  ("check_order", {"first": "c", "then": "b"}),
                  ("check_ok", {"model": "b", "last": 1})], max_engines=2)


def test_a_place_beyond_what_the_head_needs_goes_to_the_next_at_once() -> None:
    """The same line with two places free (max_engines 4): a place beyond the one counted
    for each model ahead (c) is b's at once; it need not wait for c's old engine to go."""
    run_scenario([*C_AHEAD_OF_B,
                  wait(1.0),
                  ("check_ok", {"model": "b", "last": 1}),   # served while c still waits
                  wait(4.0),
                  ("check_ok", {"model": "c", "last": 1})], max_engines=4)


def test_models_asking_at_once_take_the_room_in_their_order() -> None:
    """a runs, one place of two is free; c and b ask in the same tick (both in the line
    before either looks). c, first, takes the free place; b, then the head, makes room by
    evicting the idle a. Neither waits for the other's position in the line."""
    run_scenario([request("a"), wait(1.0),
                  ("burst", {"models": ["c", "b"], "hold": 0.1, "ticks": 0}),
                  wait(3.0),
                  ("check_ok", {"model": "c", "last": 1}),
                  ("check_ok", {"model": "b", "last": 1})], max_engines=2)
