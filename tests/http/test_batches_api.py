"""OpenAI's Batch API over real HTTP, spoken to by the official openai SDK, the engines the
fake engine (tests/fake_engine.py) behind the real request path."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gatewayd import cli
from gatewayd.core.auth import KeyRing, digest, parse_keys
from gatewayd.http.batches_api import BATCHES
from gatewayd.http.openai_api import FRONT
from tests.http.test_api_keys import ADMIN, ONLY_B, USER
from tests.http.test_front_door import Gateway, _gateway


def ring() -> KeyRing:
    """user and b-only as test_api_keys has them; ops with both scopes (the Batch API is an
    inference route: an admin-only key may not call it at all)."""
    return parse_keys({"keys": {
        "user": {"sha256": digest(USER)},
        "ops": {"sha256": digest(ADMIN), "scopes": ["admin", "inference"]},
        "b-only": {"sha256": digest(ONLY_B), "models": ["B"]},
    }}, "test")


def jsonl(*rows: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def chat_line(custom_id: str, model: str = "a", text: str = "hi") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}],
                     "max_tokens": 3}}


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("a",)):
        yield g


def sdk(gw: Gateway, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(gw.client.make_url("/v1")), api_key=key,
                              max_retries=0)


async def ended(client: openai.AsyncOpenAI, batch_id: str) -> Any:
    async with asyncio.timeout(20):
        while (batch := await client.batches.retrieve(batch_id)).status not in (
                "completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.05)
    return batch


async def test_the_sdk_runs_a_batch_and_reads_every_answer_once(gw: Gateway) -> None:
    client = sdk(gw)
    rows = [chat_line(f"q{i}", model="a" if i % 2 else "b") for i in range(6)]
    uploaded = await client.files.create(file=("in.jsonl", jsonl(*rows)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(*rows))
    batch = await client.batches.create(input_file_id=uploaded.id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"run": "1"})
    assert batch.status == "in_progress" and batch.metadata == {"run": "1"}
    done = await ended(client, batch.id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (6, 6, 0)
    assert done.output_file_id and done.error_file_id is None
    content = await client.files.content(done.output_file_id)
    answers = [json.loads(x) for x in content.text.splitlines()]
    assert [a["custom_id"] for a in answers] == [f"q{i}" for i in range(6)]
    assert all(a["response"]["status_code"] == 200 and a["error"] is None and
               a["response"]["body"]["object"] == "chat.completion" for a in answers)
    listed = await client.batches.list()
    assert [b.id for b in listed.data] == [batch.id]
    files = await client.files.list()
    assert {f.id for f in files.data} == {uploaded.id, done.output_file_id}
    deleted = await client.files.delete(uploaded.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(uploaded.id)
    rows_ = await gw.records(6)
    assert {r["batch"] for r in rows_} == {batch.id}
    assert {r["endpoint"] for r in rows_} == {"/v1/chat/completions"}
    assert {(r["status"], r["outcome"], r["completion_tokens"]) for r in rows_} == {
        (200, "ok", 3)}     # the engine's usage, as an interactive call's record has it


async def test_a_bad_file_is_refused_line_by_line_and_nothing_is_kept(gw: Gateway) -> None:
    client = sdk(gw)
    bad = jsonl(chat_line("x"), {"custom_id": "y", "method": "POST", "url": "/admin/reload",
                                 "body": {"model": "a"}}) + b"{nope\n"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.files.create(file=("in.jsonl", bad), purpose="batch")
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "invalid_batch_file"
    assert [e["line"] for e in error["errors"]] == [2, 3]
    assert (await client.files.list()).data == []


@pytest.mark.parametrize("path,status,code", [
    ("/v1/files?color=red", 400, "invalid_request"),        # a parameter not listed
    ("/v1/files?limit=0", 400, "invalid_request"),
    ("/v1/files/..%2F..%2Fbatches.db", 404, "not_found"),    # one id-like part, or nothing
    ("/v1/files/file-x/../../content", 404, "not_found"),
    ("/v1/files/a.b", 404, "not_found"),                      # not an id: no route at all
    ("/v1/files/a%2Fb/content", 404, "not_found"),
    ("/v1/batches/x%00y", 404, "not_found"),
    ("/v1/files/file-absent", 404, "file_not_found"),
    ("/v1/files/file-absent/content", 404, "file_not_found"),
    ("/v1/batches/batch_absent", 404, "batch_not_found"),
    ("/v1/batches?limit=101", 400, "invalid_request"),
])
async def test_hostile_reads_get_clear_errors(gw: Gateway, path: str, status: int,
                                              code: str) -> None:
    resp = await gw.client.get(path)
    assert resp.status == status, await resp.text()
    assert (await resp.json())["error"]["code"] == code


async def test_hostile_uploads_get_clear_errors(gw: Gateway) -> None:
    c = gw.client
    for form, code in (({"purpose": "fine-tune", "file": b"x"}, "invalid_request"),
                       ({"purpose": "batch"}, "invalid_request"),
                       ({"purpose": "batch", "file": jsonl(chat_line("a")), "extra": "1"},
                        "invalid_request")):
        data = aiohttp.FormData(default_to_multipart=True)
        for name, value in form.items():
            if isinstance(value, bytes):
                data.add_field(name, value, filename="in.jsonl")
            else:
                data.add_field(name, value)
        resp = await c.post("/v1/files", data=data)
        assert resp.status == 400 and (await resp.json())["error"]["code"] == code, form
    too_big = await c.post("/v1/files", data=b"x" * 10,
                           headers={"Content-Type": "multipart/form-data; boundary=b",
                                    "Content-Length": str(2**40)})
    assert too_big.status in (400, 413)
    not_form = await c.post("/v1/files", json={"purpose": "batch"})
    assert not_form.status == 415
    for body, code in (({}, "invalid_request"),
                       ({"input_file_id": "file-none", "endpoint": "/v1/chat/completions"},
                        "file_not_found"),
                       ({"input_file_id": "file-none", "endpoint": "/admin/reload"},
                        "invalid_batch")):
        resp = await c.post("/v1/batches", json=body)
        assert (await resp.json())["error"]["code"] == code, body
    assert not list((gw.engines.config.state_dir / "files").iterdir())


async def test_a_key_sees_only_its_own_files_and_batches(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), api_keys=ring()):
        user, admin, b_only = sdk(gw, USER), sdk(gw, ADMIN), sdk(gw, ONLY_B)
        mine = await user.files.create(file=("in.jsonl", jsonl(chat_line("1"))),
                                       purpose="batch")
        with pytest.raises(openai.NotFoundError):
            await b_only.files.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            await b_only.batches.create(input_file_id=mine.id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h")
        assert (await b_only.files.list()).data == []
        assert [f.id for f in (await admin.files.list()).data] == [mine.id]
        # b-only may use b alone: a line for a is refused when the batch is created
        theirs = await b_only.files.create(file=("in.jsonl", jsonl(chat_line("1", "a"))),
                                           purpose="batch")
        with pytest.raises(openai.BadRequestError, match="may not use model 'a'"):
            await b_only.batches.create(input_file_id=theirs.id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h")
        batch = await user.batches.create(input_file_id=mine.id,
                                          endpoint="/v1/chat/completions",
                                          completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            await b_only.batches.cancel(batch.id)
        assert (await ended(admin, batch.id)).status == "completed"
        rows = await gw.records(1)
        assert rows[0]["api_key"] == "user" and rows[0]["batch"] == batch.id
        no_key = await gw.client.get("/v1/files")
        assert no_key.status == 401


async def waiting_batch(gw: Gateway, client: openai.AsyncOpenAI) -> Any:
    """A batch whose one line waits: interactive traffic just now, and its model b not
    loaded (nothing is loaded for a batch until the gateway is quiet)."""
    batches = gw.client.app[BATCHES]
    batches.config = dataclasses.replace(batches.config, batch_idle_s=3600)
    gw.client.app[FRONT].activity.seen()
    uploaded = await client.files.create(file=("in.jsonl", jsonl(chat_line("q", "b"))),
                                         purpose="batch")
    return await client.batches.create(input_file_id=uploaded.id,
                                       endpoint="/v1/chat/completions",
                                       completion_window="24h")


async def test_the_admin_status_lists_the_batches_not_yet_ended(gw: Gateway) -> None:
    client = sdk(gw)
    batch = await waiting_batch(gw, client)
    status = await (await gw.client.get("/admin/status")).json()
    (listed,) = status["batches"]
    assert listed["id"] == batch.id and listed["status"] == "in_progress"
    assert listed["request_counts"] == {"total": 1, "completed": 0, "failed": 0}
    assert (await client.batches.cancel(batch.id)).status == "cancelling"
    assert (await ended(client, batch.id)).status == "cancelled"
    status = await (await gw.client.get("/admin/status")).json()
    assert status["batches"] == []


async def test_the_cli_lists_every_key_s_batches_and_cancels_one(
        gw: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    client = sdk(gw)
    batch = await waiting_batch(gw, client)
    url = str(gw.client.make_url(""))
    assert await asyncio.to_thread(cli.main, ["--url", url, "batches"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split() == ["ID", "KEY", "STATUS", "DONE", "FAILED", "ENDPOINT",
                                 "CREATED"]
    assert listed[1].split()[:5] == [batch.id, "-", "in_progress", "0/1", "0"]
    assert await asyncio.to_thread(cli.main, ["--url", url, "batches", "cancel",
                                              batch.id]) == 0
    assert capsys.readouterr().out.strip() == f"{batch.id}: cancelling"
    assert (await ended(client, batch.id)).status == "cancelled"
    assert await asyncio.to_thread(cli.main, ["--url", url, "batches", "cancel",
                                              batch.id]) == 1
    assert "has already ended" in capsys.readouterr().err
    assert await asyncio.to_thread(cli.main, ["--url", url, "--json", "batches"]) == 0
    assert json.loads(capsys.readouterr().out)["data"][0]["status"] == "cancelled"


async def test_json_nested_past_the_parser_and_a_broken_form_are_400s(gw: Gateway) -> None:
    deep = b"[" * 100_000
    resp = await gw.client.post("/v1/batches", data=deep,
                                headers={"Content-Type": "application/json"})
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_request"
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", deep + b"\n", filename="in.jsonl")
    resp = await gw.client.post("/v1/files", data=form)
    body = await resp.json()
    assert resp.status == 400 and body["error"]["code"] == "invalid_batch_file"
    assert "nested too deep" in body["error"]["errors"][0]["message"]
    broken = b"--b\r\nno header here\r\n\r\nx\r\n--b--\r\n"
    resp = await gw.client.post("/v1/files", data=broken,
                                headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_request"


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample of a Prometheus exposition (None: no such sample)."""
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return float(sample.value)
    return None


async def test_the_metrics_count_batch_lines_waiting_ended_and_their_tokens(
        gw: Gateway) -> None:
    client = sdk(gw)
    waiting = await waiting_batch(gw, client)
    text = await (await gw.client.get("/admin/metrics")).text()
    assert metric(text, "llm_gateway_batch_lines_waiting", model="b", state="queued") == 1
    assert (await client.batches.cancel(waiting.id)).status == "cancelling"
    await ended(client, waiting.id)
    text = await (await gw.client.get("/admin/metrics")).text()
    assert metric(text, "llm_gateway_batch_lines_waiting", model="b", state="queued") is None

    batches = gw.client.app[BATCHES]
    batches.config = dataclasses.replace(batches.config, batch_idle_s=0)
    uploaded = await client.files.create(
        file=("in.jsonl", jsonl(chat_line("x"), chat_line("y"), chat_line("z"))),
        purpose="batch")
    done = await ended(client, (await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions",
        completion_window="24h")).id)
    assert done.status == "completed"
    text = await (await gw.client.get("/admin/metrics")).text()
    assert metric(text, "llm_gateway_batch_lines_total", model="a", result="ok") == 3
    assert metric(text, "llm_gateway_batch_tokens_total", model="a", kind="completion") == 9
    # an interactive call is in the calls' figures, not in the batch lines'
    assert (await gw.client.post("/v1/chat/completions", json={
        "model": "a", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3})).status == 200
    text = await (await gw.client.get("/admin/metrics")).text()
    assert metric(text, "llm_gateway_batch_lines_total", model="a", result="ok") == 3


async def test_the_cli_follows_the_batches_with_progress_bars_until_they_end(
        gw: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    client = sdk(gw)
    uploaded = await client.files.create(
        file=("in.jsonl", jsonl(*(chat_line(f"q{i}") for i in range(4)))), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h")
    url = str(gw.client.make_url(""))
    assert await asyncio.to_thread(cli.main, ["--url", url, "batches", "--follow"]) == 0
    frames = capsys.readouterr().out.split("ID ")
    last = frames[-1].splitlines()
    assert last[0].split() == ["KEY", "STATUS", "DONE", "PROGRESS", "FAILED", "ENDPOINT",
                               "CREATED"]
    assert last[1].split()[:6] == [batch.id, "-", "completed", "4/4",
                                   "[####################]", "100%"]
    assert cli.progress_bar(9, 20) == "[#########-----------]  45%"
    assert cli.progress_bar(0, 0) == "[####################] 100%"
