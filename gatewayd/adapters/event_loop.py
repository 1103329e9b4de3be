"""Which event loop the gateway runs on, in a module of its own: the benchmark's bare
proxy (bench/bare_proxy.py) runs on the same one without loading the gateway."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (a dependency on Linux): its transports and callbacks
    in C take a good share of the CPU off each proxied request and each streamed event
    (bench/hotpath.py; docs/benchmarks.md, "Figures behind choices in the code").
    LLM_GATEWAY_EVENT_LOOP=asyncio chooses the standard loop."""
    if os.environ.get("LLM_GATEWAY_EVENT_LOOP", "uvloop") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
