"""One text field of a multipart/form-data body already read whole (an audio upload's
`model`), read with python-multipart's streaming parser (Starlette's) through its public
API: the body stays as it came, to be forwarded byte for byte.

The parser is fed a piece at a time and stopped at the field's end: clients write `model`
before the file (the OpenAI SDKs do), so a field that comes first costs the parse of its
own bytes, not the audio's.
"""

from __future__ import annotations

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

PIECE = 64 * 1024
MAX_FIELD_BYTES = 64 * 1024   # a model's name: anything longer is no name


class FormError(ValueError):
    """The body is not a multipart form the parser reads."""


def text_field(body: bytes, boundary: str, name: str) -> str | None:
    """The value of the form's first field called name that is no file (a part with a
    filename is never it), stripped; None where there is none. FormError where the body
    is not a form (or the field is past MAX_FIELD_BYTES)."""
    wanted = name.encode()
    header_name: list[bytes] = []
    header_value: list[bytes] = []
    state = {"in_field": False, "done": False}
    value: list[bytes] = []
    size = [0]

    def on_part_begin() -> None:
        state["in_field"] = False

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

    parser = MultipartParser(boundary, {
        "on_part_begin": on_part_begin, "on_header_field": on_header_field,
        "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_part_data": on_part_data, "on_part_end": on_part_end})
    try:
        for at in range(0, len(body), PIECE):
            parser.write(body[at:at + PIECE])
            if state["done"]:
                break
        else:
            parser.finalize()
    except MultipartParseError as e:
        raise FormError(str(e) or type(e).__name__) from None
    if not state["done"]:
        return None
    try:
        return b"".join(value).decode().strip() or None
    except UnicodeDecodeError:
        raise FormError(f"the form's {name!r} field is not UTF-8 text") from None
