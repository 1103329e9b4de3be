"""The names this machine answers to, for the browser's side of the boundary
(core/origins: a request's Host must name this gateway)."""

from __future__ import annotations

import socket


def own_host_names() -> frozenset[str]:
    """This machine's host name, short and as the resolver knows it (no lookup: that
    could block the start)."""
    name = socket.gethostname().lower()
    return frozenset({name, name.split(".", 1)[0]})
