"""Records retention (records.max_age_days, records.max_mb): the writer thread deletes the
records past their age and the oldest beyond the size, at its start and then at its
interval, between batches; the request path only appends, as before."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gatewayd.adapters import records
from gatewayd.adapters.records import CallRecord, RecordWriter

DAY_S = 86400


def _until(condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _record(ts: float, text: str | None = None) -> CallRecord:
    return CallRecord(ts=ts, method="POST", endpoint="/v1/chat/completions", model="m",
                      status=200, request_text=text)


def _rows(path: Path) -> list[float]:
    return [row["ts"] for row in records.query(path, limit=10_000)]


def _used_bytes(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        (pages,), (free,), (size,) = (db.execute(f"PRAGMA {name}").fetchone()
                                      for name in ("page_count", "freelist_count", "page_size"))
        return int((pages - free) * size)
    finally:
        db.close()


def test_records_past_their_age_are_deleted_by_the_writer_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "records.db"
    now = time.time()
    plain = RecordWriter(path)   # no retention: everything stays
    for age_days in (90, 40, 29, 1, 0):
        plain.add(_record(now - age_days * DAY_S))
    plain.close()
    assert len(_rows(path)) == 5

    pruning_threads: list[str] = []
    delete = RecordWriter._delete

    def spy(self: RecordWriter, where: str, *args: float, limit: int | None = None) -> int:
        pruning_threads.append(threading.current_thread().name)
        return delete(self, where, *args, limit=limit)
    monkeypatch.setattr(RecordWriter, "_delete", spy)
    writer = RecordWriter(path, max_age_s=30 * DAY_S, prune_every_s=0.05)
    _until(lambda: len(_rows(path)) == 3, "the old records were never deleted")
    assert sorted(_rows(path)) == sorted(now - d * DAY_S for d in (29, 1, 0))
    assert writer.pruned == {"age": 2, "size": 0}
    writer.add(_record(now - 31 * DAY_S))   # written, then found past its age
    writer.flush()
    _until(lambda: writer.pruned["age"] == 3, "a later old record was never deleted")
    writer.close()
    assert set(pruning_threads) == {"records"}   # never the caller's (the event loop's)


def test_the_oldest_records_go_when_the_data_is_over_its_size(tmp_path: Path) -> None:
    path = tmp_path / "records.db"
    bound = 256 * 1024
    writer = RecordWriter(path, max_bytes=bound, prune_every_s=0.05)
    now = time.time()
    for i in range(600):   # ~1.2 MB of text
        writer.add(_record(now - 600 + i, text="t" * 2000))
    writer.flush()
    _until(lambda: writer.pruned["size"] > 0 and _used_bytes(path) <= bound,
           "the data was never brought under its bound")
    kept = sorted(_rows(path))
    assert 0 < len(kept) < 600 and kept == [now - 600 + i for i in range(600 - len(kept), 600)]
    # the file stays about its bound: freed pages are used again, not added
    size = path.stat().st_size
    for i in range(600):
        writer.add(_record(now + i, text="u" * 2000))
    writer.flush()
    _until(lambda: writer.pruned["size"] > 600 and _used_bytes(path) <= bound,
           "the new data was never brought under its bound")
    writer.close()
    assert path.stat().st_size < 2 * max(size, bound)


def test_without_retention_nothing_is_deleted(tmp_path: Path) -> None:
    path = tmp_path / "records.db"
    writer = RecordWriter(path, prune_every_s=0.01)
    writer.add(_record(time.time() - 400 * DAY_S))
    writer.flush()
    time.sleep(0.1)   # (nothing to wait for: several prune rounds pass, and delete nothing)
    writer.close()
    assert len(_rows(path)) == 1 and writer.pruned == {"age": 0, "size": 0}
