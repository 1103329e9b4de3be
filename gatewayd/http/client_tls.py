"""aiohttp's default client TLS context, its CA certificates loaded after start-up.

aiohttp builds its default TLS context when it is imported, reading the system's
CA bundle: ~100 ms on a 2-core machine, on the socket-activation path (the first
request waits for it), in a gateway whose engines all speak over unix sockets.
`deferred_ca_loading()` wraps the gateway's first import of aiohttp so that the
context is made without its certificates, and `load_deferred()` (run in a thread
once the gateway serves) loads them into that same context. Until then a TLS
connection through aiohttp's default context fails verification: closed, never
open. Any other context (explicit cafile, another purpose) is made as usual.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator
from typing import Any

_DEFERRED: list[ssl.SSLContext] = []


@contextlib.contextmanager
def deferred_ca_loading() -> Iterator[None]:
    real = ssl.create_default_context

    def without_certificates(purpose: ssl.Purpose = ssl.Purpose.SERVER_AUTH,
                             **kwargs: Any) -> ssl.SSLContext:
        if purpose is not ssl.Purpose.SERVER_AUTH or any(kwargs.values()):
            return real(purpose, **kwargs)
        # what create_default_context(SERVER_AUTH) makes: TLS client, CERT_REQUIRED,
        # check_hostname; all but load_default_certs
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        _DEFERRED.append(context)
        return context

    ssl.create_default_context = without_certificates
    try:
        yield
    finally:
        ssl.create_default_context = real


def load_deferred() -> int:
    """Load the system's CA certificates into the contexts made without them; how many
    contexts got them. Blocking I/O: run it in a thread."""
    done = 0
    while _DEFERRED:
        _DEFERRED.pop().load_default_certs(ssl.Purpose.SERVER_AUTH)
        done += 1
    return done
