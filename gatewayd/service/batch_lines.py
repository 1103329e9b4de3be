"""A batch's lines sent to the engines, out of the way of the gateway's interactive users
(service/batches runs the batches; this sends their lines).

How a batch shares the machine with its users (`may_send`):
- while interactive requests came within `batches.idle_s`, a line goes only to a model
  whose engine is already ready and has had none of its users for USER_GAP_S (a gap in
  their traffic, not a user between two requests), and at most one line per model is in
  flight: a user's request that comes meanwhile shares the engine with at most one batch
  request, and no load is started or engine evicted for a batch (bench/batch.py: one line
  in flight whatever the users did cost their p99 1.34x on the realistic model, 2 CPU
  cores);
- once the gateway has been quiet for `batches.idle_s`, lines may load their model (the
  scheduler's order applies: `low`, the lowest class) and up to `batches.concurrency`
  go to one model at once (llama-server's parallel slots).
A line goes through the request path's own journey (service/dispatcher: its turn, the send,
the one resend to an engine systemd restarts, the turn given back). A line the gateway
cannot give a turn (no room, its engine not ready) goes back to pending and is tried again;
an answer of the engine, whatever its status, is the line's answer; the gateway's own error
ends the line in the error file.
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

from gatewayd.core.batch import Batch, Line, answer_line, error_line
from gatewayd.core.catalog import Catalog, Served, named_for_engine
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.errors import (
    AdapterNotLoaded,
    ConcurrencyLimit,
    EngineBusy,
    EngineLimitReached,
    EngineUnavailable,
    GatewayError,
    GpuUnavailable,
    InsufficientGpu,
    InsufficientMemory,
    ModelDownloading,
    ModelNotLoaded,
    NoEngineReady,
    QueueFull,
    ShuttingDown,
)
from gatewayd.core.ports import BatchBook, WholeAnswers
from gatewayd.core.priority import LOW
from gatewayd.core.variants import loaded_adapters, shape_body, with_adapters

log = logging.getLogger("gatewayd.batches")

POLL_S = 0.5            # how often a waiting line looks again (a batch is not in a hurry)
USER_GAP_S = 1.0        # a gap in a model's users this long lets a batch line in
RETRY_S = 2.0           # after a line got no turn
CHUNK = 64              # pending lines read at a time
# what means "not now" for a line, not "this line failed": it is tried again (unavailable:
# where it reached no process)
NOT_NOW = (ModelNotLoaded, AdapterNotLoaded, QueueFull, EngineBusy, ConcurrencyLimit,
           EngineLimitReached, InsufficientGpu, InsufficientMemory, NoEngineReady,
           ShuttingDown, GpuUnavailable, ModelDownloading, EngineUnavailable)


T = TypeVar("T")
# a line's call, once it ended: its batch, the line, the status, the milliseconds it took,
# the gateway's error code (None: the engine answered) and the engine's answer (its JSON)
LineRecorder = Callable[[Batch, Line, int, float, str | None, Any], None]


class BatchReads(Protocol):
    def get(self, model_id: str) -> Engine | None: ...


class BatchEngines(Protocol):
    """What the batches read of the engines (service/engine_manager has it): an engine."""

    @property
    def registry(self) -> BatchReads: ...

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


class LineSender:
    """Sends batches' lines; one for all the batches of a gateway (the lines in flight
    per model are counted across them)."""

    def __init__(self, store: BatchBook, *, catalog: Catalog, engines: BatchEngines,
                 dispatcher: BatchDispatcher, answers: WholeAnswers,
                 config: Callable[[], GatewayConfig], activity: Activity,
                 record: LineRecorder | None,
                 progress: Callable[[str], Awaitable[None]],
                 wall: Callable[[], float] = time.time) -> None:
        self._store = store
        self._catalog = catalog          # a line's model: which engine, what its body gets
        self._engines = engines
        self._dispatcher = dispatcher
        self._answers = answers
        self._config = config            # the configuration in force (a reload changes it)
        self._activity = activity
        self._record = record
        self._progress = progress        # a batch's progress, told after each line
        self._in_flight: Counter[str] = Counter()   # lines on their way, per model
        self._wall = wall                # the clock of a batch's expires_at

    async def send_all(self, batch: Batch) -> bool:
        """Every pending line of batch sent, up to batches.concurrency at once, until none
        is left (False) or the batch expires (True)."""
        expires_in = batch.expires_at - self._wall()
        try:
            async with asyncio.timeout(max(0.0, expires_in)):
                while lines := await asyncio.to_thread(self._store.pending, batch.id, CHUNK):
                    async with asyncio.TaskGroup() as group:
                        queue = iter(lines)
                        for _ in range(min(self._config().batch_concurrency, len(lines))):
                            group.create_task(self._worker(batch, queue))
        except TimeoutError:
            return True
        return False

    async def _worker(self, batch: Batch, lines: Iterable[Line]) -> None:
        for line in lines:
            while not await self._send(batch, line):
                await asyncio.sleep(RETRY_S)

    async def _send(self, batch: Batch, line: Line) -> bool:
        """The line sent and its answer kept; False where it got no turn (try again). A
        line cut off (a cancel, an expiry, the gateway's stop) is left `sent`: the batch's
        run puts its lines back (or fails them) in one transaction."""
        t0 = time.monotonic()
        try:   # as the request path does (http/openai_api.parse_call): a variant's line
            # goes to its base's engine, its body changed as the variant says
            served = self._catalog.served(line.model)
            payload = json.loads(line.body)
            shape_body(served.shape, line.url, payload)
            named_for_engine(served.model, payload)
        except GatewayError as e:   # gone from the configuration since, or a bad length
            if not await asyncio.to_thread(self._store.mark_sent, batch.id, line.number):
                return True   # ended meanwhile
            return await self._failed(batch, line, t0, e)
        async with self._turn(served.model.id) as quiet:
            t0 = time.monotonic()
            try:
                if not await asyncio.to_thread(self._store.mark_sent, batch.id, line.number):
                    return True   # ended meanwhile (expired): not to be sent
                status, answer_body = await self._dispatcher.journey(
                    served.model.id, lambda engine: self._ask(engine, line.url, payload,
                                                              served),
                    autoload=quiet, priority=LOW, client=f"batch:{batch.id}")
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
        answer = _json_or_text(answer_body)
        self._note(batch, line, status, t0, None, answer)
        await asyncio.to_thread(self._store.finish, batch.id, line.number,
                                ok=200 <= status < 300,
                                result=answer_line(request_id(), line.custom_id, status,
                                                   answer))
        await self._progress(batch.id)
        return True

    async def _failed(self, batch: Batch, line: Line, t0: float, e: GatewayError) -> bool:
        """The line ended in the gateway's own error: kept in the error file."""
        self._note(batch, line, e.status, t0, e.code, None)
        await asyncio.to_thread(self._store.finish, batch.id, line.number, ok=None,
                                result=error_line(request_id(), line.custom_id, e.code,
                                                  e.message))
        await self._progress(batch.id)
        return True

    async def _ask(self, engine: Engine, url: str, payload: dict[str, Any],
                   served: Served) -> tuple[int, bytes]:
        """The line to the engine its journey took, with that engine's adapter list."""
        with_adapters(url, payload,
                      loaded_adapters(engine.adapters, served.model.config.adapters),
                      served.shape.adapter, served.id)
        return await self._answers.ask(engine.socket, url, json.dumps(payload).encode(),
                                       limit=self._config().max_answer_bytes)

    @contextlib.asynccontextmanager
    async def _turn(self, model_id: str) -> AsyncIterator[bool]:
        """Until may_send says the line may go: its place among the model's batch lines in
        flight, and whether the gateway is quiet (then it may load the model)."""
        while True:
            config = self._config()
            quiet = self._activity.quiet_for() >= config.batch_idle_s
            engine = self._engines.registry.get(model_id)
            ready = engine is not None and engine.state is EngineState.READY
            mine = self._in_flight[model_id]
            if may_send(ready=ready, quiet=quiet, in_flight=mine,
                        concurrency=config.batch_concurrency,
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


def request_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def _json_or_text(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


