"""Turns' account of who an engine served lately (core/scheduler's grace reads it)."""

from __future__ import annotations

from gatewayd.core.scheduler import IDLE_GRACE_S
from gatewayd.service.turns import Turns


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def served(turns: Turns, clock: Clock, client: str | None, *, hold: float = 0.1,
           counts_as_use: bool = True) -> None:
    turns.take("a", limit=None, counts_as_use=counts_as_use, client=client)
    clock.now += hold
    turns.release("a", counts_as_use=counts_as_use)


def test_one_client_back_to_back_is_the_sole_client() -> None:
    clock = Clock()
    turns = Turns(clock)
    for _ in range(3):
        served(turns, clock, "x")
        clock.now += 0.05
    assert turns.get_or_add("a").sole_client == "x"


def test_another_client_within_the_grace_makes_them_several() -> None:
    clock = Clock()
    turns = Turns(clock)
    served(turns, clock, "x")
    clock.now += IDLE_GRACE_S / 2
    served(turns, clock, "y")
    assert turns.get_or_add("a").sole_client is None


def test_two_clients_at_once_are_several() -> None:
    clock = Clock()
    turns = Turns(clock)
    turns.take("a", limit=None, counts_as_use=True, client="x")
    clock.now += 30.0   # a long answer: x is still served when y comes
    turns.take("a", limit=None, counts_as_use=True, client="y")
    assert turns.get_or_add("a").sole_client is None


def test_requests_at_once_from_one_host_and_key_are_several_clients() -> None:
    """Keyless clients of one host (a team behind one proxy, the e2e test's threads) look
    like one client: two of its requests at once are not a lone client's back-to-back ones,
    and the grace must hold for them until a quiet moment."""
    clock = Clock()
    turns = Turns(clock)
    turns.take("a", limit=None, counts_as_use=True, client="@10.0.0.5")
    turns.take("a", limit=None, counts_as_use=True, client="@10.0.0.5")
    assert turns.get_or_add("a").sole_client is None
    turns.release("a", counts_as_use=True)
    turns.release("a", counts_as_use=True)
    clock.now += 0.05
    served(turns, clock, "@10.0.0.5")    # one at a time again, within the grace: still
    assert turns.get_or_add("a").sole_client is None
    clock.now += IDLE_GRACE_S + 0.1
    served(turns, clock, "@10.0.0.5")
    assert turns.get_or_add("a").sole_client == "@10.0.0.5"


def test_after_a_quiet_moment_the_next_client_is_the_sole_one() -> None:
    clock = Clock()
    turns = Turns(clock)
    served(turns, clock, "x")
    served(turns, clock, "y")
    clock.now += IDLE_GRACE_S + 0.1
    served(turns, clock, "y")
    assert turns.get_or_add("a").sole_client == "y"


def test_a_poll_that_is_not_a_use_changes_nothing() -> None:
    clock = Clock()
    turns = Turns(clock)
    served(turns, clock, "x")
    served(turns, clock, "monitor", counts_as_use=False)
    assert turns.get_or_add("a").sole_client == "x"
