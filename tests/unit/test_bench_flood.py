"""bench/flood.py's framing of pipelined answers, and bench/refusals.py's requests."""

from __future__ import annotations

from collections import Counter

from bench import flood, refusals

ANSWERS = (b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
           b"Content-Length: 13\r\n\r\n{\"error\": {}}"
           b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\nRetry-After: 5\r\n\r\n{}"
           b"HTTP/1.1 204 No Content\r\nServer: x\r\n\r\n"
           b"HTTP/1.1 404 Not Found\r\nContent-Length: 14\r\n\r\n404: Not Found")


def test_pipelined_answers_counted_however_they_are_cut() -> None:
    for cut in range(len(ANSWERS) + 1):
        counts: Counter[bytes] = Counter()
        n1, rest = flood.split_answers(ANSWERS[:cut], counts)
        n2, rest = flood.split_answers(rest + ANSWERS[cut:], counts)
        assert n1 + n2 == 4 and rest == b"", cut
        assert counts == {b"401": 1, b"429": 1, b"204": 1, b"404": 1}, cut


def test_an_answer_waits_for_its_whole_body() -> None:
    counts: Counter[bytes] = Counter()
    n, rest = flood.split_answers(ANSWERS[:-1], counts)
    assert n == 3 and rest.endswith(b"404: Not Foun") and counts[b"404"] == 0


def test_each_refusal_request_is_whole_and_says_one_reason() -> None:
    got = refusals.refusal_requests(18650, 18651, "fake")
    assert set(got) == {*refusals.KINDS, refusals.BARE}
    for kind, raw in got.items():
        head, _, body = raw.partition(b"\r\n\r\n")
        fields = head.split(b"\r\n")[1:]
        length = [f for f in fields if f.lower().startswith(b"content-length:")]
        assert len(body) == (int(length[0].split(b":")[1]) if length else 0), kind
    key = f"Authorization: Bearer {refusals.USER_KEY}".encode()
    assert key not in got["401"] and key in got["415"] and key in got["421"]
    assert b"Host: evil.example\r\n" in got["421"]
    assert b"Origin: https://evil.example" in got["403"]
    assert b"Content-Type: text/plain" in got["415"] and b"follow=1" in got["429"]
