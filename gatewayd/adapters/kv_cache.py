"""An engine's KV cache kept across its stop: llama-server's slot save and restore.

Before the gateway stops an idle llama engine it asks the engine to write each used
parallel slot's cache to the model's directory under the state directory (POST /slots/{id}
?action=save, llama-server --slot-save-path); when the engine next becomes ready the
files are restored into the same parallel slots before it is marked ready, so a repeated long
prompt skips its prefill (timings.cache_n). A directory carries a stamp of the engine's
settings: files written by an engine started differently (another file, context size,
arguments) are discarded, never restored. Each model's directory is bounded
(kv_cache_max_mb, oldest files removed first), and the directories of models no longer
configured are deleted (prune: at the start and at each reload). Every failure is logged
and counted and never stops a stop or a start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any

from gatewayd.adapters.engine_wire.errors import EngineConnectionError
from gatewayd.adapters.engine_wire.exchange import exchange

log = logging.getLogger("gatewayd.kv_cache")
STAMP = "engine-settings.sha256"
SLOT_FILE = "slot-{id}.bin"
SAVE_TIMEOUT_S = 10.0      # the whole save; bounds how long an eviction waits for it
RESTORE_TIMEOUT_S = 10.0   # the whole restore; bounds how long a start waits for it


class KvCache:
    """llama-server's slot files of every model, under <state_dir>/kv-cache/<engine instance>/."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self._max_bytes = max_bytes
        self.counts: Counter[tuple[str, str]] = Counter()   # (action, result) -> n

    def directory(self, instance: str) -> Path:
        return self.root / instance

    def prepare(self, instance: str, stamp: str) -> Path:
        """The model's directory, made; its files dropped if another engine setup wrote
        them (they would restore a cache that does not belong to this engine)."""
        where = self.directory(instance)
        where.mkdir(parents=True, exist_ok=True)
        stamp_file = where / STAMP
        if not stamp_file.exists() or stamp_file.read_text().strip() != stamp:
            for old in where.glob("slot-*.bin"):
                old.unlink(missing_ok=True)
            stamp_file.write_text(stamp + "\n")
        return where

    async def save(self, model_id: str, socket: str, instance: str) -> int:
        """Save every used parallel slot; the number saved (0 on failure: logged and counted)."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(SAVE_TIMEOUT_S):
                saved = 0
                for slot in await _slots(socket):
                    if "id_task" not in slot or not slot.get("n_prompt_tokens"):
                        continue   # never used: nothing to keep
                    await _slot_action(socket, slot["id"], "save",
                                       SLOT_FILE.format(id=slot["id"]))
                    saved += 1
            self._bound(self.directory(instance))
        except (TimeoutError, OSError, EngineConnectionError, ValueError, KeyError,
                TypeError) as e:
            self.counts["save", "failed"] += 1
            log.warning("%s: saving its KV cache failed (%s); the engine stops without it",
                        model_id, e or type(e).__name__)
            return 0
        self.counts["save", "ok"] += 1
        log.info("%s: KV cache of %d parallel slot(s) saved in %.0f ms", model_id, saved,
                 (time.monotonic() - started) * 1000)
        return saved

    async def restore(self, model_id: str, socket: str, instance: str) -> int:
        """Restore the saved KV cache into the ready engine; the number of tokens restored.

        Each file straight into its parallel slot, with no look at GET /slots first: the
        stamp says the files were written by an engine of the same setup, so with the same
        parallel slots (a round trip less on the cold start's path). A parallel slot the
        engine says it does not have (its binary replaced in place, another default) drops
        that file."""
        where = self.directory(instance)
        files = sorted(where.glob("slot-*.bin")) if where.is_dir() else []
        if not files:
            return 0
        started = time.monotonic()
        restored = 0
        try:
            async with asyncio.timeout(RESTORE_TIMEOUT_S):
                for path in files:
                    slot_id = int(path.stem.split("-", 1)[1])
                    try:
                        answer = await _slot_action(socket, slot_id, "restore", path.name)
                    except NoSuchSlot as e:
                        log.warning("%s: %s; its file is dropped", model_id, e)
                        path.unlink(missing_ok=True)
                        continue
                    restored += int(answer.get("n_restored", 0))
        except (TimeoutError, OSError, EngineConnectionError, ValueError, KeyError,
                TypeError) as e:
            self.counts["restore", "failed"] += 1
            log.warning("%s: restoring its KV cache failed (%s); it starts cold", model_id,
                        e or type(e).__name__)
            return 0
        self.counts["restore", "ok"] += 1
        log.info("%s: KV cache restored: %d token(s) in %d slot file(s), %.0f ms", model_id,
                 restored, len(files), (time.monotonic() - started) * 1000)
        return restored

    def prune(self, keep: Collection[str]) -> list[str]:
        """Delete the directories of engine instances not in keep (models that left the
        configuration: nothing would ever restore or bound their files); the names
        deleted. Blocking: off the event loop."""
        try:
            found = [p for p in self.root.iterdir() if p.is_dir() and p.name not in keep]
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("cannot look for KV cache directories to drop in %s: %s", self.root, e)
            return []
        removed = []
        for where in found:
            try:
                shutil.rmtree(where)
            except OSError as e:
                log.warning("cannot delete the KV cache directory %s: %s", where, e)
                continue
            removed.append(where.name)
        if removed:
            self.counts["prune", "removed"] += len(removed)
            log.info("KV cache directories of models no longer configured deleted: %s",
                     ", ".join(sorted(removed)))
        return removed

    def _bound(self, where: Path) -> None:
        """Oldest slot files first, until the directory fits max_bytes."""
        files = sorted(where.glob("slot-*.bin"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self._max_bytes:
                break
            total -= path.stat().st_size
            path.unlink(missing_ok=True)


class NoSuchSlot(ValueError):
    """The engine has no parallel slot of that id (HTTP 400 to a /slots action)."""


async def _slots(socket: str) -> list[dict[str, Any]]:
    status, body = await exchange(socket, "GET", "/slots", timeout=SAVE_TIMEOUT_S)
    if status != 200:
        raise ValueError(f"GET /slots: HTTP {status}")
    slots = json.loads(body)
    if not isinstance(slots, list):
        raise ValueError("GET /slots: not a list")
    return slots


async def _slot_action(socket: str, slot_id: int, action: str,
                       filename: str) -> dict[str, Any]:
    status, data = await exchange(socket, "POST", f"/slots/{int(slot_id)}?action={action}",
                                  json.dumps({"filename": filename}).encode(),
                                  timeout=RESTORE_TIMEOUT_S)
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if status != 200:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        error = NoSuchSlot if status == 400 and action == "restore" else ValueError
        raise error(f"slot {slot_id} {action}: HTTP {status} {message or ''}".rstrip())
    return body if isinstance(body, dict) else {}
