"""The engines the user wants running, kept in the state directory.

Written atomically (temporary file, fsync, rename) on every change, read at
start-up to restore engines after a reboot, in the order they were started.
"""

from __future__ import annotations

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
            self._save()

    def remove(self, model_id: str) -> None:
        if model_id in self._ids:
            self._ids.remove(model_id)
            self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps({"engines": self._ids}).encode())
