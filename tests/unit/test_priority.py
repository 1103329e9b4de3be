"""Request classes (core/priority): whose class a request is served in, that a client may
lower it and never raise it, and aging."""

from __future__ import annotations

import pytest

from gatewayd.core.priority import HIGH, LOW, NORMAL, aged, of_request, turn_bound_s


def test_the_keys_class_else_the_models_lowered_never_raised_by_the_client() -> None:
    assert of_request(None, HIGH, None) == HIGH          # the model's
    assert of_request(LOW, HIGH, None) == LOW            # the key's wins where it has one
    assert of_request(NORMAL, LOW, None) == NORMAL
    assert of_request(None, NORMAL, "low") == LOW        # lowered by the client
    assert of_request(None, NORMAL, " HIGH ") == NORMAL  # never raised
    assert of_request(LOW, HIGH, "high") == LOW
    with pytest.raises(ValueError, match="LLM-Gateway-Priority is one of low, normal, high"):
        of_request(None, NORMAL, "urgent")


def test_waiting_lifts_a_class_one_step_per_aging_period_up_to_the_highest() -> None:
    assert aged(LOW, 0.0, 120) == LOW
    assert aged(LOW, 119.9, 120) == LOW
    assert aged(LOW, 120.0, 120) == NORMAL
    assert aged(LOW, 250.0, 120) == HIGH
    assert aged(NORMAL, 10_000.0, 120) == HIGH
    assert aged(LOW, float("inf"), 120) == LOW    # (never: a clock gone wrong)


def test_a_turn_lasts_until_overdue_and_aged_to_the_highest_class() -> None:
    assert turn_bound_s(HIGH, 20, 120) == 20          # overdue: may drain any engine
    assert turn_bound_s(NORMAL, 20, 120) == 120       # aged to high first
    assert turn_bound_s(LOW, 20, 120) == 240
    assert turn_bound_s(LOW, 300, 120) == 300         # overdue comes later than aging
    assert turn_bound_s(LOW, 20, 0) == 20             # no aging: refused after its wait
    for klass in (LOW, NORMAL, HIGH):                 # by then it outranks any traffic
        assert aged(klass, turn_bound_s(klass, 20, 120), 120) == HIGH
