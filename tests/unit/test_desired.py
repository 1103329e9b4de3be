"""The desired engine list: changed at once, stored in the background, never lost."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest

from gatewayd.adapters import desired as desired_module
from gatewayd.adapters.desired import DesiredEngines
from gatewayd.adapters.files import write_atomic


async def test_a_start_or_stop_does_not_wait_for_the_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync of 1-6 ms on every start and stop stalled the event loop (every
    other client's stream) beside the loading engine; now the loop goes on."""
    writing = threading.Event()

    def slow_disk(path: Path, data: bytes, mode: int | None = None) -> None:
        writing.set()
        time.sleep(0.3)
        write_atomic(path, data, mode)

    monkeypatch.setattr(desired_module, "write_atomic", slow_disk)
    desired = DesiredEngines(tmp_path)
    began = time.monotonic()
    desired.add("a")
    assert time.monotonic() - began < 0.1
    assert desired.ids == ["a"]                    # the list itself changed at once
    ticks = 0
    while not writing.is_set() or ticks < 10:      # the loop runs while the disk works
        await asyncio.sleep(0.005)
        ticks += 1
    assert time.monotonic() - began < 0.25
    await desired.flush()
    assert DesiredEngines(tmp_path).ids == ["a"]


async def test_changes_are_written_one_at_a_time_newest_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[bytes] = []
    at_once = [0, 0]

    def counted(path: Path, data: bytes, mode: int | None = None) -> None:
        at_once[0] += 1
        at_once[1] = max(at_once)
        time.sleep(0.02)
        writes.append(data)
        write_atomic(path, data, mode)
        at_once[0] -= 1

    monkeypatch.setattr(desired_module, "write_atomic", counted)
    desired = DesiredEngines(tmp_path)
    for i in range(20):
        desired.add(f"m{i}")
        if i % 3 == 0:
            desired.remove(f"m{i}")
        await asyncio.sleep(0.003)
    await desired.flush()
    expected = [f"m{i}" for i in range(20) if i % 3]
    assert DesiredEngines(tmp_path).ids == expected == desired.ids
    assert at_once[1] == 1                         # never two writers racing their renames
    assert len(writes) < 20                        # changes made meanwhile go in one write


async def test_a_failed_write_is_logged_and_the_next_change_writes_the_whole_list(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    full = [True]

    def maybe_full(path: Path, data: bytes, mode: int | None = None) -> None:
        if full[0]:
            raise OSError(28, "No space left on device")
        write_atomic(path, data, mode)

    monkeypatch.setattr(desired_module, "write_atomic", maybe_full)
    desired = DesiredEngines(tmp_path)
    with caplog.at_level(logging.WARNING):
        desired.add("a")
        await desired.flush()
    assert "could not update the desired engine list" in caplog.text
    assert "No space left" in caplog.text
    full[0] = False
    desired.add("b")
    await desired.flush()
    assert DesiredEngines(tmp_path).ids == ["a", "b"]


def test_without_an_event_loop_it_writes_at_once(tmp_path: Path) -> None:
    desired = DesiredEngines(tmp_path)
    desired.add("a")
    assert DesiredEngines(tmp_path).ids == ["a"]
