"""Memory learned from what engines really hold, kept in the state directory.

One JSON file per kind of memory (<state_dir>/gpu-memory.json: what NVML showed the
engine's process holding once ready; ram-memory.json: the peak of its unit's cgroup,
or its processes' PSS): per engine setup (core.engine_units settings_stamp: model
file, context, arguments, server), the MiB, with the model id and when, for people
reading it.
A missing or damaged file is an empty book (logged); a failed write is logged and the
figure is still used until the gateway stops.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from gatewayd.adapters.files import write_atomic

log = logging.getLogger("gatewayd.gpu")
FILE_NAME = "gpu-memory.json"
RAM_FILE_NAME = "ram-memory.json"


class LearnedMemory:
    def __init__(self, state_dir: Path, file_name: str = FILE_NAME) -> None:
        self.path = state_dir / file_name
        self._book: dict[str, dict[str, Any]] = {}
        try:
            data = json.loads(self.path.read_text())
            if isinstance(data, dict):
                self._book = {k: v for k, v in data.items()
                              if isinstance(v, dict) and isinstance(v.get("mib"), int)}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            log.warning("%s: unreadable (%s); memory is learned again", self.path, e)

    def get(self, key: str) -> int | None:
        entry = self._book.get(key)
        return int(entry["mib"]) if entry else None

    def forget_model(self, model_id: str) -> int:
        """Drop what was learned for a removed model (a model pulled again under its
        name is another file: its setups' stamps differ anyway, but the book stays
        small and honest)."""
        gone = [k for k, v in self._book.items() if v.get("model") == model_id]
        for key in gone:
            del self._book[key]
        if gone:
            self._write()
        return len(gone)

    def record(self, key: str, model_id: str, mib: int) -> bool:
        """Keep mib for key; True when it changed what was known."""
        if self.get(key) == mib:
            return False
        self._book[key] = {"mib": mib, "model": model_id, "measured_at": round(time.time())}
        self._write()
        return True

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(self._book, indent=1, sort_keys=True).encode())
        except OSError as e:
            log.warning("%s: cannot write (%s); the figure is kept in memory", self.path, e)
