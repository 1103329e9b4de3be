"""Batch jobs kept: files and batches in SQLite (`<state_dir>/batches.db`), file bytes
under `<state_dir>/files/`. Synchronous, each call its own transaction, safe from any
thread (one connection behind a lock); the service calls it off the event loop.

What makes a line's answer count exactly once: a line's row is the truth. It is marked
`sent` (its attempts counted) in one transaction before its request goes out, and
`done` or `failed` with its result in one transaction when it comes back; the output and
error files are written from those rows at the end. A line found `sent` when the gateway
starts was on its way when it stopped: it goes back to `pending` until it has been sent
ATTEMPTS times, then it fails as interrupted.

A file's bytes are written to a temporary name, flushed to disk and renamed, before its
row exists: a file the database lists is whole. Its path is its id joined through
core/safe_paths (an id from a request is one safe part or nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from gatewayd.core.batch import (
    ATTEMPTS,
    DONE,
    ENDED,
    FAILED,
    PENDING,
    SENT,
    Batch,
    Line,
    StoredFile,
    error_line,
)
from gatewayd.core.safe_paths import inside

MIGRATIONS = [
    """CREATE TABLE files (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,            -- the API key's name ('': keys are off)
        purpose TEXT NOT NULL,          -- batch | batch_output
        filename TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        created_at INTEGER NOT NULL
    )""",
    """CREATE TABLE batches (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        status TEXT NOT NULL,
        doc TEXT NOT NULL               -- the rest of the Batch, as JSON
    )""",
    """CREATE TABLE lines (
        batch_id TEXT NOT NULL,
        number INTEGER NOT NULL,        -- the input file's line number
        custom_id TEXT NOT NULL,
        model TEXT NOT NULL,
        url TEXT NOT NULL,
        body BLOB NOT NULL,
        state TEXT NOT NULL,            -- pending | sent | done | failed
        attempts INTEGER NOT NULL DEFAULT 0,
        ok INTEGER NOT NULL DEFAULT 0,  -- done with a 2xx answer
        result TEXT,                    -- its output or error file line (JSON)
        PRIMARY KEY (batch_id, number)
    )""",
    "CREATE INDEX lines_state ON lines (batch_id, state, number)",
]


class BatchStore:
    def __init__(self, state_dir: Path) -> None:
        self.files_dir = state_dir / "files"
        self.files_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(state_dir / "batches.db", timeout=30,
                                   check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")   # a line answered stays answered
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        for number, statement in enumerate(MIGRATIONS[version:], start=version + 1):
            with self._tx() as db:
                db.execute(statement)
                db.execute(f"PRAGMA user_version = {number}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # -- files --------------------------------------------------------------------------

    def path_of(self, file_id: str) -> Path:
        return inside(self.files_dir, file_id, what="a file id")

    def add_file(self, stored: StoredFile, chunks: Iterable[bytes]) -> None:
        """The file's bytes on disk, whole, then its row."""
        path = self.path_of(stored.id)
        part = path.with_name(path.name + ".part")
        try:
            with open(part, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(part, path)
            with self._tx() as db:
                db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                           (stored.id, stored.owner, stored.purpose, stored.filename,
                            stored.bytes, stored.created_at))
        except BaseException:
            part.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            raise

    def file(self, file_id: str) -> StoredFile | None:
        rows = self._read("SELECT * FROM files WHERE id = ?", (file_id,))
        return StoredFile(*rows[0]) if rows else None

    def files(self, owner: str | None, *, purpose: str | None, after: str | None,
              limit: int, newest_first: bool) -> list[StoredFile]:
        """Up to limit files (of owner; None: everyone's), after the file `after` in the
        order asked."""
        where, args = self._owned(owner)
        if purpose is not None:
            where, args = where + " AND purpose = ?", [*args, purpose]
        order = "DESC" if newest_first else "ASC"
        if after is not None and (cursor := self.file(after)) is not None and (
                owner is None or cursor.owner == owner):   # another's id: no cursor
            sign = "<" if newest_first else ">"
            where += f" AND (created_at, id) {sign} (?, ?)"
            args = [*args, cursor.created_at, cursor.id]
        rows = self._read(f"SELECT * FROM files WHERE {where} ORDER BY created_at {order}, "
                          f"id {order} LIMIT ?", [*args, limit])
        return [StoredFile(*row) for row in rows]

    def free_bytes(self) -> int:
        """What the disk of the files has free."""
        return shutil.disk_usage(self.files_dir).free

    def count_files(self) -> int:
        return int(self._read("SELECT COUNT(*) FROM files")[0][0])

    def delete_file(self, file_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.path_of(file_id).unlink(missing_ok=True)

    def input_of_running(self, file_id: str) -> str | None:
        """The batch not yet ended that runs this file (None: none)."""
        for batch_id, doc in self._read("SELECT id, doc FROM batches WHERE status NOT IN "
                                        f"({', '.join('?' * len(ENDED))})", ENDED):
            if json.loads(doc).get("input_file_id") == file_id:
                return str(batch_id)
        return None

    # -- batches ------------------------------------------------------------------------

    def add_batch(self, batch: Batch, lines: Iterable[Line]) -> None:
        """The batch and every line of it, pending, in one transaction."""
        with self._tx() as db:
            db.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?)",
                       (batch.id, batch.owner, batch.created_at, batch.status, _doc(batch)))
            db.executemany(
                "INSERT INTO lines (batch_id, number, custom_id, model, url, body, state) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                ((batch.id, line.number, line.custom_id, line.model, line.url, line.body,
                  PENDING) for line in lines))

    def save(self, batch: Batch) -> None:
        with self._tx() as db:
            db.execute("UPDATE batches SET status = ?, doc = ? WHERE id = ?",
                       (batch.status, _doc(batch), batch.id))

    def batch(self, batch_id: str) -> Batch | None:
        rows = self._read("SELECT doc FROM batches WHERE id = ?", (batch_id,))
        return self._counted(_batch(rows[0][0])) if rows else None

    def batches(self, owner: str | None, *, after: str | None, limit: int) -> list[Batch]:
        """Up to limit batches (of owner; None: everyone's), newest first, after `after`."""
        where, args = self._owned(owner)
        if after is not None and (cursor := self._read(
                "SELECT created_at FROM batches WHERE id = ? AND " + where,
                (after, *args))):
            where += " AND (created_at, id) < (?, ?)"
            args = [*args, cursor[0][0], after]
        rows = self._read(f"SELECT doc FROM batches WHERE {where} "
                          "ORDER BY created_at DESC, id DESC LIMIT ?", [*args, limit])
        return [self._counted(_batch(doc)) for (doc,) in rows]

    def unended(self) -> list[Batch]:
        """The batches a run must go on with (or finish), oldest first."""
        rows = self._read("SELECT doc FROM batches WHERE status NOT IN "
                          f"({', '.join('?' * len(ENDED))}) ORDER BY created_at, id",
                          ENDED)
        return [self._counted(_batch(doc)) for (doc,) in rows]

    def _counted(self, batch: Batch) -> Batch:
        total, completed, failed = self._read(
            "SELECT COUNT(*), COALESCE(SUM(state = ? AND ok), 0), "
            "COALESCE(SUM(state = ? OR (state = ? AND NOT ok)), 0) "
            "FROM lines WHERE batch_id = ?", (DONE, FAILED, DONE, batch.id))[0]
        batch.total, batch.completed, batch.failed = int(total), int(completed), int(failed)
        return batch

    def _owned(self, owner: str | None) -> tuple[str, list[Any]]:
        return ("1", []) if owner is None else ("owner = ?", [owner])

    def lines_waiting(self) -> dict[tuple[str, str], int]:
        """Lines of unended batches not answered yet, by model: "queued" (pending) and
        "sending" (sent, no answer yet)."""
        rows = self._read(
            "SELECT l.model, l.state, COUNT(*) FROM lines l JOIN batches b ON b.id = "
            f"l.batch_id WHERE b.status NOT IN ({', '.join('?' * len(ENDED))}) AND "
            "l.state IN (?, ?) GROUP BY l.model, l.state", (*ENDED, PENDING, SENT))
        words = {PENDING: "queued", SENT: "sending"}
        return {(str(model), words[str(state)]): int(n) for model, state, n in rows}

    # -- lines --------------------------------------------------------------------------

    def pending(self, batch_id: str, limit: int) -> list[Line]:
        rows = self._read("SELECT number, custom_id, url, model, body FROM lines "
                          "WHERE batch_id = ? AND state = ? ORDER BY number LIMIT ?",
                          (batch_id, PENDING, limit))
        return [Line(int(n), str(c), str(u), str(m), bytes(b)) for n, c, u, m, b in rows]

    def mark_sent(self, batch_id: str, number: int) -> bool:
        """A pending line marked as on its way (its attempt counted); False where it is
        pending no more (ended meanwhile: expired): it must not go."""
        with self._tx() as db:
            return db.execute("UPDATE lines SET state = ?, attempts = attempts + 1 "
                              "WHERE batch_id = ? AND number = ? AND state = ?",
                              (SENT, batch_id, number, PENDING)).rowcount == 1

    def unsend(self, batch_id: str, number: int | None = None) -> int:
        """A line that got no answer it counts (no turn, or cut off by a cancel, an expiry
        or the gateway's stop): pending again, its attempt not counted; number None: every
        such line of the batch. How many went back."""
        with self._tx() as db:
            return db.execute(
                "UPDATE lines SET state = ?, attempts = MAX(attempts - 1, 0) "
                "WHERE batch_id = ? AND state = ?" + ("" if number is None else
                                                      " AND number = ?"),
                (PENDING, batch_id, SENT) + (() if number is None else (number,))).rowcount

    def fail_unanswered(self, batch_id: str, code: str, message: str,
                        request_id: Callable[[], str]) -> int:
        """Every line not answered yet (pending, or on its way) failed with code and
        message, in one transaction (an expired batch's); how many."""
        with self._tx() as db:
            rows = db.execute("SELECT number, custom_id FROM lines WHERE batch_id = ? AND "
                              "state IN (?, ?)", (batch_id, PENDING, SENT)).fetchall()
            db.executemany(
                "UPDATE lines SET state = ?, ok = 0, result = ? WHERE batch_id = ? AND "
                "number = ?",
                ((FAILED, json.dumps(error_line(request_id(), custom_id, code, message),
                                     separators=(",", ":")), batch_id, number)
                 for number, custom_id in rows))
        return len(rows)

    def finish(self, batch_id: str, number: int, *, ok: bool | None,
               result: dict[str, Any]) -> None:
        """The line's answer (ok: a 2xx) or, ok None, its failure, kept once."""
        with self._tx() as db:
            db.execute("UPDATE lines SET state = ?, ok = ?, result = ? "
                       "WHERE batch_id = ? AND number = ? AND state = ?",
                       (FAILED if ok is None else DONE, bool(ok),
                        json.dumps(result, separators=(",", ":")), batch_id, number, SENT))

    def resume(self, batch_id: str) -> list[tuple[int, str]]:
        """Lines found sent (on their way when the gateway stopped): pending again, or
        failed past ATTEMPTS; returns those failed, with their custom_id."""
        with self._tx() as db:
            spent = db.execute("SELECT number, custom_id FROM lines WHERE batch_id = ? AND "
                               "state = ? AND attempts >= ?",
                               (batch_id, SENT, ATTEMPTS)).fetchall()
            db.execute("UPDATE lines SET state = ? WHERE batch_id = ? AND state = ? AND "
                       "attempts < ?", (PENDING, batch_id, SENT, ATTEMPTS))
        return [(int(n), str(c)) for n, c in spent]

    def results(self, batch_id: str, *, ok: bool) -> Iterator[bytes]:
        """The output (ok) or error file's lines, in the input file's order."""
        last = 0
        while True:
            rows = self._read(
                "SELECT number, result FROM lines WHERE batch_id = ? AND number > ? AND "
                "result IS NOT NULL AND (state = ? AND ok) = ? ORDER BY number LIMIT 500",
                (batch_id, last, DONE, ok))
            if not rows:
                return
            for number, result in rows:
                yield result.encode() + b"\n"
                last = number

    def drop_lines(self, batch_id: str) -> None:
        """An ended batch's lines, once its files are written (their bytes are there)."""
        with self._tx() as db:
            db.execute("UPDATE lines SET body = x'' WHERE batch_id = ?", (batch_id,))


def _doc(batch: Batch) -> str:
    fields = {k: v for k, v in vars(batch).items()
              if k not in ("total", "completed", "failed")}
    return json.dumps(fields, separators=(",", ":"))


def _batch(doc: str) -> Batch:
    return Batch(**json.loads(doc))
