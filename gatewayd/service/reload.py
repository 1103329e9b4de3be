"""Reloading the configuration in place: SIGHUP (`systemctl reload`), POST /admin/reload.

The new file and models directory are read off the event loop and validated whole
before anything changes: a file that does not parse or validate is refused and the old
configuration stays in force. Otherwise the catalog and the settings are swapped in
place (new names route at once) and the engines that must change (core.reload) are
restarted or stopped once they serve nobody, never under a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from gatewayd.core.catalog import Catalog
from gatewayd.core.config import GatewayConfig
from gatewayd.core.engines import EngineState
from gatewayd.core.errors import ConfigError, ConfigInvalid, GatewayError
from gatewayd.core.reload import ReloadPlan, plan_reload
from gatewayd.service.dispatcher import Dispatcher
from gatewayd.service.engine_manager import EngineManager

log = logging.getLogger("gatewayd.reload")
IDLE_POLL_S = 0.2

ReadConfig = Callable[[], tuple[GatewayConfig, Catalog]]


class Reloader:
    def __init__(self, *, read: ReadConfig, engines: EngineManager, dispatcher: Dispatcher,
                 apply: Callable[[GatewayConfig], Awaitable[None]] | None = None,
                 notify: Callable[[str], None] = lambda _: None,
                 read_models: ReadConfig | None = None,
                 publish: Callable[[dict[str, Any]], None] = lambda _: None) -> None:
        self._read = read
        # models_dir read again under the configuration in force (a pull landed, a model
        # was removed): the file's edits wait for a reload the user asks for
        self._read_models = read_models
        self._engines = engines
        self._dispatcher = dispatcher
        self._apply = apply          # the adapters' share of the new settings
        self._notify = notify        # sd_notify
        self._publish = publish      # the event feed: a reload is a point on its timeline
        self._lock = asyncio.Lock()  # one reload at a time
        self._pending: dict[str, asyncio.Task[None]] = {}   # model -> restart/stop when idle

    async def reload(self) -> ReloadPlan:
        async with self._lock:
            self._notify("RELOADING=1\nSTATUS=reloading the configuration")
            status = "reload failed; see the journal"   # systemd leaves "reloading" only
            try:                                        # on READY=1, whatever happened
                plan = await self._reload()
                log.info("configuration reloaded: %s", plan.describe())
                status = f"reloaded: {plan.describe()}"
                self._publish({"type": "reload", "ok": True, "changes": plan.as_json()})
                return plan
            except ConfigInvalid as e:
                log.error("%s", e.message)
                status = f"reload refused: {e.message}"
                self._publish({"type": "reload", "ok": False, "error": e.message})
                raise
            finally:
                self._notify(f"READY=1\nSTATUS={status}")

    async def rescan_models(self) -> ReloadPlan:
        """The catalog made again from models_dir, the settings unchanged: a model pulled
        into it is served at once, a removed one is gone (its KV folder with it)."""
        if self._read_models is None:
            raise ConfigInvalid("this gateway cannot re-read its models directory")
        async with self._lock:
            plan = await self._reload(self._read_models)
            log.info("models_dir read again: %s", plan.describe())
            return plan

    async def _reload(self, read: ReadConfig | None = None) -> ReloadPlan:
        try:   # GGUF headers are read: off the loop
            config, catalog = await asyncio.to_thread(read or self._read)
        except (ConfigError, OSError) as e:   # OSError: an unreadable models_dir
            reason = e.message if isinstance(e, ConfigError) else str(e)
            raise ConfigInvalid("the configuration was not reloaded (the one in force "
                                f"stays): {reason}") from e
        engines = self._engines
        running = [e.model_id for e in engines.registry.engines()
                   if e.state is not EngineState.STOPPED]
        plan = plan_reload(engines.config, config, engines.catalog, catalog, running)
        engines.catalog.replace(catalog)   # shared: every holder sees the new models
        engines.reconfigure(config)
        # (a model that left saves no KV cache at its stop: it is not in the catalog)
        await engines.hooks.drop_unconfigured_kv_caches()
        await self._dispatcher.reconfigure(config)
        if self._apply is not None:
            await self._apply(config)
        for model_id in plan.restart:
            self._when_idle(model_id, self._restart, "its settings changed")
        for model_id in plan.removed:
            if model_id in running:
                self._when_idle(model_id, self._stop, "it left the configuration")
        if plan.needs_restart:
            log.warning("changed settings that take effect only when the gateway restarts: "
                        "%s", ", ".join(plan.needs_restart))
        return plan

    def _when_idle(self, model_id: str, action: Callable[[str, str], Awaitable[None]],
                   why: str) -> None:
        if (old := self._pending.pop(model_id, None)) is not None:
            old.cancel()   # an earlier reload's plan for this model is superseded
        task = asyncio.get_running_loop().create_task(self._wait_idle(model_id, action, why))
        self._pending[model_id] = task
        task.add_done_callback(lambda t: self._pending.pop(model_id, None)
                               if self._pending.get(model_id) is t else None)

    def _idle(self, model_id: str) -> bool:
        return (not self._dispatcher.has_requests(model_id)
                and not self._engines.lifecycle.busy(model_id))

    async def _wait_idle(self, model_id: str, action: Callable[[str, str], Awaitable[None]],
                         why: str) -> None:
        while True:
            engine = self._engines.registry.get(model_id)
            if engine is None or engine.state in (EngineState.STOPPING, EngineState.STOPPED):
                return   # stopped meanwhile: its next start uses the new settings anyway
            # decided right before the stop, with no await in between: a request that
            # takes the engine later finds it stopping and waits for the new one
            if self._idle(model_id):
                break
            await asyncio.sleep(IDLE_POLL_S)
        try:
            await action(model_id, why)
        except GatewayError as e:
            log.warning("reload: %s: %s", model_id, e.message)

    async def _restart(self, model_id: str, why: str) -> None:
        log.info("restarting %s: %s", model_id, why)
        await self._engines.lifecycle.stop(model_id, reason=f"reload: {why}")
        await self._engines.lifecycle.start(model_id, wait=False)

    async def _stop(self, model_id: str, why: str) -> None:
        log.info("stopping %s: %s", model_id, why)
        await self._engines.lifecycle.stop(model_id, reason=f"reload: {why}")

    async def close(self) -> None:
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
