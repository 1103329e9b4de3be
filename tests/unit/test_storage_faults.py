"""What the gateway keeps on disk can be damaged or full: it says so and serves on."""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from gatewayd.adapters import records
from gatewayd.adapters.desired import DesiredEngines
from gatewayd.adapters.records import CallRecord, RecordWriter


def test_a_corrupted_desired_list_is_reported_and_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "engines.json").write_text('{"engines": ["a", ')
    with caplog.at_level(logging.WARNING):
        desired = DesiredEngines(tmp_path)
    assert desired.ids == []
    assert "engines.json" in caplog.text and "not valid JSON" in caplog.text
    desired.add("b")
    assert DesiredEngines(tmp_path).ids == ["b"]


def test_a_corrupted_records_database_is_set_aside_and_a_new_one_started(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "records.db"
    db.write_bytes(b"this is not a database" * 100)
    with caplog.at_level(logging.WARNING):
        writer = RecordWriter(db)
    writer.add(CallRecord(ts=time.time(), method="POST", endpoint="/v1/chat/completions"))
    writer.close()
    assert len(records.query(db)) == 1
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("records.db.corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not")
    assert "set aside" in caplog.text and str(aside[0]) in caplog.text


def test_records_that_cannot_be_written_are_counted_and_serving_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    writer = RecordWriter(tmp_path / "records.db")
    monkeypatch.setattr(RecordWriter, "RETRY_S", 0.01)

    class Full:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

        def execute(self, *args: object) -> None:
            raise sqlite3.OperationalError("database or disk is full")
    real = writer._db
    writer._db = Full()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            writer.add(CallRecord(ts=time.time(), method="POST", endpoint="/v1/completions"))
        deadline = time.monotonic() + 5
        while writer.dropped < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert writer.dropped == 3
    assert "disk is full" in caplog.text and "dropped 3 call records" in caplog.text
    writer._db = real
    writer.add(CallRecord(ts=time.time(), method="POST", endpoint="/v1/completions"))
    writer.close()
    assert len(records.query(tmp_path / "records.db")) == 1   # writing resumes


async def test_records_reach_the_writer_thread_once_per_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the loop a record is only appended to a list: the writer thread gets one
    hand-over per batch (when full, or LINGER_S after its first record), not one per call."""
    writer = RecordWriter(tmp_path / "records.db")
    handed: list[int] = []

    class Counting(queue.SimpleQueue):  # type: ignore[type-arg]
        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            handed.append(len(item) if item else 0)
            super().put(item, block, timeout)
    counting: Counting = Counting()
    real, writer._queue = writer._queue, counting   # the thread is waiting on the real one
    real.put([])                                    # wake it: it goes on with the counting one
    monkeypatch.setattr(RecordWriter, "BATCH", 50)
    for _ in range(120):
        writer.add(CallRecord(ts=time.time(), method="POST", endpoint="/v1/completions"))
    assert handed == [50, 50]                  # two full batches at once, 20 still lingering
    deadline = time.monotonic() + 5
    while len(records.query(tmp_path / "records.db", limit=1000)) < 120:
        assert time.monotonic() < deadline, "the lingering 20 were never written"
        await asyncio.sleep(0.02)
    assert handed == [50, 50, 20]
    writer.close()


def test_a_batch_is_written_in_a_few_statements_and_every_field_comes_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One INSERT of many rows per batch (SQLite's cap on parameters permitting): a
    statement per row let the writer thread take the GIL back once per row, which cost
    the event loop ~20 µs per call under load."""
    monkeypatch.setattr(RecordWriter, "BATCH", 1000)
    writer = RecordWriter(tmp_path / "records.db")
    statements: list[str] = []
    writer._db.set_trace_callback(statements.append)
    per_statement = writer._rows_per_statement
    assert per_statement >= 100
    n = per_statement * 2 + 8                    # two full statements and a short one
    for i in range(n):
        writer._pending.append(CallRecord(
            ts=1000.0 + i, method="POST", endpoint="/v1/chat/completions", model="m",
            status=200, prompt_tokens=i, latency_ms=1.5, stream=i % 2 == 1,
            request_text="naïve ✓ \"quoted\"", api_key=None))
    writer.flush()
    writer.close()
    inserts = [s for s in statements if s.startswith("INSERT")]
    assert len(inserts) == 3
    rows = records.query(tmp_path / "records.db", limit=n)
    assert len(rows) == n
    last = rows[0]   # newest first
    assert last["ts"] == 1000.0 + n - 1 and last["prompt_tokens"] == n - 1
    assert last["stream"] == (n - 1) % 2 and last["latency_ms"] == 1.5
    assert last["request_text"] == "naïve ✓ \"quoted\"" and last["api_key"] is None
    assert last["ttft_ms"] is None and last["outcome"] == "ok"


def test_batches_of_every_size_are_written_in_a_few_statement_sizes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sqlite3 keeps the last 128 statements it compiled, one per text, and a multi-row
    INSERT's takes memory in proportion to its rows (~3.5 KiB a row): a statement text per
    batch size held tens of MiB of the gateway once its batch sizes had varied under load
    (bench/crowd.py: its RSS grew with each round of 4000 calls, and not with records off)."""
    writer = RecordWriter(tmp_path / "records.db")
    real = writer._db
    sizes: set[int] = set()

    class Counting:   # (no trace callback: SQLite would call it holding its own lock)
        def __enter__(self) -> sqlite3.Connection:
            return real.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return real.__exit__(*exc)

        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if sql.startswith("INSERT"):
                sizes.add(sql.count("), (") + 1)
            return real.execute(sql, *args)

        def close(self) -> None:
            real.close()
    writer._db = Counting()  # type: ignore[assignment]
    monkeypatch.setattr(RecordWriter, "BATCH", 1)   # each batch handed over is written alone
    calls = [CallRecord(ts=1000.0 + i, method="POST", endpoint="/v1/chat/completions")
             for i in range(300)]
    for n in range(1, 301):
        writer._queue.put(calls[:n])
    writer.close()
    # full statements, and the rest in powers of two
    assert len(sizes) <= writer._rows_per_statement.bit_length() + 1, sorted(sizes)
    assert len(records.query(tmp_path / "records.db", limit=50_000)) == 300 * 301 // 2


async def test_records_still_lingering_at_close_are_written_and_the_file_reopens(
        tmp_path: Path) -> None:
    """close() hands over what still waits for its batch (the gateway stops within
    LINGER_S of a call); a database reopened is migrated no further than it was (every
    migration ran once): its records are all there, nothing set aside."""
    db = tmp_path / "records.db"
    writer = RecordWriter(db)
    writer.add(CallRecord(ts=time.time(), method="POST", endpoint="/v1/chat/completions"))
    assert writer._pending    # lingering: on a running loop a record waits for its batch
    writer.close()
    assert len(records.query(db)) == 1
    again = RecordWriter(db)
    again.add(CallRecord(ts=time.time(), method="POST", endpoint="/v1/embeddings"))
    again.close()
    assert [r["endpoint"] for r in records.query(db)] == ["/v1/embeddings",
                                                          "/v1/chat/completions"]
    assert [p.name for p in tmp_path.iterdir() if "corrupt" in p.name] == []


def test_a_database_from_before_error_source_is_migrated_and_keeps_its_records(
        tmp_path: Path) -> None:
    """A records database as a gateway without the error_source column left it (its calls
    in it) opens, gains the column, keeps every call (theirs: no source), and takes new
    calls with their source; `llm-gateway records` and /admin/records read both."""
    db = tmp_path / "records.db"
    before = next(i for i, m in enumerate(records.MIGRATIONS) if "error_source" in m)
    old = sqlite3.connect(db)
    for number, statement in enumerate(records.MIGRATIONS[:before], start=1):
        with old:
            old.execute(statement)
            old.execute(f"PRAGMA user_version = {number}")
    with old:
        old.execute("INSERT INTO calls (ts, method, endpoint, status, outcome, error_code, "
                    "latency_ms, bytes_in, bytes_out, stream, disconnected) VALUES "
                    "(1000.0, 'POST', '/v1/chat/completions', 400, 'error', '400', 2.0, "
                    "10, 20, 0, 0)")
    old.close()
    writer = RecordWriter(db)
    writer.add(CallRecord(ts=2000.0, method="POST", endpoint="/v1/chat/completions",
                          status=400, outcome="error", error_code="400",
                          error_source="engine"))
    writer.close()
    rows = records.query(db)
    assert [(r["ts"], r["error_code"], r["error_source"]) for r in rows] == [
        (2000.0, "400", "engine"), (1000.0, "400", None)]
    check = sqlite3.connect(db)
    try:
        (version,) = check.execute("PRAGMA user_version").fetchone()
    finally:
        check.close()
    assert version == len(records.MIGRATIONS)
