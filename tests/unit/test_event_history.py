"""The event hub's window (adapters/events): what it keeps, for how long, how many; on a
fake clock."""

from __future__ import annotations

from typing import Any

from gatewayd.adapters.events import EventHub
from gatewayd.service.eviction import eviction_reason


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def engine(model: str, state: str) -> dict[str, Any]:
    return {"type": "engine", "model": model, "state": state}


def test_the_window_is_bounded_by_age() -> None:
    clock = Clock()
    hub = EventHub(clock=clock, keep_s=3600)
    hub.publish(engine("a", "starting"))
    clock.now += 1800
    hub.publish(engine("a", "ready"))
    assert [e["state"] for e in hub.history()] == ["starting", "ready"]
    clock.now += 1801   # the first is older than the window now, the second is not
    assert [e["state"] for e in hub.history()] == ["ready"]
    clock.now += 1800
    assert hub.history() == []


def test_the_window_is_bounded_by_count_the_oldest_dropped_first() -> None:
    clock = Clock()
    hub = EventHub(clock=clock, keep_max=3)
    for i in range(5):
        clock.now += 1
        hub.publish({"type": "engine", "model": f"m{i}", "state": "ready"})
    assert [e["model"] for e in hub.history()] == ["m2", "m3", "m4"]


def test_queue_depths_and_pull_progress_go_to_followers_but_are_not_kept() -> None:
    hub = EventHub(clock=Clock())
    queue = hub.follow()
    hub.publish({"type": "queue", "model": "a", "depth": 3})
    for state in ("downloading", "verifying", "done", "failed", "cancelled"):
        hub.publish({"type": "pull", "model": "p", "state": state})
    hub.publish({"type": "reload", "ok": True, "changes": {}})
    assert queue.qsize() == 7   # followers get every event
    assert [(e["type"], e.get("state")) for e in hub.history()] == [
        ("pull", "done"), ("pull", "failed"), ("pull", "cancelled"), ("reload", None)]


def test_since_and_limit() -> None:
    clock = Clock(100.0)
    hub = EventHub(clock=clock)
    for state in ("starting", "loading", "ready", "stopping", "stopped"):
        hub.publish(engine("a", state))
        clock.now += 10   # ts 100, 110, 120, 130, 140
    assert [e["ts"] for e in hub.history(since=120)] == [120, 130, 140]   # at or after
    assert [e["ts"] for e in hub.history(limit=2)] == [130, 140]          # the newest, oldest first
    assert [e["ts"] for e in hub.history(since=105, limit=10)] == [110, 120, 130, 140]
    assert hub.history(since=141) == []
    assert [e["ts"] for e in hub.history(since=0, limit=1)] == [140]


def test_an_events_own_time_is_kept() -> None:
    clock = Clock(500.0)
    hub = EventHub(clock=clock)
    hub.publish({"type": "engine", "model": "a", "state": "ready", "ts": 450.0})
    assert hub.history()[0]["ts"] == 450.0


def test_a_closed_hub_still_answers_its_history() -> None:
    hub = EventHub(clock=Clock())
    hub.publish(engine("a", "ready"))
    hub.close()
    assert [e["state"] for e in hub.history()] == ["ready"]


def test_the_eviction_reason_says_for_whom_and_why() -> None:
    assert eviction_reason("a", "b", "needs 300 MiB of GPU memory, 120 MiB free") == (
        "evicted for 'b' (needs 300 MiB of GPU memory, 120 MiB free; 'a' least recently used)")
    assert eviction_reason("a", "b", "") == "evicted for 'b' ('a' least recently used)"
    assert eviction_reason("a", None, "more engines than max_engines") == (
        "evicted (more engines than max_engines)")
