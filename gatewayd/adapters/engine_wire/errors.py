"""What talking to an engine over its socket can end in."""

from __future__ import annotations


class EngineConnectionError(Exception):
    """The engine could not be reached, or the connection broke or spoke nonsense.

    fresh: nothing of an answer arrived (the request may be sent again when the
    connection was a reused one); connect: the request reached no engine process — the
    connection could not be made, or it was written into an end already closed (EPIPE),
    and no other try of it went out — so it is safe to send to the engine that replaces
    this one."""

    def __init__(self, message: str, *, fresh: bool = False, connect: bool = False) -> None:
        super().__init__(message)
        self.fresh = fresh
        self.connect = connect


class BadFraming(EngineConnectionError):
    """The engine's answer broke HTTP/1.1's framing or went past a bound (a head or a chunk
    line too long, a chunk size that is not plain hex): refused, never waited out."""


class AnswerTooLarge(EngineConnectionError):
    """A body read whole went past the limit it was read with."""


class ConnectionsBusy(Exception):
    """None of an engine's connections came free in time: all it serves at once are in
    use, and the request waited for one for the client's queue time (read_timeout_s)."""


class ConnectionsQueueFull(ConnectionsBusy):
    """As many requests as the queue limit already wait for the engine's connections: the
    next is refused at once rather than held (with its body) for up to read_timeout_s."""
