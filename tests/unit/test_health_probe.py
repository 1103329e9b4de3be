"""The readiness probe (adapters/health.py) over real unix sockets: an engine's answer,
a loading one (503), garbage, silence and no socket at all; and the poll schedule."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from gatewayd.adapters.health import UnixHealthProbe
from gatewayd.service.readiness import poll_delays
from tests.fake_engine import FakeEngine

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def sock_dir() -> AsyncIterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hp", dir="/tmp") as d:   # sun_path: 108 bytes
        yield Path(d)


async def serve(path: Path, handler: Handler) -> asyncio.AbstractServer:
    return await asyncio.start_unix_server(handler, path=str(path))


async def test_a_ready_engine_answers_200(sock_dir: Path) -> None:
    engine = FakeEngine("a")
    await engine.start(str(sock_dir / "engine.sock"))
    try:
        assert await UnixHealthProbe().status(str(sock_dir / "engine.sock")) == 200
    finally:
        await engine.stop()


async def test_loading_garbage_silence_and_no_socket(sock_dir: Path) -> None:
    probe = UnixHealthProbe()
    assert await probe.status(str(sock_dir / "missing.sock")) is None

    async def loading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"error":{"code":503,"message":"Loading model"}}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        writer.close()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH\r\n")
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    servers = [await serve(sock_dir / f"{h.__name__}.sock", h)
               for h in (loading, garbage, silent)]
    try:
        assert await probe.status(str(sock_dir / "loading.sock")) == 503
        assert await probe.status(str(sock_dir / "garbage.sock")) is None
        started = asyncio.get_running_loop().time()
        assert await probe.status(str(sock_dir / "silent.sock"), timeout=0.2) is None
        assert asyncio.get_running_loop().time() - started < 2
    finally:
        for server in servers:
            server.close()


def test_polls_are_tight_while_a_small_model_loads_then_back_off() -> None:
    delays = list(poll_delays())
    assert delays[:100] == [0.001] * 100        # every 1 ms for the first 100 ms
    assert delays[100] > delays[99] and max(delays) == 0.5
    assert sum(delays) >= 3600


def _looks(delays: list[float], until: float) -> list[float]:
    at, looks = 0.0, []
    for delay in delays:
        at += delay
        if at > until:
            break
        looks.append(round(at, 6))
    return looks


def test_a_model_seen_loading_is_looked_at_seldom_then_often_near_its_load_time() -> None:
    looks = _looks(list(poll_delays(0.2)), 0.4)        # loads in 200 ms
    assert looks[:5] == [0.02, 0.04, 0.06, 0.08, 0.1]   # every E/10 until 60% of it
    near = [b - a for a, b in itertools.pairwise(looks) if 0.1 <= a < 0.3]
    assert near and all(abs(d - 0.004) < 1e-9 for d in near)   # every E/50 around it
    tiny = _looks(list(poll_delays(0.015)), 0.03)
    assert tiny[0] == 0.005 and tiny[1] - tiny[0] == pytest.approx(0.001)   # 1 ms at least
    slow = list(poll_delays(60.0))
    assert max(slow) == 0.5 and sum(slow) >= 3600
    assert min(slow) == 0.05 and len(_looks(slow, 120)) < 2000   # never 0.5 ms for minutes


async def test_a_second_start_is_seen_ready_soon_after_its_engine_is(sock_dir: Path) -> None:
    """The first load teaches the poller how long this model takes; at the next start
    the engine is looked at seldom before then, and seen ready within a few ms after."""
    from gatewayd.core.engines import Engine, EngineState
    from gatewayd.service.readiness import Readiness

    ready_at: list[float] = []
    probes: list[float] = []
    loop = asyncio.get_running_loop()
    answer_from = [0.0]

    class Probe:
        async def status(self, socket: str, timeout: float = 2.0,
                     path: str = "/health") -> int | None:
            probes.append(loop.time())
            return 200 if loop.time() >= answer_from[0] else 503

    engine = Engine("m", "llm-engine-m.service", "/x.sock", state=EngineState.LOADING)
    done = asyncio.Event()

    async def on_ready(model_id: str) -> None:
        ready_at.append(loop.time())
        done.set()

    async def never(model_id: str) -> None:
        raise AssertionError("timed out")

    readiness = Readiness(Probe(), load_timeout_s=5, clock=loop.time, engine=lambda m: engine,
                          on_ready=on_ready, on_timeout=never)
    for _ in range(2):
        done.clear()
        probes.clear()
        start = loop.time()
        answer_from[0] = start + 0.06            # the engine loads in 60 ms
        readiness.watch("m", new_start=True)
        await asyncio.wait_for(done.wait(), 2)
    assert readiness.expected_load_s("m") == pytest.approx(0.06, abs=0.03)
    early = [t - start for t in probes if t - start < 0.03]
    assert len(early) <= 6                       # seldom before 60% of the load (every 6 ms)
    assert ready_at[-1] - answer_from[0] < 0.02  # and seen ready soon after
    readiness.close()


def test_the_tight_looks_are_paced_on_the_gateways_own_loop() -> None:
    """uvloop (the gateway's loop) counts timers in whole ms: a wait it rounds to none
    makes the poller look back to back at an engine still loading, taking its CPU."""
    import uvloop

    from gatewayd.core.engines import Engine, EngineState
    from gatewayd.service.readiness import Readiness

    async def main() -> int:
        loop = asyncio.get_running_loop()
        looks = [0]
        engine = Engine("m", "llm-engine-m.service", "/x.sock", state=EngineState.LOADING)
        done = asyncio.Event()

        class Probe:
            async def status(self, socket: str, timeout: float = 2.0,
                     path: str = "/health") -> int | None:
                looks[0] += 1
                return 200 if loop.time() >= ready_at else 503

        async def on_ready(model_id: str) -> None:
            done.set()

        async def never(model_id: str) -> None:
            raise AssertionError("timed out")

        readiness = Readiness(Probe(), load_timeout_s=5, clock=loop.time,
                              engine=lambda m: engine, on_ready=on_ready, on_timeout=never)
        readiness._loads["m"] = deque([0.02])     # a model seen loading in 20 ms
        ready_at = loop.time() + 0.05             # this start takes 50 ms
        readiness.watch("m", new_start=True)
        await asyncio.wait_for(done.wait(), 2)
        readiness.close()
        return looks[0]

    looks = uvloop.run(main())
    assert looks <= 60, f"{looks} looks in 50 ms"     # ~1 per ms at most, not back to back
