"""Request priorities: three named classes, what a request's class is, and how waiting
lifts it. Pure.

A request's class is its API key's `priority` where the key sets one, else its model's
(`[models.NAME] priority`, default normal); the client may lower it, never raise it,
with the `LLM-Gateway-Priority` header (`low`, `normal`). For the order in which waiting
models get room (core/scheduler), a request that has waited counts one class higher for
each `priority_aging_s` it has waited, up to the highest: a low class is never starved
for good.
"""

from __future__ import annotations

import math

LOW, NORMAL, HIGH = 0, 1, 2
CLASSES: dict[str, int] = {"low": LOW, "normal": NORMAL, "high": HIGH}
NAMES: dict[int, str] = {v: k for k, v in CLASSES.items()}
HEADER = "LLM-Gateway-Priority"


def parse_class(value: object) -> int | None:
    """A class by its name (None: not one)."""
    return CLASSES.get(value) if isinstance(value, str) else None


def of_request(key_class: int | None, model_class: int, asked: str | None) -> int:
    """The class a request is served in: the key's, else the model's, lowered (never
    raised) by what the client asked for; ValueError for a name that is not a class."""
    granted = model_class if key_class is None else key_class
    if asked is None:
        return granted
    wanted = parse_class(asked.strip().lower())
    if wanted is None:
        raise ValueError(f"{HEADER} is one of {', '.join(CLASSES)}, not {asked[:40]!r}")
    return min(granted, wanted)


def aged(klass: int, waited_s: float, aging_s: float) -> int:
    """The class a request waiting waited_s counts as in the order for room."""
    if aging_s <= 0 or waited_s <= 0 or not math.isfinite(waited_s):
        return klass
    return min(HIGH, klass + int(waited_s // aging_s))


def turn_bound_s(klass: int, max_wait_s: float, aging_s: float) -> float:
    """The longest a waiting request of class klass may be passed over for its model's
    turn (grouped): until it is overdue (max_wait_s) and aged to the highest class an
    engine's traffic can have. Without aging a lower class never outranks a busy engine's
    traffic: its request is refused after max_wait_s and the wait for room."""
    if aging_s <= 0:
        return max_wait_s
    return max(max_wait_s, (HIGH - klass) * aging_s)
