"""Values from outside that become paths: the one place that makes them safe or refuses
them. Pure (pathlib's joins touch no disk).

A name a client chose (a model to pull or remove), a hub's listing (file names, content
hashes, blob ids, commits) and anything read back from a record the gateway wrote reach
the filesystem only as one *part*: a single path component of ASCII letters, digits and
`_ + - .`, not starting with a dot (so never `.`, `..` or a hidden file), at most 255
bytes (a file name's limit on every Linux filesystem). A slash, a NUL, a newline, a
unicode look-alike of any of them, an empty string: refused, never rewritten, so a
refused value cannot collide with an accepted one. `inside` joins parts under a root
the gateway chose; `digest` checks a hash before it names a file.
"""

from __future__ import annotations

import re
from pathlib import Path

from gatewayd.core.errors import UnsafePath

MAX_PART = 255
_PART = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]{0,254}")
_HEX = re.compile(r"[0-9a-f]+")
# the hashes a hub names content by: git's blob/commit ids (SHA-1, or SHA-256 in a
# SHA-256 repository) and LFS's SHA-256
DIGEST_LENGTHS = (40, 64)


def is_part(value: object) -> bool:
    return isinstance(value, str) and _PART.fullmatch(value) is not None


def path_part(value: object, *, what: str) -> str:
    """`value` as one path component, or UnsafePath (400) naming `what` it was."""
    if not is_part(value):
        shown = repr(value)
        raise UnsafePath(f"{what} {shown[:80]}{'...' if len(shown) > 80 else ''} cannot name "
                         "a file here: use ASCII letters, digits, '_', '+', '-' and '.', "
                         f"not starting with '.', at most {MAX_PART} characters")
    assert isinstance(value, str)
    return value


def inside(root: Path, *parts: object, what: str) -> Path:
    """root/part/part...: each part checked by `path_part`, so the result is below root."""
    return root.joinpath(*(path_part(p, what=what) for p in parts))


def digest(value: object, *, what: str) -> str:
    """A content hash as lower-case hex of a length hashes have, or UnsafePath."""
    if isinstance(value, str) and value.isascii() and len(value) in DIGEST_LENGTHS and \
            _HEX.fullmatch(value.lower()) is not None:
        return value.lower()
    shown = repr(value)
    raise UnsafePath(f"{what} {shown[:80]} is not a hash (hex of {DIGEST_LENGTHS[0]} or "
                     f"{DIGEST_LENGTHS[1]} characters)")


def relative_parts(path: object, *, what: str) -> tuple[str, ...]:
    """A relative path from outside (a file's path in a hub repository) as its checked
    parts: every component passes `path_part`, so no `..`, no absolute path, no empty
    segment."""
    if not isinstance(path, str) or not path or len(path) > 1024:
        return (path_part(path, what=what),)   # refused, with the same words
    return tuple(path_part(p, what=what) for p in path.split("/"))
