"""A failed or restarting engine's last journal lines, attached to its failure.

The waiters of a failed engine hear of it once its lines are attached, so their
error says why. journald writes a dead engine's last lines (its stderr stream) a
little after systemd reports the exit, and nothing unprivileged can wait for it:
the tail is read again after LOG_REREAD_S while the engine stays failed (or
restarting), so the admin's view ends with the line that says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from gatewayd.core.engines import EngineState, LogsRead
from gatewayd.core.ports import JournalReader
from gatewayd.service.engine_registry import EngineRegistry

LOG_TAIL_LINES = 15
LOG_REREAD_S = (0.5, 2.0, 5.0)   # seconds from the failure


class FailureLogs:
    def __init__(self, journal: JournalReader, registry: EngineRegistry) -> None:
        self._journal = journal
        self._registry = registry
        self._tasks: set[asyncio.Task[None]] = set()
        self._settling: dict[str, asyncio.Task[None]] = {}

    async def tail(self, unit: str, lines: int) -> list[str]:
        return await self._journal.tail(unit, lines)

    def settle_later(self, model_id: str) -> None:
        """The engine failed: attach its lines, then tell its waiters."""
        self._settling[model_id] = self._spawn(self._settle(model_id))

    def settling(self, model_id: str) -> asyncio.Task[None] | None:
        """The model's last settling of a failure, for a start that must answer with it."""
        return self._settling.get(model_id)

    def reread_later(self, model_id: str, state: EngineState, *, now: bool = False) -> None:
        """Read the tail (now, and) after LOG_REREAD_S while the engine stays in state."""
        self._spawn(self._reread(model_id, state, now))

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _settle(self, model_id: str) -> None:
        engine = self._registry.get(model_id)
        if engine is None:
            return
        lines = await self._journal.tail(engine.unit, LOG_TAIL_LINES)
        self._registry.event(model_id, LogsRead(tuple(lines)))
        current = self._registry.get(model_id)
        if current is None or current.state is not EngineState.FAILED:
            return  # stopped (waiters told), or running again (waiters wait on)
        self.reread_later(model_id, EngineState.FAILED)
        self._registry.fail_waiters(model_id, self._registry.failed_error(model_id))

    async def _reread(self, model_id: str, state: EngineState, now: bool) -> None:
        waited = 0.0
        for at in (0.0,) * now + LOG_REREAD_S:
            await asyncio.sleep(at - waited)
            waited = at
            engine = self._registry.get(model_id)
            if engine is None or engine.state is not state:
                return   # it moved on (a new failure or restart reads its own)
            lines = await self._journal.tail(engine.unit, LOG_TAIL_LINES)
            self._registry.event(model_id, LogsRead(tuple(lines)))
