"""The engines the user wants running, kept in the state directory.

Written atomically (temporary file, fsync, rename) after every change, read at
start-up to restore engines after a reboot, in the order they were started.

The list changes at once in memory; the file is written by one writer in a thread, the
newest list each time, never two writes at once. An fsync takes milliseconds
(docs/benchmarks.md, "Figures behind choices in the code"), and it came at every start
and stop, on the event loop, beside a loading engine (every other client's stream
waited for it). `flush()` waits for the file to hold the list (the gateway's stop
awaits it: nothing is lost); a failed write is logged, and the next change writes the
whole list again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from gatewayd.adapters.files import write_atomic

FILE_NAME = "engines.json"
log = logging.getLogger("gatewayd.desired")


class DesiredEngines:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / FILE_NAME
        self._ids = self._load()
        self._written = 0      # changes made / on disk (or failed: then logged)
        self._changes = 0
        self._writer: asyncio.Task[None] | None = None

    def _load(self) -> list[str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:   # start empty rather than refuse to run
            what = "not valid JSON" if isinstance(e, ValueError) else "unreadable"
            log.warning("%s is %s (%s): no engines will be restored; it is rewritten at the "
                        "next start or stop", self.path, what, e)
            return []
        ids = data.get("engines", []) if isinstance(data, dict) else []
        if not isinstance(data, dict) or not isinstance(ids, list):
            log.warning("%s is not the expected {\"engines\": [...]}: no engines will be "
                        "restored", self.path)
            return []
        return [i for i in ids if isinstance(i, str)]

    @property
    def ids(self) -> list[str]:
        return list(self._ids)

    def add(self, model_id: str) -> None:
        if model_id not in self._ids:
            self._ids.append(model_id)
            self._changed()

    def remove(self, model_id: str) -> None:
        if model_id in self._ids:
            self._ids.remove(model_id)
            self._changed()

    async def flush(self) -> None:
        """Once the file holds every change made so far (or its write failed, logged)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    def _changed(self) -> None:
        self._changes += 1
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:   # no loop (a command-line tool): write now
            self._write(list(self._ids))
            self._written = self._changes
            return
        if self._writer is None or self._writer.done():
            self._writer = loop.create_task(self._write_changes())

    async def _write_changes(self) -> None:
        while self._written < self._changes:
            changes, ids = self._changes, list(self._ids)
            await asyncio.to_thread(self._write, ids)
            self._written = changes

    def _write(self, ids: list[str]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps({"engines": ids}).encode())
        except OSError as e:
            log.warning("could not update the desired engine list %s (the engines to "
                        "restore after a reboot): %s", self.path, e)
