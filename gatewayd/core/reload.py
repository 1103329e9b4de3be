"""What a configuration reload changes, decided without I/O.

A reload swaps the catalog and the settings in place. Engines are left alone unless
they must change: one whose unit would now be started differently (command line,
environment, limits, server binary, the file's size) is restarted once idle; one whose
model is gone is stopped once idle; every other keeps running, same process. Settings
that shape the process itself (where it listens, which bus, the state directory...)
take effect only at the next start of the gateway: a reload says which ones changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gatewayd.core.catalog import Catalog
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engine_units import engine_fingerprint

# GatewayConfig fields a running gateway cannot change in place
RESTART_ONLY = ("listen_host", "listen_port", "bus", "unit_mode", "state_dir",
                "records_enabled", "records_file", "max_body_bytes", "read_timeout_s",
                "shutdown_timeout_s", "health_interval_s", "health_timeout_s",
                "health_misses", "kv_cache_max_mb", "admin_socket", "admin_group")


@dataclass(frozen=True)
class ReloadPlan:
    """What a configuration reload changes, model by model."""
    added: tuple[str, ...]          # models (and variants) the new configuration adds
    removed: tuple[str, ...]        # models (and variants) it drops (a running engine
                                    # stops once idle)
    restart: tuple[str, ...]        # running engines whose unit settings changed
    kept: tuple[str, ...]           # running engines left as they are
    needs_restart: tuple[str, ...]  # settings that take effect at the gateway's next start

    def as_json(self) -> dict[str, list[str]]:
        return {"added": list(self.added), "removed": list(self.removed),
                "restarting": list(self.restart), "kept": list(self.kept),
                "needs_restart": list(self.needs_restart)}

    def describe(self) -> str:
        parts = [f"{label}: {', '.join(ids)}" for label, ids in (
            ("added", self.added), ("removed", self.removed),
            ("engines restarted when idle", self.restart), ("engines kept", self.kept),
            ("unchanged until the gateway restarts", self.needs_restart)) if ids]
        return "; ".join(parts) or "nothing changed"


def plan_reload(old_config: GatewayConfig, new_config: GatewayConfig, old: Catalog,
                new: Catalog, running: Iterable[str]) -> ReloadPlan:
    running = list(running)
    restart, kept, removed_running = [], [], []
    for model_id in running:
        before, after = old.get(model_id), new.get(model_id)
        if after is None:
            removed_running.append(model_id)
        elif before is None or (engine_fingerprint(before, old_config)
                                != engine_fingerprint(after, new_config)):
            restart.append(model_id)
        else:
            kept.append(model_id)
    before_ids, after_ids = old.served_ids(), new.served_ids()   # variants' names too
    return ReloadPlan(
        added=tuple(m for m in after_ids if m not in before_ids),
        removed=tuple(m for m in before_ids if m not in after_ids),
        restart=tuple(restart), kept=tuple(kept),
        needs_restart=tuple(key for key in RESTART_ONLY
                            if getattr(old_config, key) != getattr(new_config, key)))
