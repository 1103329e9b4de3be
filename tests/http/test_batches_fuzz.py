"""The Batch API under hostile input, fuzzed: any upload (file bytes, purpose, extra fields),
any batch request body and any id in a path gets an answer below 500 in the OpenAI error
shape, and a refused upload leaves nothing on disk."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.http.test_admin_params_fuzz import NASTY, answer_of, check, json_value
from tests.http.test_front_door import Gateway, _gateway

pytestmark = pytest.mark.fuzz

LINE = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "a", "messages": [{"role": "user", "content": "hi"}]}}
FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


class Api:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def __repr__(self) -> str:
        return "<gateway>"

    def kept(self) -> set[str]:
        files = self.gw.engines.config.state_dir / "files"
        return {p.name for p in files.iterdir()} if files.is_dir() else set()


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async for g in _gateway(tmp_path, ("a",)):
        yield Api(g)


def mutated_line() -> st.SearchStrategy[bytes]:
    """A line of a batch file: a good one with a field changed, dropped or added, or
    junk."""
    field = st.sampled_from(["custom_id", "method", "url", "body", "extra"])
    changed = st.builds(lambda k, v: json.dumps({**LINE, k: v}).encode(), field, json_value)
    dropped = field.map(lambda k: json.dumps({x: v for x, v in LINE.items() if x != k})
                        .encode())
    return st.one_of(st.just(json.dumps(LINE).encode()), changed, dropped,
                     st.binary(max_size=60), st.sampled_from([s.encode() for s in NASTY]))


@FUZZ
@given(lines=st.lists(mutated_line(), max_size=6),
       purpose=st.one_of(st.just("batch"), st.sampled_from(NASTY), st.text(max_size=20)),
       extra=st.lists(st.tuples(st.sampled_from(["model", "file", "purpose", "x", ""]),
                                st.text(max_size=10)), max_size=2))
@example(lines=[b"\xff\xfe{", b""], purpose="batch", extra=[])
@example(lines=[json.dumps(LINE).encode()] * 2, purpose="batch", extra=[])
async def test_any_upload_is_answered_below_500_and_a_refused_one_keeps_nothing(
        api: Api, lines: list[bytes], purpose: str, extra: list[tuple[str, str]]) -> None:
    before = api.kept()
    form = aiohttp.FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", b"\n".join(lines), filename="in.jsonl")
    for name, value in extra:
        form.add_field(name, value)
    async with api.gw.client.post("/v1/files", data=form) as resp:
        status, body = await answer_of(resp)
    check(f"upload {lines!r} {purpose!r} {extra!r}", status, body)
    if status != 200:
        assert api.kept() == before, (status, body)
    else:
        assert api.kept() == before | {body["id"]}


@FUZZ
@given(body=st.fixed_dictionaries({}, optional={
    k: json_value for k in ("input_file_id", "endpoint", "completion_window", "metadata")}))
@example(body={"input_file_id": "../../batches.db", "endpoint": "/v1/chat/completions"})
@example(body={"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
               "metadata": {"k": 1}})
async def test_any_batch_request_is_answered_below_500(api: Api, body: dict[str, Any]) -> None:
    async with api.gw.client.post("/v1/batches", json=body) as resp:
        check(f"POST /v1/batches {body!r}", *await answer_of(resp))


@FUZZ
@given(key=st.one_of(st.sampled_from(NASTY), st.text(max_size=80)),
       route=st.sampled_from(["GET /v1/files/{}", "DELETE /v1/files/{}",
                              "GET /v1/files/{}/content", "GET /v1/batches/{}",
                              "POST /v1/batches/{}/cancel"]))
async def test_any_id_in_a_path_is_answered_below_500(api: Api, key: str, route: str) -> None:
    method, _, path = route.partition(" ")
    url = path.format(key.replace("%", "%25").replace("?", "%3F").replace("#", "%23"))
    async with api.gw.client.request(method, url) as resp:
        status, body = await answer_of(resp)
    assert status < 500, (route, key, status, body)
