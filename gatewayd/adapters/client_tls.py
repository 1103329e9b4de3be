"""aiohttp's default client TLS contexts, their CA certificates loaded after start-up.

aiohttp builds two TLS contexts when it is imported, and each reads the system's
CA bundle (the verified one through create_default_context, the unverified one
through set_default_verify_paths): on a small machine a large part of a
socket-activated start (docs/benchmarks.md, "Figures behind choices in the
code"), which the first request waits for, in a gateway whose engines all speak
over unix sockets. `deferred_ca_loading()` wraps the gateway's first import of
aiohttp so that both are made without reading the bundle, and `load_deferred()`
(run in a thread once the gateway serves) does that reading into those same
contexts. Until then a TLS connection through aiohttp's default contexts cannot
verify a certificate: it fails closed, never open. Contexts made outside the
wrapped import, or with their own CA files, are made as usual.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable, Iterator
from typing import Any

_DEFERRED: list[tuple[ssl.SSLContext, Callable[[ssl.SSLContext], None]]] = []
_VERIFY_PATHS = "set_default_verify_paths"


@contextlib.contextmanager
def deferred_ca_loading() -> Iterator[None]:
    real_create = ssl.create_default_context
    real_verify_paths = getattr(ssl.SSLContext, _VERIFY_PATHS)
    own = ssl.SSLContext.__dict__.get(_VERIFY_PATHS)   # None: inherited from _ssl

    def without_certificates(purpose: ssl.Purpose = ssl.Purpose.SERVER_AUTH,
                             **kwargs: Any) -> ssl.SSLContext:
        if purpose is not ssl.Purpose.SERVER_AUTH or any(kwargs.values()):
            return real_create(purpose, **kwargs)
        # what create_default_context(SERVER_AUTH) makes: TLS client, CERT_REQUIRED,
        # check_hostname; all but load_default_certs
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        _DEFERRED.append((context, lambda c: c.load_default_certs(ssl.Purpose.SERVER_AUTH)))
        return context

    def verify_paths_later(context: ssl.SSLContext) -> None:
        _DEFERRED.append((context, real_verify_paths))

    ssl.create_default_context = without_certificates
    setattr(ssl.SSLContext, _VERIFY_PATHS, verify_paths_later)
    try:
        yield
    finally:
        ssl.create_default_context = real_create
        if own is None:
            delattr(ssl.SSLContext, _VERIFY_PATHS)
        else:
            setattr(ssl.SSLContext, _VERIFY_PATHS, own)


def load_deferred() -> int:
    """Read the system's CA certificates into the contexts made without them; how many
    contexts got them. Blocking I/O: run it in a thread."""
    done = 0
    while _DEFERRED:
        context, load = _DEFERRED.pop()
        load(context)
        done += 1
    return done
