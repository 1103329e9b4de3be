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


async def serve(socket: str, name: str) -> None:
    engine = FakeEngine(name)
    if os.path.exists(socket):
        os.unlink(socket)
    await engine.start(socket)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("-m", "--model", default="fake")
    ap.add_argument("--alias", default="fake")
    args, _ignored = ap.parse_known_args()   # -t, -c, --mmproj ...: accepted, ignored
    asyncio.run(serve(args.host, args.alias))


if __name__ == "__main__":
    main()
