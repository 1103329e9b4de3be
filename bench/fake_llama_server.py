"""A stand-in for llama-server that answers instantly (tests/fake_engine.py), taking
llama-server's own arguments, so the gateway can run it as an engine unit.

Used by the proxy-ceiling and footprint benchmarks: the engine costs ~nothing, so what is
measured is the gateway. bench/fake-llama-server is the executable wrapper.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from tests.fake_engine import FakeEngine


async def serve(socket: str, name: str, slots: int) -> None:
    engine = FakeEngine(name, slots=slots)
    if os.path.exists(socket):
        os.unlink(socket)
    await engine.start(socket)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("-m", "--model", default="fake")
    ap.add_argument("--alias", default="fake")
    # it answers at once, so it takes any number of requests together: its /props says 64
    # (the ceiling's concurrency), where llama-server says how many slots it has
    ap.add_argument("-np", "--parallel", type=int, default=64)
    args, _ignored = ap.parse_known_args()   # -t, -c, --mmproj ...: accepted, ignored
    asyncio.run(serve(args.host, args.alias, args.parallel))


if __name__ == "__main__":
    main()
