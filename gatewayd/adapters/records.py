"""Call records in SQLite, written off the event loop, never lost once the call completed.

The request path only appends a CallRecord to a list on the event loop; the
list goes to a writer thread once per batch (BATCH records, or LINGER_S after
the first). The thread, with its own connection, writes each batch in one
transaction, so a burst of calls costs one fsync and one thread wake-up, and
the event loop never waits on the disk. close() drains everything before it
returns. WAL mode lets `llm-gateway records` read while the gateway writes.
Retention (records.max_age_days, records.max_mb) is the same thread's: at its start and
then every PRUNE_EVERY_S, between batches, it deletes the records past their age and the
oldest beyond the size, a few thousand rows per transaction, never on the request path.
Schema changes are numbered migrations tracked in PRAGMA user_version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Any

log = logging.getLogger("gatewayd.adapters.records")

MIGRATIONS = [
    """CREATE TABLE calls (
        id INTEGER PRIMARY KEY,
        ts REAL NOT NULL,                -- request arrival, seconds since the epoch
        model TEXT,
        engine TEXT,                     -- the engine's unit
        method TEXT NOT NULL,
        endpoint TEXT NOT NULL,
        status INTEGER NOT NULL,
        outcome TEXT NOT NULL,           -- ok | error | disconnected | engine_failed
        error_code TEXT,
        prompt_tokens INTEGER,
        completion_tokens INTEGER,
        latency_ms REAL NOT NULL,        -- arrival to last byte
        ttft_ms REAL,                    -- arrival to first streamed event
        bytes_in INTEGER NOT NULL,
        bytes_out INTEGER NOT NULL,
        stream INTEGER NOT NULL,
        disconnected INTEGER NOT NULL,
        request_text TEXT,
        response_text TEXT
    )""",
    "CREATE INDEX calls_ts ON calls (ts)",
    "CREATE INDEX calls_model_ts ON calls (model, ts)",
    "ALTER TABLE calls ADD COLUMN api_key TEXT",   # the name of the API key used (auth)
    "ALTER TABLE calls ADD COLUMN upstream TEXT",  # the remote upstream that answered
    # who produced a failed call's error: gateway | engine | upstream (core/errors.ErrorSource)
    "ALTER TABLE calls ADD COLUMN error_source TEXT",
    "ALTER TABLE calls ADD COLUMN batch TEXT",     # the batch a call was a line of
]


@dataclass
class CallRecord:
    """One call as the records database keeps it (a row of the calls table)."""
    ts: float
    method: str
    endpoint: str
    model: str | None = None
    engine: str | None = None
    status: int = 0
    outcome: str = "ok"
    error_code: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    stream: bool = False
    disconnected: bool = False
    request_text: str | None = None
    response_text: str | None = None
    api_key: str | None = None        # the name of the API key the call came with
    upstream: str | None = None       # the remote upstream that answered (engine: None)
    error_source: str | None = None   # whose error it ended in: gateway | engine | upstream
    batch: str | None = None          # the batch whose line it was (service/batches)


COLUMNS = [f.name for f in fields(CallRecord)]
_ROW = attrgetter(*COLUMNS)   # a record as its row, in column order (asdict: several times
                              # slower; docs/benchmarks.md, "Figures behind choices in the code")
_ONE_ROW = f"({', '.join('?' * len(COLUMNS))})"


def _insert_rows(n: int) -> str:
    """One INSERT of n rows: SQLite runs it in one step with the GIL released, where
    executemany released and took back the GIL once per row (under load each of those was
    a hand-over with the event loop: several times the loop's CPU per call of this way;
    docs/benchmarks.md, "Figures behind choices in the code")."""
    return f"INSERT INTO calls ({', '.join(COLUMNS)}) VALUES " + ", ".join([_ONE_ROW] * n)


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=30, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    migrate(db)
    return db


def migrate(db: sqlite3.Connection) -> None:
    (version,) = db.execute("PRAGMA user_version").fetchone()
    for number, statement in enumerate(MIGRATIONS[version:], start=version + 1):
        with db:
            db.execute(statement)
            db.execute(f"PRAGMA user_version = {number}")


class RecordWriter:
    """Batches on the loop, SQLite in a thread.

    `add` only appends to a list on the event loop; the list goes to the writer thread
    when it holds BATCH records or LINGER_S after its first one, so the thread wakes
    once per batch, not once per call (a wake per record cost the request path GIL
    hand-overs under load). Outside a running loop a record is handed over at once."""

    BATCH = 500
    LINGER_S = 0.2
    RETRY_S = 0.5
    PRUNE_ROWS = 5000         # rows deleted per transaction: the write lock is held briefly

    def __init__(self, path: Path, *, max_age_s: float = 0, max_bytes: int = 0,
                 prune_every_s: float = 60.0) -> None:
        self.path = path
        self.dropped = 0          # records lost to failed writes (logged; /admin/status)
        # retention (0: none); read by the writer thread, so a reload may change them
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.pruned: dict[str, int] = {"age": 0, "size": 0}   # rows deleted, by bound
        self._prune_every_s = prune_every_s
        self._next_prune = 0.0    # (monotonic) at the thread's start
        self._queue: queue.SimpleQueue[list[CallRecord] | None] = queue.SimpleQueue()
        self._pending: list[CallRecord] = []
        self._flush_timer: asyncio.TimerHandle | None = None
        try:
            self._db = connect(path)
        except sqlite3.DatabaseError as e:   # corrupted: keep it for a look, start anew
            aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    Path(f"{path}{suffix}").rename(f"{aside}{suffix}")
            log.error("the records database %s is damaged (%s): set aside as %s, recording "
                      "into a new one", path, e, aside)
            self._db = connect(path)
        # SQLite caps the parameters of one statement (32766 since 3.32, 999 before)
        self._rows_per_statement = max(1, min(
            self.BATCH, self._db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(COLUMNS)))
        self._statements: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, name="records", daemon=True)
        self._thread.start()

    def add(self, record: CallRecord) -> None:
        self._pending.append(record)
        if len(self._pending) >= self.BATCH:
            self.flush()
        elif self._flush_timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._flush_timer = loop.call_later(self.LINGER_S, self.flush)

    def flush(self) -> None:
        """Hand what is pending to the writer thread now."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        batch, self._pending = self._pending, []
        if batch:
            self._queue.put(batch)

    def close(self, timeout: float = 30) -> None:
        """Drain and stop; blocking (flush on the loop first, then call this via
        asyncio.to_thread; what is still pending is handed over here)."""
        batch, self._pending = self._pending, []
        if batch:
            self._queue.put(batch)
        self._queue.put(None)
        self._thread.join(timeout)
        self._db.close()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(
                    timeout=max(0.0, self._next_prune - time.monotonic()))
            except queue.Empty:
                self._prune()
                continue
            stopping = item is None
            batch = list(item or [])
            while stopping or len(batch) < self.BATCH:   # whatever else is there already
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                else:
                    batch += more
            if batch:
                try:
                    self._write(batch)
                except Exception:   # never the end of the thread: later calls are recorded
                    self.dropped += len(batch)
                    log.exception("dropped %d call records", len(batch))
            if stopping:
                return
            if time.monotonic() >= self._next_prune:
                self._prune()

    def _prune(self) -> None:
        """Retention: the records older than max_age_s, then the oldest while the data
        (pages in use, not the file: SQLite reuses freed pages) is over max_bytes."""
        self._next_prune = time.monotonic() + self._prune_every_s
        before = sum(self.pruned.values())
        try:
            if self.max_age_s > 0:
                self.pruned["age"] += self._delete("WHERE ts < ?", time.time() - self.max_age_s)
            for _ in range(20):   # each round aims at 90% of the bound
                used = self._used_bytes()
                if self.max_bytes <= 0 or used <= self.max_bytes:
                    break
                (rows,) = self._db.execute("SELECT count(*) FROM calls").fetchone()
                if not rows:
                    break
                share = 1 - 0.9 * self.max_bytes / used
                self.pruned["size"] += self._delete(
                    "ORDER BY ts", limit=max(1, int(rows * share)))
        except sqlite3.Error as e:   # a busy or full disk: tried again at the next round
            log.warning("deleting old call records from %s failed: %s", self.path, e)
        if (deleted := sum(self.pruned.values()) - before) > 0:
            log.info("deleted %d call records past records.max_age_days or records.max_mb",
                     deleted)

    def _used_bytes(self) -> int:
        def pragma(name: str) -> int:
            (value,) = self._db.execute(f"PRAGMA {name}").fetchone()
            return int(value)
        return (pragma("page_count") - pragma("freelist_count")) * pragma("page_size")

    def _delete(self, where: str, *args: float, limit: int | None = None) -> int:
        """Delete the rows `SELECT id FROM calls <where>` names (up to limit), PRUNE_ROWS
        per transaction; how many."""
        deleted = 0
        while limit is None or deleted < limit:
            step = self.PRUNE_ROWS if limit is None else min(self.PRUNE_ROWS, limit - deleted)
            with self._db:
                cursor = self._db.execute(
                    f"DELETE FROM calls WHERE id IN (SELECT id FROM calls {where} LIMIT ?)",
                    (*args, step))
            deleted += cursor.rowcount
            if cursor.rowcount < step:
                break
        return deleted

    def _statement(self, n: int) -> str:
        sql = self._statements.get(n)
        if sql is None:   # (a few sizes only: _chunks)
            sql = self._statements[n] = _insert_rows(n)
        return sql

    def _chunks(self, rows: list[tuple[Any, ...]]) -> Iterator[list[tuple[Any, ...]]]:
        """rows in statements of _rows_per_statement rows, the rest in powers of two: at
        most ~10 statement sizes ever. sqlite3 keeps the last 128 statements it compiled,
        one per text, and a multi-row INSERT compiles to memory in proportion to its rows:
        one statement per batch size held tens of MiB once batch sizes had varied
        (docs/benchmarks.md, "Figures behind choices in the code")."""
        per_statement, at = self._rows_per_statement, 0
        while len(rows) - at >= per_statement:
            yield rows[at:at + per_statement]
            at += per_statement
        while left := len(rows) - at:
            size = 1 << (left.bit_length() - 1)
            yield rows[at:at + size]
            at += size

    def _write(self, batch: list[CallRecord]) -> None:
        rows = [_ROW(r) for r in batch]
        for attempt in range(3):
            try:
                with self._db:
                    for chunk in self._chunks(rows):
                        self._db.execute(self._statement(len(chunk)),
                                         list(chain.from_iterable(chunk)))
                return
            except sqlite3.Error as e:
                log.warning("writing %d call records failed (%s), attempt %d", len(rows), e,
                            attempt + 1)
                time.sleep(self.RETRY_S)
        self.dropped += len(rows)
        log.error("dropped %d call records after 3 failed writes to %s (%d dropped so far)",
                  len(rows), self.path, self.dropped)


def query(path: Path, *, model: str | None = None, since: float | None = None,
          until: float | None = None, status: int | None = None, outcome: str | None = None,
          endpoint: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Newest first. Blocking: on the loop, search() runs it in a thread."""
    where, args = [], []
    for column, op, value in (("model", "=", model), ("ts", ">=", since), ("ts", "<", until),
                              ("status", "=", status), ("outcome", "=", outcome),
                              ("endpoint", "=", endpoint)):
        if value is not None:
            where.append(f"{column} {op} ?")
            args.append(value)
    sql = "SELECT * FROM calls" + (" WHERE " + " AND ".join(where) if where else "")
    sql += " ORDER BY ts DESC, id DESC LIMIT ?"
    args.append(limit)
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute(sql, args)]
    finally:
        db.close()


async def search(path: Path, **filters: Any) -> list[dict[str, Any]]:
    """query(), in a thread: a read of the database never holds up the event loop."""
    return await asyncio.to_thread(query, path, **filters)
