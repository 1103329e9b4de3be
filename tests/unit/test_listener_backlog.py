"""A burst of new connections waits in the listening socket's queue instead of being
dropped: the gateway's own socket (not systemd's) is bound with the kernel's backlog.
With aiohttp's 128, a burst past it had its SYNs dropped and each such client waited 1,
3 or 7 s for its retry (issue 50: 5-12 s for a new connection's answer under a flood)."""

from __future__ import annotations

import asyncio
import resource

import pytest

from gatewayd.adapters.listener import bind_tcp

BURST = 600   # well past aiohttp's 128, under the descriptors a test may hold


async def test_a_burst_of_connections_is_queued_not_dropped() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < BURST + 100:
        pytest.skip(f"{soft} descriptors: the burst needs {BURST + 100}")
    sockets = await bind_tcp("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    writers = []
    try:
        async def connect() -> bool:
            try:   # nothing accepts: a connection completes only if the queue took it
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port), 0.9)
            except TimeoutError:
                return False
            writers.append(writer)
            return True
        done = await asyncio.gather(*(connect() for _ in range(BURST)))
        assert sum(done) == BURST, f"{BURST - sum(done)} of {BURST} connections dropped"
    finally:
        for w in writers:
            w.close()
        for s in sockets:
            s.close()
