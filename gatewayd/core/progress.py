"""What a waiting stream is told while it waits, and whether it is told. Pure.

A streamed request whose model's engine is not ready waits in the gateway: for its
model's file to download, for its turn in the line of models wanting room, for room to be
made, for the load. While it waits, its client may be sent SSE comment lines every
`EVERY_S`, the first after `FIRST_S` (a quick load sends nothing):

    : waiting for 'coder': loading, 4.1 s

Comment lines are ignored by every SSE reader (the spec's rule; the openai and anthropic
SDKs' decoders skip them), keep a proxy's idle timeout from cutting the stream, and tell
a person why nothing comes yet. The first one sends the stream's 200: a failure after it
can only be said as the stream's error event. So it is the client's choice by default
(`stream_progress = "opt-in"`, the `LLM-Gateway-Progress: 1` header); `"on"` tells every
waiting stream unless its client says `0`; `"off"` none.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("off", "opt-in", "on")
HEADER = "LLM-Gateway-Progress"
FIRST_S = 2.0    # no line before: a load this quick is not worth the committed 200
EVERY_S = 5.0    # then one line this often (proxies' idle timeouts are tens of seconds)
_YES = frozenset({"1", "true", "yes", "on"})
_NO = frozenset({"0", "false", "no", "off"})


def wanted(mode: str, asked: str | None) -> bool:
    """Whether a streamed request is told of its wait: under "on" unless the client says
    no (`0`), under "opt-in" only if it says yes (`1`), under "off" never. ValueError
    for a header value that is neither."""
    said: bool | None = None
    if asked is not None:
        value = asked.strip().lower()
        if value not in _YES | _NO:
            raise ValueError(f"{HEADER} is 1 or 0, not {asked[:40]!r}")
        said = value in _YES
    if mode == "on":
        return said is not False
    if mode == "opt-in":
        return said is True
    return False


@dataclass(frozen=True)
class Waiting:
    """What the gateway knows of the model a request waits for, at one moment."""

    model: str
    waited_s: float                  # since the request came
    state: str | None = None         # its engine's state (EngineState's value); None: none
    downloading: tuple[int, int] | None = None   # its file's pull: (done, total) bytes
    in_line: bool = False            # it wants room (the loader's line)
    ahead: tuple[str, ...] = ()      # models before it in that line
    overdue: bool = False            # its oldest request waited max_wait_s


def reason(w: Waiting) -> str:
    """Why w's request waits, in a few words: what the gateway does for it now."""
    if w.downloading is not None:
        done, total = w.downloading
        return f"downloading, {100 * done // total}%" if total > 0 else "downloading"
    if w.state in ("starting", "loading", "restarting"):
        return w.state
    if w.state == "ready":    # ready yet waited for: draining, its place given up
        return "its engine is draining for another model"
    if w.state == "stopping":
        return "its engine is stopping"
    if w.in_line and w.ahead:
        names = ", ".join(repr(m) for m in w.ahead[:2])
        more = f" and {len(w.ahead) - 2} more" if len(w.ahead) > 2 else ""
        return f"its turn, after {names}{more}" + (" (overdue)" if w.overdue else "")
    if w.in_line:
        return "room" + (" (overdue: max_wait_s passed)" if w.overdue else "")
    return "queued"


def comment(w: Waiting) -> bytes:
    """The SSE comment line for w, a block of its own (a blank line after it: a reader
    that splits events at blank lines sees it alone, never glued to the next event)."""
    line = f"waiting for {w.model!r}: {reason(w)}, {w.waited_s:.1f} s"
    line = line.replace("\r", " ").replace("\n", " ")   # (repr escapes them: belt and braces)
    return b": " + line.encode() + b"\n\n"
