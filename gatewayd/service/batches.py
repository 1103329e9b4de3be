"""Batch jobs run: files kept, batches created from them and run line by line at the
lowest priority, in the machine's idle time, resumed across restarts (core/batch says
the API's objects and states; adapters/batch_store keeps them).

How its lines share the machine with the gateway's interactive users, and how each is
sent: service/batch_lines. One task per unended batch sends its pending lines; its end
(completed, expired, cancelled, failed) writes the output and error files from the lines'
answers, and one status change happens at a time (a cancel, or a batch's end).

Cancel and expiry stop the lines in flight (their requests are dropped, the engine stops
generating) and keep every line already answered; an expired batch's unanswered lines
go to its error file as `batch_expired`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

from gatewayd.core.batch import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    ENDED,
    ENDPOINTS,
    EXPIRED,
    FAILED_BATCH,
    FINALIZING,
    IN_PROGRESS,
    WINDOWS,
    Batch,
    Line,
    StoredFile,
    check_metadata,
    error_line,
    read_lines,
)
from gatewayd.core.catalog import Catalog
from gatewayd.core.config import GatewayConfig
from gatewayd.core.errors import (
    BatchEnded,
    BatchInvalid,
    BatchNotFound,
    FileInUse,
    FileNotFound,
    ModelNotFound,
    StorageFull,
)
from gatewayd.core.ports import BatchBook, WholeAnswers
from gatewayd.service.batch_lines import (
    Activity,
    BatchDispatcher,
    BatchEngines,
    LineRecorder,
    LineSender,
    request_id,
)

log = logging.getLogger("gatewayd.batches")

PROGRESS_S = 1.0        # a batch's progress event at most this often
CLOSE_WAIT_S = 10.0     # the gateway's stop waits this long for a batch writing its files


class _Running:
    """A batch's run: its task, and how it is to end."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self.task = task
        self.stop: str | None = None   # CANCELLED or EXPIRED once asked to end early
        # past its last line: its files are being written, and nothing may cut it off (a
        # cancel is too late then)
        self.finishing = False


class Batches:
    def __init__(self, store: BatchBook, *, engines: BatchEngines,
                 dispatcher: BatchDispatcher, answers: WholeAnswers, config: GatewayConfig,
                 catalog: Catalog, activity: Activity, record: LineRecorder | None = None,
                 publish: Callable[[dict[str, Any]], None] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self._store = store
        self.config = config
        self._catalog = catalog
        self._publish = publish
        self._published: dict[str, float] = {}   # when each batch's progress was last told
        self._lines = LineSender(store, catalog=catalog, engines=engines, dispatcher=dispatcher,
                                 answers=answers, config=lambda: self.config,
                                 activity=activity, record=record, progress=self._progress,
                                 wall=lambda: self._wall())
        self._ending = asyncio.Lock()   # a cancel and a batch's end: one at a time
        self._wall = wall
        self._running: dict[str, _Running] = {}
        self._closed = False

    # -- files --------------------------------------------------------------------------

    async def upload(self, owner: str, filename: str, data: bytes) -> StoredFile:
        """A batch input file: every line checked (BatchFileInvalid naming the bad ones),
        the bounds on what is kept checked, then kept whole."""
        # (a 100 MB file is a second of CPU: off the event loop)
        await asyncio.to_thread(read_lines, data, max_lines=self.config.batch_max_lines)
        await self._check_room(len(data))
        stored = StoredFile(id=f"file-{secrets.token_hex(12)}", owner=owner, purpose="batch",
                            filename=_clean_filename(filename), bytes=len(data),
                            created_at=int(self._wall()))
        await asyncio.to_thread(self._store.add_file, stored, (data,))
        return stored

    async def _check_room(self, size: int) -> None:
        count = await asyncio.to_thread(self._store.count_files)
        config = self.config
        if count >= config.batch_max_files:
            raise StorageFull(f"{count} files are kept here, the most allowed "
                              "(batches.max_files): delete some first", retry_after=60)
        free = await asyncio.to_thread(self._store.free_bytes)
        if free - size < config.batch_disk_reserve_bytes:
            raise StorageFull(f"the state directory's disk would have less than "
                              f"{config.batch_disk_reserve_bytes // 2**20} MiB free "
                              "(batches.disk_reserve_mb)", retry_after=60)

    async def file(self, owner: str | None, file_id: str) -> StoredFile:
        """owner's file (None: anyone's); FileNotFound otherwise (another's too: it is not
        said whether it exists). (Every read of the store is off the event loop: a line's
        answer being kept holds it for an fsync.)"""
        found = await asyncio.to_thread(self._store.file, file_id)
        if found is None or (owner is not None and found.owner != owner):
            raise FileNotFound(f"no file {file_id!r}", param="file_id")
        return found

    async def files(self, owner: str | None, *, purpose: str | None, after: str | None,
                    limit: int, newest_first: bool) -> tuple[list[StoredFile], bool]:
        found = await asyncio.to_thread(self._store.files, owner, purpose=purpose,
                                        after=after, limit=limit + 1,
                                        newest_first=newest_first)
        return found[:limit], len(found) > limit

    async def delete_file(self, owner: str | None, file_id: str) -> StoredFile:
        found = await self.file(owner, file_id)
        running = await asyncio.to_thread(self._store.input_of_running, file_id)
        if running is not None:
            raise FileInUse(f"{file_id} is the input of {running}, which has not ended: "
                            "cancel it first", param="file_id")
        await asyncio.to_thread(self._store.delete_file, file_id)
        return found

    async def content_path(self, owner: str | None, file_id: str) -> Any:
        return self._store.path_of((await self.file(owner, file_id)).id)

    # -- batches ------------------------------------------------------------------------

    async def create(self, owner: str, *, input_file_id: str, endpoint: str,
                     completion_window: str, metadata: object,
                     may_use: Callable[[str], bool]) -> Batch:
        """A batch of owner's file, checked whole before it exists: the endpoint every
        line asks, each line's model known here and one the caller may use."""
        if endpoint not in ENDPOINTS:
            raise BatchInvalid(f"endpoint must be one of {', '.join(ENDPOINTS)}",
                               param="endpoint")
        if completion_window not in WINDOWS:
            raise BatchInvalid(f"completion_window must be one of {', '.join(WINDOWS)}",
                               param="completion_window")
        checked_metadata = check_metadata(metadata)
        stored = await self.file(owner or None, input_file_id)
        if stored.purpose != "batch":
            raise BatchInvalid(f"{input_file_id} is not a batch input file (its purpose is "
                               f"{stored.purpose})", param="input_file_id")
        try:
            data = await asyncio.to_thread(self._store.path_of(stored.id).read_bytes)
        except OSError:   # deleted meanwhile
            raise FileNotFound(f"no file {input_file_id!r}", param="input_file_id") from None
        read = await asyncio.to_thread(read_lines, data,
                                       max_lines=self.config.batch_max_lines)
        lines = [self._resolved(line, may_use) for line in read]
        wrong = [line.number for line in lines if line.url != endpoint]
        if wrong:
            raise BatchInvalid(f"line(s) {_numbers(wrong)} ask another url than the "
                               f"batch's endpoint {endpoint}", param="endpoint")
        now = int(self._wall())
        batch = Batch(id=f"batch_{secrets.token_hex(12)}", owner=owner,
                      input_file_id=input_file_id, endpoint=endpoint,
                      completion_window=completion_window, created_at=now,
                      expires_at=now + WINDOWS[completion_window], metadata=checked_metadata)
        batch.move(IN_PROGRESS, now)
        await asyncio.to_thread(self._store.add_batch, batch, lines)
        batch.total = len(lines)
        self._tell(batch)
        self._start(batch.id)
        log.info("batch %s: %d line(s) of %s to %s", batch.id, len(lines), input_file_id,
                 endpoint)
        return batch

    def _resolved(self, line: Line, may_use: Callable[[str], bool]) -> Line:
        """The line with its model as the catalog names it; refused for a model not served
        here or not the caller's."""
        try:
            served = self._catalog.served(line.model)
        except ModelNotFound:
            raise BatchInvalid(f"line {line.number}: model {line.model!r} is not served "
                               "here (a batch runs on this gateway's own engines)",
                               param="input_file_id", line=line.number) from None
        if not may_use(served.id):
            raise BatchInvalid(f"line {line.number}: the key may not use model "
                               f"{line.model!r}", param="input_file_id", line=line.number)
        return Line(line.number, line.custom_id, line.url, served.id, line.body)

    async def batch(self, owner: str | None, batch_id: str) -> Batch:
        found = await asyncio.to_thread(self._store.batch, batch_id)
        if found is None or (owner is not None and found.owner != owner):
            raise BatchNotFound(f"no batch {batch_id!r}", param="batch_id")
        return found

    async def batches(self, owner: str | None, *, after: str | None, limit: int
                      ) -> tuple[list[Batch], bool]:
        found = await asyncio.to_thread(self._store.batches, owner, after=after,
                                        limit=limit + 1)
        return found[:limit], len(found) > limit

    async def lines_waiting(self) -> dict[tuple[str, str], int]:
        """Unended batches' lines not answered yet, by (model, "queued"|"sending")."""
        return await asyncio.to_thread(self._store.lines_waiting)

    async def unended(self) -> list[Batch]:
        """Every batch not yet ended, oldest first (the admin's view)."""
        return await asyncio.to_thread(self._store.unended)

    async def cancel(self, owner: str | None, batch_id: str) -> Batch:
        """The batch cancelling: its lines in flight stopped, what is answered kept; a
        batch already ending (its files being written) is past cancelling (BatchEnded)."""
        await self.batch(owner, batch_id)   # the caller's, or a 404
        async with self._ending:   # one status change at a time: this, or its end
            batch = await self.batch(owner, batch_id)
            running = self._running.get(batch_id)
            if batch.status in ENDED:
                raise BatchEnded(f"{batch_id} has already ended ({batch.status})")
            if batch.status == FINALIZING or (running is not None and running.finishing):
                raise BatchEnded(f"{batch_id} is finalizing: every line is answered, and "
                                 "its files are being written")
            if batch.status != CANCELLING:
                batch.move(CANCELLING, int(self._wall()))
                await asyncio.to_thread(self._store.save, batch)
                self._tell(batch)
            if running is not None:
                running.stop = CANCELLED
                running.task.cancel()
            else:
                self._start(batch_id)
        return batch

    # -- running ------------------------------------------------------------------------

    async def start(self) -> None:
        """The batches a previous run left unended, each going on where it was."""
        for batch in await asyncio.to_thread(self._store.unended):
            spent = await asyncio.to_thread(self._store.resume, batch.id)
            for number, custom_id in spent:   # still `sent`: their failure is kept
                await asyncio.to_thread(self._store.finish, batch.id, number, ok=None,
                                        result=error_line(
                    request_id(), custom_id, "interrupted", "the gateway stopped while "
                    "this line was on its way, twice: it is not sent a third time"))
            self._start(batch.id)
            log.info("batch %s goes on (%s)", batch.id, batch.status)

    async def close(self) -> None:
        """The gateway stops: each batch stops where it is (its lines in flight pending
        again, uncounted: the next run sends them), one writing its files finishes first
        (a few seconds at most)."""
        self._closed = True
        running = list(self._running.values())
        for run in running:
            if not run.finishing:
                run.task.cancel()
        for run in running:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(run.task), CLOSE_WAIT_S)
            run.task.cancel()
        await asyncio.to_thread(self._store.close)

    def _start(self, batch_id: str) -> None:
        if self._closed or batch_id in self._running:
            return
        task = asyncio.get_running_loop().create_task(self._run(batch_id),
                                                      name=f"batch {batch_id}")
        self._running[batch_id] = _Running(task)
        task.add_done_callback(lambda t: self._ran(batch_id, t))

    def _ran(self, batch_id: str, task: asyncio.Task[None]) -> None:
        self._running.pop(batch_id, None)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("batch %s: its run ended with %r", batch_id, error)

    async def _run(self, batch_id: str) -> None:
        running = self._running[batch_id]
        errors: list[dict[str, Any]] | None = None
        try:
            batch = await asyncio.to_thread(self._store.batch, batch_id)
            if batch is not None and batch.status == IN_PROGRESS \
                    and await self._lines.send_all(batch):   # its window ran out
                running.stop = EXPIRED
        except asyncio.CancelledError:
            if running.stop is None:   # the gateway stops: the batch goes on next time
                await asyncio.to_thread(self._store.unsend, batch_id)
                raise
        except Exception as e:   # never lost: the batch ends failed, with why
            log.exception("batch %s failed", batch_id)
            errors = [{"code": "batch_failed", "message": str(e)[:500], "line": None,
                       "param": None}]
            running.stop = FAILED_BATCH
        async with self._ending:   # from here on no cancel cuts it off
            running.finishing = True
        try:
            await self._finish(batch_id, running.stop or COMPLETED, errors)
        except Exception as e:    # a full disk while writing its files: it ends failed
            log.exception("batch %s: its files could not be written", batch_id)
            await self._fail(batch_id, f"its output could not be written: {e}")

    async def _fail(self, batch_id: str, why: str) -> None:
        with contextlib.suppress(Exception):
            batch = await asyncio.to_thread(self._store.batch, batch_id)
            if batch is not None and batch.status not in ENDED:
                batch.errors = [{"code": "batch_failed", "message": why[:500],
                                 "line": None, "param": None}]
                batch.move(FAILED_BATCH, int(self._wall()))
                await asyncio.to_thread(self._store.save, batch)
                self._tell(batch)

    async def _progress(self, batch_id: str) -> None:
        """The batch's counts told (an event), at most every PROGRESS_S."""
        now = time.monotonic()
        if self._publish is None or now - self._published.get(batch_id, -math.inf) \
                < PROGRESS_S:
            return
        self._published[batch_id] = now
        if (batch := await asyncio.to_thread(self._store.batch, batch_id)) is not None:
            self._tell(batch)

    def _tell(self, batch: Batch) -> None:
        if self._publish is not None:
            self._publish({"type": "batch", **batch.describe(), "owner": batch.owner})

    async def _finish(self, batch_id: str, status: str,
                      errors: list[dict[str, Any]] | None = None) -> None:
        """The output and error files written from the lines' answers, then the batch
        ended as status (cancelled, where a cancel came meanwhile)."""
        # read again: a cancel may have stamped it since the run read it
        batch = await asyncio.to_thread(self._store.batch, batch_id)
        if batch is None:
            return
        if batch.status == CANCELLING:
            status = CANCELLED
        batch.errors = errors or batch.errors
        if status == COMPLETED:
            batch.move(FINALIZING, int(self._wall()))
            await asyncio.to_thread(self._store.save, batch)
        if status == EXPIRED:   # what it did not answer is said, in its error file
            await asyncio.to_thread(
                self._store.fail_unanswered, batch.id, "batch_expired",
                "the batch expired before this line was answered", request_id)
        else:   # lines cut off by a cancel: not answered, in neither file
            await asyncio.to_thread(self._store.unsend, batch.id)
        # whatever the end, what was answered is kept (a failed batch's too)
        batch.output_file_id = await self._write(batch, ok=True)
        batch.error_file_id = await self._write(batch, ok=False)
        batch.move(status, int(self._wall()))
        await asyncio.to_thread(self._store.save, batch)
        await asyncio.to_thread(self._store.drop_lines, batch.id)
        self._published.pop(batch.id, None)
        if (ended := await asyncio.to_thread(self._store.batch, batch.id)) is not None:
            self._tell(ended)
        log.info("batch %s %s", batch.id, status)

    async def _write(self, batch: Batch, *, ok: bool) -> str | None:
        """The output (ok) or error file of the batch, if it has any line (its id)."""
        lines = await asyncio.to_thread(lambda: list(self._store.results(batch.id, ok=ok)))
        if not lines:
            return None
        stored = StoredFile(id=f"file-{secrets.token_hex(12)}", owner=batch.owner,
                            purpose="batch_output",
                            filename=f"{batch.id}_{'output' if ok else 'error'}.jsonl",
                            bytes=sum(map(len, lines)), created_at=int(self._wall()))
        await asyncio.to_thread(self._store.add_file, stored, lines)
        return stored.id


def _numbers(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:10]))
    return shown + (f" and {len(numbers) - 10} more" if len(numbers) > 10 else "")


def _clean_filename(name: str) -> str:
    """A client's file name, as a label only (never a path): printable, bounded."""
    clean = "".join(c if c.isprintable() and c not in "/\\" else "_" for c in name)[:255]
    return clean or "batch.jsonl"

