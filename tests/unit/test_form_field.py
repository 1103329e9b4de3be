"""http/form_field: the `model` field of a multipart form read from the body in memory,
wherever it lies, never a file part of that name; what is not a form is a FormError."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.http.form_field import (
    MAX_FIELD_BYTES,
    MAX_PARTS,
    PIECE,
    FormError,
    text_field,
)


def form(boundary: str, parts: Sequence[tuple[str, str | None, bytes]]) -> bytes:
    """parts: (name, filename or None, content), as the SDKs write them."""
    out = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (
            f'; filename="{filename}"' if filename is not None else "")
        out += (f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
                + ("Content-Type: audio/wav\r\n" if filename else "") + "\r\n").encode()
        out += content + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


AUDIO = b"RIFF" + bytes(range(256)) * 1000 + b"\r\n--not-the-boundary\r\n"


def test_the_model_field_before_or_after_the_file_and_never_a_file_named_model() -> None:
    assert text_field(form("b1", [("model", None, b"whisper-1"), ("file", "a.wav", AUDIO)]),
                      "b1", "model") == "whisper-1"
    assert text_field(form("b1", [("file", "a.wav", AUDIO), ("model", None, b" tiny \n")]),
                      "b1", "model") == "tiny"
    assert text_field(form("b1", [("model", "model.bin", b"not me"),
                                  ("model", None, b"me")]), "b1", "model") == "me"
    assert text_field(form("b1", [("file", "a.wav", AUDIO)]), "b1", "model") is None
    assert text_field(form("b1", [("model", None, b"  ")]), "b1", "model") is None


def test_a_field_past_the_first_piece_is_found() -> None:
    big = b"x" * (3 * PIECE + 17)
    assert text_field(form("zz", [("file", "a.wav", big), ("model", None, b"late")]),
                      "zz", "model") == "late"


@pytest.mark.parametrize("body, why", [
    (b"--x\r\nno headers end here", "invalid character"),
    (b"\xff\xfe" * 100, "boundary character"),
    (form("x", [("model", None, b"m" * (MAX_FIELD_BYTES + 1))]), "over"),
    (form("x", [("model", None, b"\xff\xfe")]), "UTF-8"),
    (form("x", [(f"f{i}", None, b"") for i in range(MAX_PARTS + 1)]
          + [("model", None, b"m")]), "parts before"),
])
def test_what_is_no_form_is_a_form_error(body: bytes, why: str) -> None:
    with pytest.raises(FormError, match=why):
        text_field(body, "x", "model")


@pytest.mark.parametrize("boundary", ["€", "\xff", "a" * 71, "ends in a space ", "", "a\r\nb"])
def test_a_boundary_rfc_2046_does_not_allow_is_a_form_error(boundary: str) -> None:
    with pytest.raises(FormError, match="RFC 2046"):
        text_field(b"--" + boundary.encode() + b"--\r\n", boundary, "model")


def test_what_aiohttp_took_is_still_taken_a_preamble_and_many_headers() -> None:
    body = form("b", [("model", None, b"m")])
    assert text_field(b"this is a preamble\r\n" + body, "b", "model") == "m"
    headers = "".join(f"X-Extra-{i}: {'v' * 100}\r\n" for i in range(20))
    many = body.replace(b"\r\n\r\n", b"\r\n" + headers.encode() + b"\r\n", 1)
    assert text_field(many, "b", "model") == "m"


@settings(max_examples=200, deadline=None)
@given(boundary=st.text("abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=40),
       model=st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1,
                     max_size=60).filter(lambda s: s.strip()),
       before=st.integers(0, 3), after=st.integers(0, 3), file_first=st.booleans())
def test_any_form_gives_its_model_field(boundary: str, model: str, before: int, after: int,
                                        file_first: bool) -> None:
    fields = [(f"f{i}", None, f"v{i}".encode()) for i in range(before)]
    tail = [(f"g{i}", None, f"w{i}".encode()) for i in range(after)]
    file = [("file", "a.wav", AUDIO)]
    parts = [*fields, *(file if file_first else []), ("model", None, model.encode()),
             *([] if file_first else file), *tail]
    assert text_field(form(boundary, parts), boundary, "model") == model.strip()
