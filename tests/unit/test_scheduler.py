"""Scheduling decisions, table-driven: who goes to make room, and when nothing may."""

from __future__ import annotations

import pytest

from gatewayd.core.engines import EngineState
from gatewayd.core.scheduler import (
    Blocked,
    Drain,
    Evict,
    Fits,
    TryAnyway,
    Usage,
    Wait,
    idle_expired,
    memory_ledger,
    plan_start,
    sole_client,
)

R, L, S = EngineState.READY, EngineState.LOADING, EngineState.STOPPING


def u(model: str, state: EngineState = R, **kw: object) -> Usage:
    return Usage(model, state, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("usages,max_engines,need,free,expected", [
    # room in places and memory
    ([u("a")], 2, 100, 1000, Fits()),
    ([u("a")], 2, 100, None, Fits()),                        # no GPU: places only
    # places full: the least recently used idle engine goes
    ([u("a", last_used=5), u("b", last_used=1)], 2, 1, None, Evict("b", "")),
    ([u("a", last_used=5), u("b", last_used=1, in_flight=1)], 2, 1, None, Evict("a", "")),
    # none can go now: the least recently used busy one drains
    ([u("a", last_used=5, in_flight=2), u("b", last_used=1, pinned=True)], 2, 1, None,
     Drain("a", "")),
    # an engine just loaded for waiting requests is theirs first (no swap without progress)
    ([u("a", last_used=5, queued=2), u("b", last_used=1, pinned=True)], 2, 1, None,
     Blocked("engine_limit", (("a", "awaited by 2 request(s)"), ("b", "pinned")))),
    ([u("a", in_flight=3)], 1, 1, None, Drain("a", "")),
    ([u("a", last_used=1, in_flight=1), u("b", last_used=2, in_flight=1)], 2, 1, None,
     Drain("a", "")),
    # a drain or a stop under way: wait for it, drain nothing more
    ([u("a", in_flight=1, draining=True), u("b", in_flight=1)], 2, 1, None,
     Wait("an engine is finishing its requests to make room")),
    ([u("a", L), u("b", S)], 2, 1, None, Wait("an engine is stopping")),
    # a draining engine goes once it serves nobody, even with requests queued behind
    ([u("a", queued=3, draining=True), u("b", in_flight=1)], 2, 1, None, Evict("a", "")),
    # nothing may go: loading, restarting and pinned engines stay
    ([u("a", L), u("b", EngineState.RESTARTING)], 2, 1, None,
     Blocked("engine_limit", (("a", "loading"), ("b", "restarting")))),
    ([u("a", pinned=True, in_flight=1)], 1, 1, None,
     Blocked("engine_limit", (("a", "pinned"),))),
    # memory short: evict by LRU as well
    ([u("a", last_used=3), u("b", last_used=2)], 4, 500, 100, Evict("b", "")),
    ([u("a", in_flight=1)], 4, 500, 100, Drain("a", "")),
    # nothing else running and it still does not fit: the estimate is conservative
    ([], 4, 50000, 24000, TryAnyway()),
    ([u("x", EngineState.STOPPED)], 1, 1, None, Fits()),     # stopped engines hold nothing
    ([u("x", EngineState.FAILED)], 1, 1, None, Fits()),
])
def test_plan_start(usages: list[Usage], max_engines: int, need: int, free: int | None,
                    expected: object) -> None:
    got = plan_start("new", usages, max_engines=max_engines, need_mib=need, free_mib=free)
    if isinstance(expected, Evict | Drain):
        assert type(got) is type(expected) and got.model_id == expected.model_id and got.reason
    else:
        assert got == expected


@pytest.mark.parametrize("others,client,sole,evicts", [
    ([], "me", "me", True),              # a lone client switching models: no grace
    ([], "me", "you", False),            # its client is another: it may come back
    ([], None, None, False),             # neither known: the grace holds
    ([], "me", None, False),             # several clients: the grace holds
    ([u("b", in_flight=1)], "me", "me", False),   # someone is served: it may be a's
])
def test_grouped_the_grace_holds_for_an_engine_s_other_clients(
        others: list[Usage], client: str | None, sole: str | None, evicts: bool) -> None:
    """a served its only client 0.1 s ago, and nobody is overdue or of a higher class."""
    usages = [u("a", last_used=99.9, sole_client=sole), *others]
    got = plan_start("new", usages, max_engines=len(usages), need_mib=1, free_mib=None,
                     grouped=True, now=100.0, client=client)
    assert (isinstance(got, Evict) and got.model_id == "a") if evicts \
        else (isinstance(got, Wait) and got.turn), got


def test_sole_client_is_one_known_client_or_none() -> None:
    assert sole_client(["x", "x"]) == "x"
    assert sole_client(["x", "y"]) is None and sole_client(["x", None]) is None
    assert sole_client([]) is None


def test_the_model_itself_is_never_its_own_victim() -> None:
    assert plan_start("a", [u("a"), u("b", in_flight=1)], max_engines=2, need_mib=1,
                      free_mib=None) == Fits()


@pytest.mark.parametrize("usage,expired", [
    (u("a", last_used=0, idle_ttl_s=10), True),
    (u("a", last_used=95, idle_ttl_s=10), False),
    (u("a", last_used=0, idle_ttl_s=None), False),
    (u("a", last_used=0, idle_ttl_s=10, in_flight=1), False),   # busy is not idle
    (u("a", last_used=0, idle_ttl_s=10, queued=1), False),
    (u("a", last_used=0, idle_ttl_s=10, pinned=True), False),
    (u("a", L, last_used=0, idle_ttl_s=10), False),
])
def test_idle_ttl(usage: Usage, expired: bool) -> None:
    assert idle_expired([usage], now=100) == (["a"] if expired else [])


def test_ledger_counts_what_loading_engines_will_still_take() -> None:
    usages = [u("ready", R, estimate_mib=5000, measured_mib=4800),
              u("loading", L, estimate_mib=8000, measured_mib=1000),
              u("starting", EngineState.STARTING, estimate_mib=3000),
              u("gone", EngineState.STOPPED, estimate_mib=9999, measured_mib=9999)]
    ledger = memory_ledger(total_mib=24000, free_mib=16000, usages=usages)
    assert ledger.held_mib == 4800 + 1000
    assert ledger.pending_mib == 7000 + 3000
    assert ledger.external_mib == 24000 - 16000 - 5800
    assert ledger.plan_free_mib == 6000


def test_ledger_without_per_process_figures() -> None:
    ledger = memory_ledger(24000, 20000, [u("a", L, estimate_mib=30000)])
    assert ledger.held_mib == 0 and ledger.external_mib == 4000 and ledger.plan_free_mib == 0


@pytest.mark.parametrize("usages,ahead,expected", [
    # models ahead in the line come first: nobody behind them makes room
    ([u("a", last_used=1), u("b", last_used=2)], 1, Wait("1 model(s) ahead in the line for room")),
    # a free place beyond what the models ahead need may be taken (no GPU to weigh)
    ([u("a")], 1, Fits()),
    ([u("a"), u("b")], 1, Wait("1 model(s) ahead in the line for room")),
])
def test_the_line_for_room_is_first_come_first_served(usages: list[Usage], ahead: int,
                                                      expected: object) -> None:
    assert plan_start("new", usages, max_engines=3, need_mib=1, free_mib=None,
                      ahead=ahead) == expected


def test_a_place_held_by_a_restarting_engine_counts() -> None:
    restarting = u("a", EngineState.RESTARTING)
    assert restarting.holds_place
    assert plan_start("new", [restarting], max_engines=1, need_mib=1, free_mib=None) == \
        Blocked("engine_limit", (("a", "restarting"),))
