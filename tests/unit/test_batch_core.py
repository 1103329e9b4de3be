"""Batch input files checked line by line, and the API's objects (core/batch): pure."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.core.batch import (
    CANCELLED,
    CANCELLING,
    IN_PROGRESS,
    MAX_PROBLEMS,
    Batch,
    answer_line,
    check_metadata,
    error_line,
    read_lines,
)
from gatewayd.core.errors import BatchFileInvalid, BatchInvalid


def line(custom_id: str = "a", url: str = "/v1/chat/completions", **body: object) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "tiny", **body}}).encode()


def test_good_lines_are_read_with_their_numbers_and_bodies() -> None:
    data = line("a") + b"\n" + line("b", "/v1/embeddings", input="x") + b"\n"
    lines = read_lines(data, max_lines=10)
    assert [(x.number, x.custom_id, x.url, x.model) for x in lines] == [
        (1, "a", "/v1/chat/completions", "tiny"), (2, "b", "/v1/embeddings", "tiny")]
    assert json.loads(lines[1].body) == {"model": "tiny", "input": "x"}


def test_crlf_and_no_final_newline_are_fine() -> None:
    assert len(read_lines(line("a") + b"\r\n" + line("b"), max_lines=10)) == 2


@pytest.mark.parametrize("bad,why", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b"", "an empty line"),
    (b"\xff\xfe", "not UTF-8"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/chat/completions",
                 "body": {"model": "m"}}).encode(), "method must be"),
    (line(url="/v1/files"), "url must be one of"),
    (line(url="/v1/chat/completions/../../admin"), "url must be one of"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
                 "body": "text"}).encode(), "body must be a JSON object"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
                 "body": {"input": "x"}}).encode(), "body.model"),
    (line(stream=True), "body.stream"),
    (json.dumps({"custom_id": "", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": "m"}}).encode(), "custom_id must be"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": "m"}, "extra": 1}).encode(), "unknown field"),
])
def test_a_bad_line_is_named_with_its_number_and_why(bad: bytes, why: str) -> None:
    data = line("first") + b"\n" + bad + b"\n" + line("third") + b"\n"
    with pytest.raises(BatchFileInvalid) as caught:
        read_lines(data, max_lines=10)
    errors = caught.value.extra["errors"]
    assert [e["line"] for e in errors] == [2], errors
    assert why in errors[0]["message"] and why in caught.value.message


def test_a_custom_id_used_twice_is_refused_naming_both_lines() -> None:
    with pytest.raises(BatchFileInvalid) as caught:
        read_lines(line("x") + b"\n" + line("y") + b"\n" + line("x"), max_lines=10)
    assert caught.value.extra["errors"][0]["line"] == 3
    assert "line 1" in caught.value.extra["errors"][0]["message"]


def test_too_many_lines_and_an_empty_file_are_refused() -> None:
    with pytest.raises(BatchFileInvalid, match="more than 2 lines"):
        read_lines(b"\n".join(line(str(i)) for i in range(3)), max_lines=2)
    with pytest.raises(BatchFileInvalid, match="no requests"):
        read_lines(b"\n", max_lines=2)


def test_a_file_of_bad_lines_names_at_most_max_problems() -> None:
    with pytest.raises(BatchFileInvalid) as caught:
        read_lines(b"x\n" * 1000, max_lines=10_000)
    assert len(caught.value.extra["errors"]) == MAX_PROBLEMS
    assert caught.value.message.startswith(f"{MAX_PROBLEMS}+ bad line(s)")


@given(st.binary(max_size=400))
def test_any_bytes_are_lines_or_a_clear_refusal(data: bytes) -> None:
    try:
        lines = read_lines(data, max_lines=50)
    except BatchFileInvalid as e:
        assert e.status == 400 and e.message and all(
            isinstance(p["line"], int) and p["message"] for p in e.extra.get("errors", []))
    else:
        assert lines and all(x.custom_id and x.model for x in lines)


def test_metadata_is_bounded_as_openai_says() -> None:
    assert check_metadata(None) is None
    assert check_metadata({"k": "v"}) == {"k": "v"}
    for bad in ({"k": 1}, {str(i): "v" for i in range(17)}, {"k" * 65: "v"}, "text"):
        with pytest.raises(BatchInvalid):
            check_metadata(bad)


def test_a_batch_is_described_as_openai_s_object_with_its_stamps() -> None:
    batch = Batch(id="batch_1", owner="", input_file_id="file-1",
                  endpoint="/v1/embeddings", completion_window="24h", created_at=100,
                  expires_at=86_500, total=3, completed=2, failed=1)
    batch.move(IN_PROGRESS, 100)
    batch.move(CANCELLING, 150)
    batch.move(CANCELLED, 160)
    doc = batch.describe()
    assert doc["object"] == "batch" and doc["status"] == CANCELLED
    assert doc["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert (doc["in_progress_at"], doc["cancelling_at"], doc["cancelled_at"]) == (100, 150, 160)
    assert doc["completed_at"] is None and doc["errors"] is None


def test_output_lines_are_openai_s() -> None:
    ok = answer_line("r1", "a", 200, {"x": 1})
    assert ok == {"id": "r1", "custom_id": "a", "error": None,
                  "response": {"status_code": 200, "request_id": "r1", "body": {"x": 1}}}
    refused = answer_line("r2", "b", 400, {"error": {"message": "bad", "code": "c"}})
    assert refused["error"] == {"code": "c", "message": "bad"}
    assert refused["response"]["status_code"] == 400
    assert error_line("r3", "c", "engine_failed", "gone") == {
        "id": "r3", "custom_id": "c", "response": None,
        "error": {"code": "engine_failed", "message": "gone"}}
