"""Waiting for an engine, in figures and in words. Pure.

What a request waiting for its model's engine waits for, by what that engine is doing
(`reason_of`): `room` (no engine, or one stopping, failed, or giving its place to another
model: the model's turn for a place, or a drain), `load` (its engine starting, loading or
restarting), `queue` (its engine ready: its turn there). A `WaitClock` splits one
request's wait into those parts as the engine's state changes; the metrics observe each
part under its reason. The part spent for room is the wait for the model's turn, which
the bound (max_wait_s, core/scheduler) is about: `near_miss` says how close it came.

Why room was made for a model (`room_rule`, `because`): the words an eviction's events
carry, e.g. "'chat' waited 30 s: max_wait_s".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gatewayd.core.engines import COMING_STATES, EngineState

QUEUE, LOAD, ROOM = "queue", "load", "room"
REASONS = (QUEUE, LOAD, ROOM)
NEAR = 0.9   # a wait for the turn past this share of max_wait_s is a near miss


def reason_of(state: EngineState | None, draining: bool) -> str:
    """What a request waits for while its model's engine is in `state` (None: none)."""
    if state is EngineState.READY:
        return ROOM if draining else QUEUE
    if state in COMING_STATES:
        return LOAD
    return ROOM


@dataclass
class WaitClock:
    """One request's wait, split by reason as it goes."""

    since: float
    reason: str
    parts: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._mark = self.since

    def switch(self, reason: str, now: float) -> None:
        """From now on it waits for `reason`."""
        if reason != self.reason:
            self._close(now)
            self.reason = reason

    def end(self, now: float) -> dict[str, float]:
        """The wait is over: seconds per reason (those it waited for only)."""
        self._close(now)
        return self.parts

    def _close(self, now: float) -> None:
        spent = max(0.0, now - self._mark)
        if spent > 0:
            self.parts[self.reason] = self.parts.get(self.reason, 0.0) + spent
        self._mark = now


@dataclass(frozen=True)
class Waited:
    """A request's wait, over: its model and class, seconds per reason, whether it was
    handed an engine (else the gateway answered it with an error), and how its wait for
    the turn stood against max_wait_s (`near_miss`)."""

    model: str
    priority: int
    parts: dict[str, float]
    handed: bool = True
    miss: str | None = None


def near_miss(turn_wait_s: float, max_wait_s: float) -> str | None:
    """How a wait for the model's turn (its `room` part) stands against max_wait_s:
    "reached" (its model went overdue: the bound made room), "near" (past NEAR of it),
    else None."""
    if max_wait_s <= 0 or turn_wait_s <= 0:
        return None
    if turn_wait_s >= max_wait_s:
        return "reached"
    return "near" if turn_wait_s >= NEAR * max_wait_s else None


# why room was made for a waiting model (the rule that let it take a place)
SERVED_NOBODY = "served_nobody"   # the victim was ready and serving nobody
MAX_WAIT = "max_wait_s"           # grouped: it waited its max_wait_s (overdue)
HIGHER_CLASS = "higher_class"     # grouped: its requests outrank the victim's
FIFO = "fifo"                     # fifo: first in line drains a busy engine at once


def room_rule(*, drained: bool, grouped: bool, priority: int, victim_priority: int,
              overdue: bool) -> str:
    """The rule that gave a waiting model room from a victim: one that served nobody, or
    (drained: it was busy) a higher class, the model's max_wait_s, or fifo's order. The
    class goes first, as in core/scheduler.plan_start: a higher class needs no wait."""
    if not drained:
        return SERVED_NOBODY
    if not grouped:
        return FIFO
    if priority > victim_priority:
        return HIGHER_CLASS
    return MAX_WAIT if overdue else SERVED_NOBODY


@dataclass(frozen=True)
class Swap:
    """Why an engine gave its place: the model it made room for, how long that model's
    oldest request had waited when room was decided, and the rule."""

    victim: str
    model: str
    waited_s: float
    rule: str

    @property
    def because(self) -> str:
        """The sentence a person reads: "'chat' waited 30 s: max_wait_s"."""
        rule = {SERVED_NOBODY: f"{self.victim!r} served nobody",
                MAX_WAIT: "max_wait_s",
                HIGHER_CLASS: f"of a higher class than {self.victim!r}",
                FIFO: "first in line (fifo)"}.get(self.rule, self.rule)
        return f"{self.model!r} waited {seconds(self.waited_s)}: {rule}"

    def describe(self) -> dict[str, object]:
        """The event's fields."""
        return {"because": self.because, "rule": self.rule,
                "waited_s": round(self.waited_s, 3)}


def seconds(value: float) -> str:
    """A wait as a person reads it: "0.4 s", "12 s", "3 min 5 s"."""
    if value < 10:
        return f"{max(0.0, value):.1f} s"
    if value < 120:
        return f"{value:.0f} s"
    whole = round(value)
    return f"{whole // 60} min {whole % 60} s"
