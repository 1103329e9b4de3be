"""One text field of a multipart/form-data body already read whole (an audio upload's
`model`), read with python-multipart's streaming parser (Starlette's) through its public
API: the body stays as it came, to be forwarded byte for byte.

The parser is fed a piece at a time and stopped at the field's end: clients write `model`
before the file (the OpenAI SDKs do), so a field that comes first costs the parse of its
own bytes, not the audio's.
"""

from __future__ import annotations

import logging
import re

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

PIECE = 64 * 1024
MAX_FIELD_BYTES = 64 * 1024   # a model's name: anything longer is no name
# parts before the field: a form of many tiny parts would hold the event loop for time in
# proportion to their count (25 MB of empty parts: ~9 s); an upload has a handful
MAX_PARTS = 256
# a part's headers, as aiohttp took them (the parser's own defaults are 8 and 4224 B)
MAX_HEADERS, MAX_HEADER_BYTES = 64, 16 * 1024

# RFC 2046's bchars, 1 to 70, not ending in a space
BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")

# the parser logs each malformed form at WARNING: a client's bytes, answered with a 400,
# are no line for the journal
logging.getLogger("python_multipart").setLevel(logging.ERROR)


class FormError(ValueError):
    """The body is not a multipart form the parser reads."""


def text_field(body: bytes, boundary: str, name: str) -> str | None:
    """The value of the form's first field called name that is no file (a part with a
    filename is never it), stripped; None where there is none. FormError where the body
    is not a form (or the field is past MAX_FIELD_BYTES, or past MAX_PARTS parts).
    The value is read as UTF-8 text; a part's Content-Transfer-Encoding is not applied (no
    SDK sends one)."""
    if not BOUNDARY.fullmatch(boundary):
        raise FormError("its boundary is not 1 to 70 of the characters RFC 2046 allows")
    wanted = name.encode()
    header_name: list[bytes] = []
    header_value: list[bytes] = []
    state = {"in_field": False, "done": False}
    value: list[bytes] = []
    size, parts = [0], [0]

    def on_part_begin() -> None:
        state["in_field"] = False
        parts[0] += 1
        if parts[0] > MAX_PARTS:
            raise FormError(f"the form has more than {MAX_PARTS} parts before its "
                            f"{name!r} field")

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_name.append(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.append(data[start:end])

    def on_header_end() -> None:
        field, content = b"".join(header_name), b"".join(header_value)
        header_name.clear()
        header_value.clear()
        if field.strip().lower() == b"content-disposition":
            _, params = parse_options_header(content)
            state["in_field"] = params.get(b"name") == wanted and b"filename" not in params

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["in_field"] and not state["done"]:
            size[0] += end - start
            if size[0] > MAX_FIELD_BYTES:
                raise FormError(f"the form's {name!r} field is over {MAX_FIELD_BYTES} bytes")
            value.append(data[start:end])

    def on_part_end() -> None:
        if state["in_field"]:
            state["done"] = True

    # a preamble before the first delimiter is allowed (RFC 2046), and the parser's start
    start = body.find(b"--" + boundary.encode())
    try:
        parser = MultipartParser(boundary, {
            "on_part_begin": on_part_begin, "on_header_field": on_header_field,
            "on_header_value": on_header_value, "on_header_end": on_header_end,
            "on_part_data": on_part_data, "on_part_end": on_part_end},
            max_header_count=MAX_HEADERS, max_header_size=MAX_HEADER_BYTES)
        for at in range(max(start, 0), len(body), PIECE):
            parser.write(body[at:at + PIECE])
            if state["done"]:
                break
        else:
            parser.finalize()
    except (FormParserError, UnicodeError) as e:
        raise FormError(str(e) or type(e).__name__) from None
    if not state["done"]:
        return None
    try:
        return b"".join(value).decode().strip() or None
    except UnicodeDecodeError:
        raise FormError(f"the form's {name!r} field is not UTF-8 text") from None
