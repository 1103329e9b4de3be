"""Batches run (service/batches) over the real store (SQLite in a temporary state dir), a
stand-in for the request path's journey and for the engines' answers."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gatewayd.adapters.batch_store import BatchStore
from gatewayd.core import batch as core
from gatewayd.core.catalog import Catalog, Model, Variant
from gatewayd.core.config import Backend, GatewayConfig, ModelConfig
from gatewayd.core.engines import Engine, EngineState
from gatewayd.core.errors import (
    BatchEnded,
    BatchInvalid,
    EngineFailed,
    FileInUse,
    FileNotFound,
    GatewayError,
    ModelNotLoaded,
)
from gatewayd.core.priority import LOW
from gatewayd.core.variants import Shape, VariantConfig
from gatewayd.service import batch_lines as service
from gatewayd.service.batch_lines import Activity, may_send
from gatewayd.service.batches import Batches

T = TypeVar("T")


class Engines:
    """The registry part of the engine layer, as the batches read it."""

    def __init__(self) -> None:
        self.ready: set[str] = {"tiny", "other"}

    @property
    def registry(self) -> Engines:
        return self

    def get(self, model_id: str) -> Engine | None:
        state = EngineState.READY if model_id in self.ready else EngineState.STOPPED
        return Engine(model_id=model_id, unit=f"u-{model_id}", socket=f"/s/{model_id}",
                      state=state)


class Journeys:
    """The request path's journey: asked turns, and errors to raise first."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, bool, int, str | None]] = []
        self.raise_first: list[GatewayError] = []
        self.users: dict[str, int] = {}   # interactive requests at each model's engine
        self.batch_lines: dict[str, int] = {}

    def requests(self, model_id: str) -> int:
        return self.users.get(model_id, 0) + self.batch_lines.get(model_id, 0)

    async def journey(self, model_id: str, send: Callable[[Engine], Awaitable[T]], *,
                      autoload: bool, priority: int, client: str | None) -> T:
        self.asked.append((model_id, autoload, priority, client))
        if self.raise_first:
            raise self.raise_first.pop(0)
        return await send(Engines().get(model_id))  # type: ignore[arg-type]


class Answers:
    """The engines: an answer per request, after `hold` (an Event blocks it)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gate: asyncio.Event | None = None

    async def ask(self, socket: str, target: str, body: bytes, *, limit: int
                  ) -> tuple[int, bytes]:
        request = json.loads(body)
        self.sent.append(request)
        if self.gate is not None:
            await self.gate.wait()
        if request.get("input") == "refuse":
            return 400, b'{"error": {"message": "no", "code": "bad_input"}}'
        if request.get("input") == "crash":
            raise EngineFailed("the engine stopped in the middle of the answer")
        return 200, json.dumps({"echo": request.get("input"), "target": target}).encode()


def lines(*inputs: str, model: str = "tiny", url: str = "/v1/embeddings",
          first: int = 0) -> bytes:
    return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                                "body": {"model": model, "input": text}}).encode() + b"\n"
                    for i, text in enumerate(inputs, first))


class Setup:
    def __init__(self, tmp: Path, **config: Any) -> None:
        self.tmp = tmp
        models = [Model(id=name, config=ModelConfig(name=name, path=tmp / f"{name}.gguf"),
                        names=frozenset({name}), size_bytes=1) for name in ("tiny", "other")]
        self.catalog = Catalog(models, {})
        self.config = GatewayConfig(state_dir=tmp, batch_idle_s=0.0,
                                    batch_disk_reserve_bytes=0, **config)
        self.engines, self.journeys, self.answers = Engines(), Journeys(), Answers()
        self.activity = Activity()
        self.noted: list[tuple[str, int, str | None]] = []
        self.batches = self.open()

    def open(self) -> Batches:
        return Batches(BatchStore(self.tmp), engines=self.engines, dispatcher=self.journeys,
                       answers=self.answers, config=self.config, catalog=self.catalog,
                       activity=self.activity,
                       record=lambda b, line, status, ms, code, answer: self.noted.append(
                           (line.custom_id, status, code)))

    async def run(self, data: bytes, *, owner: str = "", **kw: Any) -> core.Batch:
        stored = await self.batches.upload(owner, "in.jsonl", data)
        return await self.batches.create(owner, input_file_id=stored.id,
                                         endpoint=kw.pop("endpoint", "/v1/embeddings"),
                                         completion_window="24h", metadata=None,
                                         may_use=kw.pop("may_use", lambda m: True))

    async def ended(self, batch_id: str, timeout: float = 10.0) -> core.Batch:
        async with asyncio.timeout(timeout):
            while (b := await self.batches.batch(None, batch_id)).status not in core.ENDED:
                await asyncio.sleep(0.01)
        return b

    async def content(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        path = await self.batches.content_path(None, file_id)
        return [json.loads(x) for x in Path(path).read_bytes().splitlines()]


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "POLL_S", 0.01)
    monkeypatch.setattr(service, "RETRY_S", 0.01)


@pytest.fixture
async def s(tmp_path: Path) -> AsyncIterator[Setup]:
    setup = Setup(tmp_path)
    yield setup
    await setup.batches.close()


async def test_every_line_is_answered_once_in_order_at_the_lowest_priority(s: Setup) -> None:
    batch = await s.run(lines("a", "b", "refuse", "crash", "e"))
    done = await s.ended(batch.id)
    assert done.status == core.COMPLETED
    assert (done.total, done.completed, done.failed) == (5, 3, 2)
    out = await s.content(done.output_file_id)
    assert [(x["custom_id"], x["response"]["body"]["echo"]) for x in out] == [
        ("c0", "a"), ("c1", "b"), ("c4", "e")]
    errors = await s.content(done.error_file_id)
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
        ("c2", "bad_input"), ("c3", "engine_failed")]
    assert errors[0]["response"]["status_code"] == 400 and errors[1]["response"] is None
    assert sorted(r["input"] for r in s.answers.sent) == ["a", "b", "crash", "e", "refuse"]
    assert {(m, p, c) for m, _, p, c in s.journeys.asked} == {
        ("tiny", LOW, f"batch:{batch.id}")}
    assert len(s.noted) == 5 and ("c3", 502, "engine_failed") in s.noted
    assert done.stamps.keys() >= {"in_progress_at", "finalizing_at", "completed_at"}


async def test_a_variants_line_goes_to_its_bases_engine_changed_as_the_variant_says(
        s: Setup) -> None:
    """As the request path: a variant's defaults fill what the line left out, its base's
    engine answers, and the line keeps the variant's name."""
    tiny = s.catalog.get("tiny")
    assert tiny is not None
    s.catalog.replace(Catalog(list(s.catalog), {}, [Variant(
        id="short", base=tiny, names=frozenset({"short"}),
        shape=Shape(defaults={"encoding_format": "base64", "input": "never"}),
        config=VariantConfig(name="short", variant_of="tiny"))]))
    done = await s.ended((await s.run(lines("a", model="short"))).id)
    assert (done.completed, done.failed) == (1, 0)
    assert s.answers.sent == [{"model": "short", "input": "a", "encoding_format": "base64"}]
    assert [m for m, *_ in s.journeys.asked] == ["tiny"]


async def test_an_openai_servers_line_names_the_model_by_its_id(s: Setup) -> None:
    """As the request path: a strict server (vLLM) knows its model by its id only."""
    srv = Model(id="srv", config=ModelConfig(name="srv", path=None, backend=Backend.OPENAI,
                                             command=("srv", "--uds", "{socket}")),
                names=frozenset({"srv", "alias"}))
    s.catalog.replace(Catalog([srv], {}, [Variant(
        id="srv-cold", base=srv, names=frozenset({"srv-cold"}), shape=Shape(),
        config=VariantConfig(name="srv-cold", variant_of="srv"))]))
    s.engines.ready.add("srv")
    data = lines("a", model="alias") + lines("b", model="srv-cold", first=1)
    done = await s.ended((await s.run(data)).id)
    assert (done.completed, done.failed) == (2, 0)
    assert [r["model"] for r in s.answers.sent] == ["srv", "srv"]


async def test_a_line_that_gets_no_turn_is_tried_again_not_failed(s: Setup) -> None:
    s.journeys.raise_first = [ModelNotLoaded("not now"), ModelNotLoaded("not now")]
    done = await s.ended((await s.run(lines("a"))).id)
    assert (done.completed, done.failed) == (1, 0)
    assert len(s.journeys.asked) == 3 and len(s.answers.sent) == 1


async def test_while_interactive_traffic_came_lately_a_line_waits_for_a_ready_engine(
        s: Setup) -> None:
    s.config = s.batches.config = GatewayConfig(state_dir=s.tmp, batch_idle_s=3600,
                                                batch_disk_reserve_bytes=0)
    s.activity.seen()
    s.engines.ready = {"other"}   # tiny is not loaded: nothing may load it yet
    batch = await s.run(lines("a", "b", model="tiny"))
    await asyncio.sleep(0.2)
    assert s.journeys.asked == []
    assert (await s.batches.batch(None, batch.id)).status == "in_progress"
    s.engines.ready = {"tiny"}    # loaded by someone else: its lines go, never loading
    done = await s.ended(batch.id)
    assert done.completed == 2 and {a for _, a, _, _ in s.journeys.asked} == {False}


def test_may_send_keeps_a_batch_to_one_line_per_ready_engine_until_quiet() -> None:
    assert not may_send(ready=False, quiet=False, in_flight=0, concurrency=4, others=0)
    assert may_send(ready=True, quiet=False, in_flight=0, concurrency=4, others=0)
    assert not may_send(ready=True, quiet=False, in_flight=1, concurrency=4, others=0)
    # a user's request at the engine: the line waits for the engine's next gap
    assert not may_send(ready=True, quiet=False, in_flight=0, concurrency=4, others=1)
    # ... and a gap of a moment is a user between two requests
    assert not may_send(ready=True, quiet=False, in_flight=0, concurrency=4, others=0,
                        model_quiet_s=0.2)
    assert may_send(ready=True, quiet=False, in_flight=0, concurrency=4, others=0,
                    model_quiet_s=1.5)
    assert may_send(ready=False, quiet=True, in_flight=3, concurrency=4, others=0)
    assert not may_send(ready=True, quiet=True, in_flight=4, concurrency=4, others=0)


async def test_a_line_waits_for_a_gap_in_its_engine_s_users(
        s: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    s.config = s.batches.config = GatewayConfig(state_dir=s.tmp, batch_idle_s=3600,
                                                batch_disk_reserve_bytes=0)
    monkeypatch.setattr(service, "USER_GAP_S", 0.3)
    s.activity.seen("tiny")
    s.journeys.users["tiny"] = 1      # someone is being answered by tiny
    batch = await s.run(lines("a"))
    await asyncio.sleep(0.2)
    assert s.journeys.asked == []
    s.journeys.users["tiny"] = 0      # a gap: the line goes
    assert (await s.ended(batch.id)).completed == 1


async def test_cancel_stops_the_lines_in_flight_and_keeps_what_is_done(s: Setup) -> None:
    batch = await s.run(lines("a"))
    await s.ended(batch.id)
    s.answers.gate = asyncio.Event()    # the next batch's lines hang in the engine
    second = await s.run(lines("x", "y", "z"))
    async with asyncio.timeout(5):
        while not s.answers.sent[1:]:
            await asyncio.sleep(0.01)
    assert (await s.batches.cancel(None, second.id)).status == core.CANCELLING
    done = await s.ended(second.id, timeout=5)
    assert done.status == core.CANCELLED and done.completed == 0
    assert done.stamps.keys() >= {"in_progress_at", "cancelling_at", "cancelled_at"}
    assert done.output_file_id is None
    assert (await s.batches.batch(None, batch.id)).status == core.COMPLETED   # the other is kept


async def test_a_line_on_its_way_at_a_crash_is_sent_again_once(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.answers.gate = asyncio.Event()
    batch = await s.run(lines("a", "b"))
    async with asyncio.timeout(5):
        while len(s.answers.sent) < 2:
            await asyncio.sleep(0.01)
    # a crash: the first run is abandoned as it is (both lines `sent`, attempt 1): no
    # handler of it runs until the second run is done
    with sqlite3.connect(tmp_path / "batches.db") as db:
        assert db.execute("SELECT state, attempts FROM lines").fetchall() == [("sent", 1)] * 2
    # a second run of the gateway on the same state dir
    again = Setup(tmp_path)
    await again.batches.start()
    done = await again.ended(batch.id)
    assert done.completed == 2 and sorted(r["input"] for r in again.answers.sent) == ["a", "b"]
    await s.batches.close()   # (the abandoned run's tasks: what they undo is long done)
    assert (await again.batches.batch(None, batch.id)).completed == 2
    await again.batches.close()


async def test_a_line_sent_twice_when_the_gateway_stopped_is_failed_not_sent_again(
        tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.config = s.batches.config = GatewayConfig(state_dir=tmp_path, batch_idle_s=3600,
                                                batch_disk_reserve_bytes=0)
    s.engines.ready = set()     # nothing runs: the lines stay pending
    s.activity.seen()
    batch = await s.run(lines("a"))
    store: BatchStore = s.batches._store   # type: ignore[assignment]
    store.mark_sent(batch.id, 1)
    store.resume(batch.id)
    store.mark_sent(batch.id, 1)          # sent, then the gateway died; sent, died again
    await s.batches.close()
    again = Setup(tmp_path)
    await again.batches.start()
    done = await again.ended(batch.id)
    assert (done.completed, done.failed) == (0, 1) and again.answers.sent == []
    assert (await again.content(done.error_file_id))[0]["error"]["code"] == "interrupted"
    await again.batches.close()


async def test_a_batch_expires_when_its_window_runs_out(
        s: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window of a second: its lines hang in the engine, and the window's end stops
    them."""
    monkeypatch.setitem(core.WINDOWS, "24h", 1)
    s.answers.gate = asyncio.Event()
    batch = await s.run(lines("a", "b"))
    done = await s.ended(batch.id, timeout=5)
    assert done.status == core.EXPIRED and done.stamps.get("expired_at")
    assert sorted(x["custom_id"] for x in await s.content(done.error_file_id)) == ["c0", "c1"]


async def test_an_expired_batch_keeps_its_answers_and_lists_the_rest(s: Setup) -> None:
    s.answers.gate = asyncio.Event()
    batch = await s.run(lines("a", "b"))
    async with asyncio.timeout(5):
        while not s.answers.sent:
            await asyncio.sleep(0.01)
    # its window passes: the lines in flight are stopped, the pending ones listed
    s.batches._wall = lambda: 10**10
    running = s.batches._running[batch.id]
    running.stop = core.EXPIRED
    running.task.cancel()
    done = await s.ended(batch.id)
    assert done.status == core.EXPIRED
    assert {x["error"]["code"] for x in await s.content(done.error_file_id)} == {"batch_expired"}


async def test_a_batch_is_checked_whole_before_it_exists(s: Setup) -> None:
    data = lines("a") + lines("b", model="absent", first=1)
    stored = await s.batches.upload("", "in.jsonl", data)
    with pytest.raises(BatchInvalid, match="line 2: model 'absent' is not served here"):
        await s.batches.create("", input_file_id=stored.id, endpoint="/v1/embeddings",
                               completion_window="24h", metadata=None, may_use=lambda m: True)
    with pytest.raises(BatchInvalid, match="may not use model 'other'"):
        await s.run(lines("a", model="other"), may_use=lambda m: m == "tiny")
    with pytest.raises(BatchInvalid, match="another url"):
        await s.run(lines("a"), endpoint="/v1/chat/completions")
    assert await s.batches.batches(None, after=None, limit=10) == ([], False)


async def test_files_are_their_owner_s(s: Setup) -> None:
    mine = await s.batches.upload("alice", "a.jsonl", lines("a"))
    with pytest.raises(FileNotFound):
        await s.batches.file("bob", mine.id)
    assert await s.batches.file("alice", mine.id) == mine == await s.batches.file(None, mine.id)
    assert await s.batches.files("bob", purpose=None, after=None, limit=10,
                           newest_first=True) == ([], False)
    batch = await s.run(lines("a"), owner="alice")
    input_id = (await s.batches.batch("alice", batch.id)).input_file_id
    s.answers.gate = asyncio.Event()
    running = await s.run(lines("x"), owner="alice")
    with pytest.raises(FileInUse):
        busy = (await s.batches.batch(None, running.id)).input_file_id
        await s.batches.delete_file("alice", busy)
    s.answers.gate.set()
    await s.ended(running.id)
    await s.ended(batch.id)
    await s.batches.delete_file("alice", input_id)
    with pytest.raises(FileNotFound):
        await s.batches.file(None, input_id)


def held_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """A batch's files written only once the second event is set; the first, set when the
    writing began."""
    writing, go_on = asyncio.Event(), asyncio.Event()
    write = Batches._write

    async def held(self: Batches, batch: core.Batch, *, ok: bool) -> str | None:
        writing.set()
        await go_on.wait()
        return await write(self, batch, ok=ok)
    monkeypatch.setattr(Batches, "_write", held)
    return writing, go_on


async def test_a_cancel_while_its_files_are_written_is_refused_and_the_batch_ends(
        s: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every line answered, the files being written: a cancel then (a double click, the
    admin and the user both) must not cut the writing off (it left the batch `finalizing`
    or `cancelling` for good, with no run to end it)."""
    writing, go_on = held_writes(monkeypatch)
    batch = await s.run(lines("a"))
    async with asyncio.timeout(5):
        await writing.wait()
    with pytest.raises(BatchEnded, match="finalizing"):
        await s.batches.cancel(None, batch.id)
    go_on.set()
    done = await s.ended(batch.id)
    assert done.status == core.COMPLETED and done.output_file_id


async def test_a_batch_whose_files_cannot_be_written_ends_failed_not_stuck(
        s: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    async def full_disk(self: Batches, batch: core.Batch, *, ok: bool) -> str | None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Batches, "_write", full_disk)
    done = await s.ended((await s.run(lines("a"))).id)
    assert done.status == core.FAILED_BATCH and done.errors
    assert "No space left" in done.errors[0]["message"]


async def test_the_gateway_s_stop_puts_lines_in_flight_back_uncounted(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.answers.gate = asyncio.Event()
    batch = await s.run(lines("a"))
    async with asyncio.timeout(5):
        while not s.answers.sent:
            await asyncio.sleep(0.01)
    store: BatchStore = s.batches._store   # type: ignore[assignment]
    await s.batches.close()
    reopened = BatchStore(tmp_path)
    assert [x.number for x in reopened.pending(batch.id, 10)] == [1]
    assert reopened.resume(batch.id) == []   # nothing `sent`: no attempt spent
    assert store is not reopened
    reopened.close()


def test_a_line_that_is_no_longer_pending_is_not_marked_sent(tmp_path: Path) -> None:
    """The expiry's one transaction may fail a line while its worker is about to mark it
    sent: the mark must not bring it back (it was in neither file, `sent` for good)."""
    store = BatchStore(tmp_path)
    batch = core.Batch(id="batch_x", owner="", input_file_id="file-x", endpoint="/v1/embeddings",
                       completion_window="24h", created_at=0, expires_at=1)
    store.add_batch(batch, core.read_lines(lines("a", "b"), max_lines=10))
    assert store.mark_sent("batch_x", 1)
    assert store.fail_unanswered("batch_x", "batch_expired", "expired", lambda: "r") == 2
    assert not store.mark_sent("batch_x", 2)
    errors = [json.loads(x) for x in store.results("batch_x", ok=False)]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("c0", "batch_expired"), ("c1", "batch_expired")]
    store.close()


async def test_a_cancel_while_an_expired_batch_writes_its_files_is_refused(
        s: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """An expired batch is never `finalizing`: only the run knows it is past its lines."""
    monkeypatch.setitem(core.WINDOWS, "24h", 1)
    writing, go_on = held_writes(monkeypatch)
    s.answers.gate = asyncio.Event()     # its line hangs until the window ends
    batch = await s.run(lines("a"))
    async with asyncio.timeout(5):
        await writing.wait()
    with pytest.raises(BatchEnded, match="finalizing"):
        await s.batches.cancel(None, batch.id)
    go_on.set()
    assert (await s.ended(batch.id)).status == core.EXPIRED
