"""What a waiting stream is told (core/progress): whether, and the words."""

from __future__ import annotations

import pytest

from gatewayd.core.progress import Waiting, comment, reason, wanted


@pytest.mark.parametrize(("mode", "asked", "told"), [
    ("opt-in", None, False), ("opt-in", "1", True), ("opt-in", "0", False),
    ("opt-in", " TRUE ", True), ("on", None, True), ("on", "0", False), ("on", "no", False),
    ("on", "1", True), ("off", "1", False), ("off", None, False)])
def test_whether_a_stream_is_told_is_the_setting_and_the_clients_word(
        mode: str, asked: str | None, told: bool) -> None:
    assert wanted(mode, asked) is told


def test_a_header_value_that_is_neither_yes_nor_no_is_refused() -> None:
    with pytest.raises(ValueError, match="LLM-Gateway-Progress is 1 or 0, not 'maybe'"):
        wanted("opt-in", "maybe")
    with pytest.raises(ValueError):
        wanted("off", "2")   # (said wrongly even where nothing would be told)


@pytest.mark.parametrize(("waiting", "said"), [
    (Waiting("coder", 4.1, state="loading", in_line=True), "loading"),
    (Waiting("coder", 1, state="starting"), "starting"),
    (Waiting("coder", 1, state="restarting"), "restarting"),
    (Waiting("coder", 1, downloading=(37, 100), in_line=True), "downloading, 37%"),
    (Waiting("coder", 1, downloading=(5, 0)), "downloading"),
    (Waiting("coder", 1, state="ready"), "its engine is draining for another model"),
    (Waiting("coder", 1, state="stopping"), "its engine is stopping"),
    (Waiting("coder", 1, in_line=True), "room"),
    (Waiting("coder", 1, state="stopped", in_line=True, overdue=True),
     "room (overdue: max_wait_s passed)"),
    (Waiting("coder", 1, in_line=True, ahead=("chat",)), "its turn, after 'chat'"),
    (Waiting("coder", 1, in_line=True, ahead=("chat", "embed", "rerank", "x"), overdue=True),
     "its turn, after 'chat', 'embed' and 2 more (overdue)"),
    (Waiting("coder", 1, state="failed"), "queued"),
    (Waiting("coder", 1), "queued"),
])
def test_the_reason_is_what_the_gateway_does_for_it_now(waiting: Waiting, said: str) -> None:
    assert reason(waiting) == said


def test_a_comment_is_one_sse_comment_line_in_a_block_of_its_own() -> None:
    assert comment(Waiting("coder", 4.123, state="loading")) == \
        b": waiting for 'coder': loading, 4.1 s\n\n"
    odd = comment(Waiting("a\nb\rc", 0, in_line=True, ahead=("x\n\ny",)))
    assert odd.startswith(b": ") and odd.endswith(b"\n\n") and odd.count(b"\n") == 2
    assert b"\r" not in odd
