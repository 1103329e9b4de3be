"""Batch jobs run: files kept, batches created from them and run line by line at the
lowest priority, in the machine's idle time, resumed across restarts (core/batch says
the API's objects and states; adapters/batch_store keeps them).

How a batch shares the machine with its interactive users (`may_send`):
- while interactive requests came within `batches.idle_s`, a batch line goes only to a
  model whose engine is already ready and has had none of its users for USER_GAP_S (a
  gap in their traffic, not a user between two requests), and at most one line per model
  is in flight: a user's request that
  comes meanwhile shares the engine with at most one batch request, and nothing is
  loaded or evicted for a batch (bench/batch.py: one line in flight whatever the users
  did cost their p99 1.34x on the realistic model, 2 CPU cores);
- once the gateway has been quiet for `batches.idle_s`, lines may load their model (the
  scheduler's order applies: `low`, the lowest class) and up to `batches.concurrency`
  go to one model at once (llama-server's parallel slots).
A line the gateway cannot give a turn (no room, its engine not ready) goes back to
pending and is tried again; an answer of the engine, whatever its status, is the line's
answer; the gateway's own error ends the line in the error file.

Cancel and expiry stop the lines in flight (their requests are dropped, the engine stops
generating) and keep every line already answered; an expired batch's unanswered lines
go to its error file as `batch_expired`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeVar

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
    answer_line,
    check_metadata,
    error_line,
    read_lines,
)
from gatewayd.core.catalog import Catalog
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.errors import (
    BatchEnded,
    BatchInvalid,
    BatchNotFound,
    ConcurrencyLimit,
    EngineBusy,
    EngineLimitReached,
    EngineUnavailable,
    FileInUse,
    FileNotFound,
    GatewayError,
    GpuUnavailable,
    InsufficientGpu,
    InsufficientMemory,
    ModelDownloading,
    ModelNotFound,
    ModelNotLoaded,
    NoEngineReady,
    QueueFull,
    ShuttingDown,
    StorageFull,
)
from gatewayd.core.ports import BatchBook, WholeAnswers
from gatewayd.core.priority import LOW

log = logging.getLogger("gatewayd.batches")

POLL_S = 0.5            # how often a waiting line looks again (a batch is not in a hurry)
PROGRESS_S = 1.0        # a batch's progress event at most this often
USER_GAP_S = 1.0        # a gap in a model's users this long lets a batch line in
CLOSE_WAIT_S = 10.0     # the gateway's stop waits this long for a batch writing its files
RETRY_S = 2.0           # after a line got no turn
CHUNK = 64              # pending lines read at a time
# what means "not now" for a line, not "this line failed": it is tried again
NOT_NOW = (ModelNotLoaded, QueueFull, EngineBusy, ConcurrencyLimit, EngineLimitReached,
           InsufficientGpu, InsufficientMemory, NoEngineReady, ShuttingDown, GpuUnavailable,
           ModelDownloading, EngineUnavailable)   # (unavailable: where it reached no process)


T = TypeVar("T")
# a line's call, once it ended: its batch, the line, the status, the milliseconds it took,
# the gateway's error code (None: the engine answered) and the engine's answer (its JSON)
LineRecorder = Callable[[Batch, Line, int, float, str | None, Any], None]


class BatchEngines(Protocol):
    """What the batches read of the engines (service/engine_manager has it)."""

    def get(self, model_id: str) -> Engine | None: ...


class BatchDispatcher(Protocol):
    """The request path's own way to an engine (service/dispatcher has it)."""

    async def journey(self, model_id: str, send: Callable[[Engine], Awaitable[T]], *,
                      autoload: bool, priority: int, client: str | None) -> T: ...

    def requests(self, model_id: str) -> int: ...


class Activity:
    """When the gateway last had an interactive request, and each model (the front door
    tells it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = -math.inf
        self._models: dict[str, float] = {}

    def seen(self, model_id: str | None = None) -> None:
        self._last = now = self._clock()
        if model_id is not None:
            self._models[model_id] = now

    def quiet_for(self, model_id: str | None = None) -> float:
        """Seconds since the last interactive request (model_id's, where given)."""
        last = self._last if model_id is None else self._models.get(model_id, -math.inf)
        return self._clock() - last


def may_send(*, ready: bool, quiet: bool, in_flight: int, concurrency: int,
             others: int, model_quiet_s: float = math.inf) -> bool:
    """Whether a batch line may go to its model now (the module's docstring says why):
    in_flight, the batches' own lines on their way to it; others, the requests of its users
    its engine serves or has queued; model_quiet_s, since its users' last request (a gap
    shorter than USER_GAP_S is a user between two requests: a script's loop, a chat's
    next turn, whose next request would meet the line)."""
    if quiet:
        return in_flight < concurrency
    return ready and in_flight < 1 and others == 0 and model_quiet_s >= USER_GAP_S


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
        self._engines = engines
        self._dispatcher = dispatcher
        self._answers = answers
        self.config = config
        self._catalog = catalog
        self._activity = activity
        self._record = record
        self._publish = publish
        self._published: dict[str, float] = {}   # when each batch's progress was last told
        self._ending = asyncio.Lock()   # a cancel and a batch's end: one at a time
        self._wall = wall
        self._running: dict[str, _Running] = {}
        self._in_flight: Counter[str] = Counter()   # lines on their way, per model
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
            model = self._catalog.resolve(line.model)
        except ModelNotFound:
            raise BatchInvalid(f"line {line.number}: model {line.model!r} is not served "
                               "here (a batch runs on this gateway's own engines)",
                               param="input_file_id", line=line.number) from None
        if not may_use(model.id):
            raise BatchInvalid(f"line {line.number}: the key may not use model "
                               f"{line.model!r}", param="input_file_id", line=line.number)
        return Line(line.number, line.custom_id, line.url, model.id, line.body)

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
                    _request_id(), custom_id, "interrupted", "the gateway stopped while "
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
            if batch is not None and batch.status == IN_PROGRESS:
                await self._send_all(batch)   # (sets EXPIRED where its window ran out)
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

    async def _send_all(self, batch: Batch) -> None:
        """Every pending line sent, up to batches.concurrency at once, until none is left
        or the batch expires."""
        expires_in = batch.expires_at - self._wall()
        try:
            async with asyncio.timeout(max(0.0, expires_in)):
                while lines := await asyncio.to_thread(self._store.pending, batch.id, CHUNK):
                    async with asyncio.TaskGroup() as group:
                        queue = iter(lines)
                        for _ in range(min(self.config.batch_concurrency, len(lines))):
                            group.create_task(self._worker(batch, queue))
        except TimeoutError:
            running = self._running.get(batch.id)
            if running is not None:
                running.stop = EXPIRED

    async def _worker(self, batch: Batch, lines: Iterable[Line]) -> None:
        for line in lines:
            while not await self._send(batch, line):
                await asyncio.sleep(RETRY_S)

    async def _send(self, batch: Batch, line: Line) -> bool:
        """The line sent and its answer kept; False where it got no turn (try again). A
        line cut off (a cancel, an expiry, the gateway's stop) is left `sent`: the batch's
        run puts its lines back (or fails them) in one transaction."""
        async with self._turn(line.model) as quiet:
            t0 = time.monotonic()
            try:
                if not await asyncio.to_thread(self._store.mark_sent, batch.id, line.number):
                    return True   # ended meanwhile (expired): not to be sent
                status, body = await self._dispatcher.journey(
                    line.model, lambda engine: self._ask(engine, line), autoload=quiet,
                    priority=LOW, client=f"batch:{batch.id}")
            except NOT_NOW as e:
                if isinstance(e, EngineUnavailable) and not e.reached_no_process:
                    return await self._failed(batch, line, t0, e)   # it may have been read
                log.debug("batch %s line %d: not now (%s)", batch.id, line.number, e.code)
                await asyncio.to_thread(self._store.unsend, batch.id, line.number)
                return False
            except GatewayError as e:
                return await self._failed(batch, line, t0, e)
            except Exception as e:   # one line's surprise fails that line, not the batch
                log.exception("batch %s line %d", batch.id, line.number)
                return await self._failed(batch, line, t0, GatewayError(
                    f"the gateway failed to send this line: {type(e).__name__}"))
        answer = _json_or_text(body)
        self._note(batch, line, status, t0, None, answer)
        await asyncio.to_thread(self._store.finish, batch.id, line.number,
                                ok=200 <= status < 300,
                                result=answer_line(_request_id(), line.custom_id, status,
                                                   answer))
        await self._progress(batch.id)
        return True

    async def _failed(self, batch: Batch, line: Line, t0: float, e: GatewayError) -> bool:
        """The line ended in the gateway's own error: kept in the error file."""
        self._note(batch, line, e.status, t0, e.code, None)
        await asyncio.to_thread(self._store.finish, batch.id, line.number, ok=None,
                                result=error_line(_request_id(), line.custom_id, e.code,
                                                  e.message))
        await self._progress(batch.id)
        return True

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

    async def _ask(self, engine: Engine, line: Line) -> tuple[int, bytes]:
        return await self._answers.ask(engine.socket, line.url, line.body,
                                       limit=self.config.max_answer_bytes)

    @contextlib.asynccontextmanager
    async def _turn(self, model_id: str) -> AsyncIterator[bool]:
        """Until may_send says the line may go: its place among the model's batch lines in
        flight, and whether the gateway is quiet (then it may load the model)."""
        while True:
            quiet = self._activity.quiet_for() >= self.config.batch_idle_s
            engine = self._engines.get(model_id)
            ready = engine is not None and engine.state is EngineState.READY
            mine = self._in_flight[model_id]
            if may_send(ready=ready, quiet=quiet, in_flight=mine,
                        concurrency=self.config.batch_concurrency,
                        others=max(0, self._dispatcher.requests(model_id) - mine),
                        model_quiet_s=self._activity.quiet_for(model_id)):
                break
            await asyncio.sleep(POLL_S)
        self._in_flight[model_id] += 1
        try:
            yield quiet
        finally:
            self._in_flight[model_id] -= 1

    def _note(self, batch: Batch, line: Line, status: int, t0: float,
              error_code: str | None, answer: Any) -> None:
        if self._record is not None:
            self._record(batch, line, status, (time.monotonic() - t0) * 1000, error_code,
                         answer)

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
                "the batch expired before this line was answered", _request_id)
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


def _request_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def _json_or_text(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


def _numbers(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:10]))
    return shown + (f" and {len(numbers) - 10} more" if len(numbers) > 10 else "")


def _clean_filename(name: str) -> str:
    """A client's file name, as a label only (never a path): printable, bounded."""
    clean = "".join(c if c.isprintable() and c not in "/\\" else "_" for c in name)[:255]
    return clean or "batch.jsonl"

