"""Engine units over systemd's D-Bus API: the UnitControl adapters.

`TransientEngineUnits` creates one transient service per engine
(StartTransientUnit). That is safe when the gateway talks to its own user
manager, or runs as root by the administrator's choice. A non-root gateway on
the system manager uses `TemplateEngineUnits` instead: instances of the static
`llm-engine@.service` template, each reading a settings file the gateway
writes, allowed by a polkit rule scoped to `llm-engine@*.service` (systemd 252
asks polkit about StartTransientUnit without the unit name, so allowing it
would allow any unit).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import logging
import os
import pwd
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from gatewayd.adapters.files import write_atomic
from gatewayd.adapters.kv_cache import KvCache
from gatewayd.adapters.parked_units import (
    ParkedUnit,
    ParkingLot,
    preload_library,
    settle,
    takes_preload,
    wake,
)
from gatewayd.adapters.systemd import NO_SUCH_UNIT, SERVICE, UNIT, Systemd
from gatewayd.core.catalog import Model
from gatewayd.core.config import Backend, GatewayConfig
from gatewayd.core.engine_units import (
    DEVICES_ENV,
    ENGINE_USER,
    MODEL_ENV,
    PARK_SHELL,
    PARKED_COMM,
    SOCKET_ENV,
    UNIT_PREFIX,
    EngineLayout,
    adapters_of,
    gateway_secrets,
    in_private_tmp,
    keeps_kv_cache,
    listens_on_tcp,
    parked_spec,
    resource_limits,
    server_binary,
    settings_stamp,
    spec_digest,
    template_settings,
    transient_spec,
    unit_patterns,
    unreadable_by_engine,
    wake_line,
    within,
)
from gatewayd.core.errors import (
    ConfigError,
    EngineBinaryMissing,
    UnitAlreadyActive,
    UnitOperationFailed,
)
from gatewayd.core.ports import EngineUnitInfo, UnitWatcher
from gatewayd.core.unit_spec import UnitSpec

log = logging.getLogger("gatewayd.units")
CAP_NET_ADMIN = 12
_UNSET = 2**64 - 1  # systemd's "not set / unknown" for t properties
# what systemd answers when a unit of that name still exists (failed, not yet collected)
LINGERING = frozenset({"org.freedesktop.systemd1.UnitExists",
                       "org.freedesktop.systemd1.TransactionIsDestructive"})
RUNNING = frozenset({"active", "activating", "reloading"})
UNIT_GONE_S = 5.0   # how long a stopped transient unit may take to be collected
PARK_SETTLE_S = 10.0   # how long a parked engine may take to reach its wait (linking)


class EngineUnitsBase:
    """What both modes share: stopping, listing, inspecting and watching engine units."""

    mode: str
    manager: str
    patterns: tuple[str, ...]
    collected: bool   # unloaded once inactive (transient units, CollectMode=)

    def __init__(self, systemd: Systemd, config: GatewayConfig,
                 kv_cache: KvCache | None = None) -> None:
        self._sd = systemd
        self._config = config
        self._kv_cache = kv_cache

    def _slot_save_path(self, model: Model, layout: EngineLayout) -> str | None:
        """The model's KV cache directory, ready for this engine (files another engine setup
        wrote are dropped), or None: no KV cache kept, or the directory cannot be made."""
        if self._kv_cache is None or not keeps_kv_cache(model):
            return None
        stamp = settings_stamp(model, self._config)
        try:
            return str(self._kv_cache.prepare(layout.instance, stamp))
        except OSError as e:
            log.warning("%s: no KV cache directory (%s); it runs without one", model.id, e)
            return None

    def reconfigure(self, config: GatewayConfig) -> None:
        """A reloaded configuration: the engine servers' paths for the starts from now on."""
        self._config = config

    def check_startable(self, model: Model) -> None:
        binary = resolve_binary(*server_binary(model, self._config))
        for path in (model.config.path, model.config.mmproj,
                     *(a.path for a in model.config.adapters)):
            if path is not None and (why := missing(path)):
                raise ConfigError(f"{model.id}: {path}: {why}; the engine would have "
                                  "nothing to load", model=model.id)
        if self.manager == "system":
            check_engine_can_read(model, binary)

    async def stop_engine(self, unit: str) -> None:
        try:
            await self._sd.stop_unit(unit)
        except UnitOperationFailed as e:
            if e.extra.get("dbus_error") != NO_SUCH_UNIT:
                raise
            return
        if self.collected and not await self._sd.wait_unit_gone(unit, UNIT_GONE_S):
            # a failed unit is collected only once its failure is reset
            with contextlib.suppress(UnitOperationFailed):
                await self._sd.reset_failed_unit(unit)
            await self._sd.wait_unit_gone(unit, UNIT_GONE_S)

    async def limit_memory(self, unit: str, high_bytes: int) -> None:
        await self._sd.set_unit_properties(unit, [("MemoryHigh", "t", high_bytes)],
                                           runtime=True)

    async def kill_engine(self, unit: str) -> None:
        await self._sd.kill_unit(unit, signal.SIGKILL)

    async def list_engines(self) -> list[EngineUnitInfo]:
        listed = await self._sd.list_units(self.patterns)
        infos = await asyncio.gather(*(self.engine_info(u.name) for u in listed))
        return [i for i in infos if i is not None]

    async def engine_info(self, unit: str) -> EngineUnitInfo | None:
        state = await self._unit_state(unit)
        return None if state is None else info_from_properties(unit, *state)

    async def _unit_state(self, unit: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The unit's Unit and Service properties; None: no such unit."""
        try:
            unit_props = await self._sd.properties(unit, UNIT)
            if unit_props.get("LoadState") == "not-found":
                return None
            return unit_props, await self._sd.properties(unit, SERVICE)
        except UnitOperationFailed:
            return None

    async def park(self, model: Model) -> bool:
        """Engines of this mode are not parked."""
        del model
        return False

    def parked(self) -> list[str]:
        return []

    async def close(self) -> None:
        """Nothing of this mode outlives a call."""

    async def _start(self, unit: str, start: Callable[[], Awaitable[str]]) -> None:
        """Start. systemd refuses a transient unit whose name is still loaded: if the
        unit runs, we lost track of it (UnitAlreadyActive: adopt it); if a previous
        instance is still being collected, wait until it is gone and try once more.
        Checking first would cost round trips on every start."""
        try:
            await start()
        except UnitOperationFailed as e:
            if e.extra.get("dbus_error") not in LINGERING:
                raise
            info = await self.engine_info(unit)
            if info is not None and info.active_state in RUNNING:
                raise UnitAlreadyActive(f"{unit} is already {info.active_state}",
                                        unit=unit) from e
            with contextlib.suppress(UnitOperationFailed):
                await self._sd.reset_failed_unit(unit)
            await self._sd.wait_unit_gone(unit, UNIT_GONE_S)
            await start()

    def watch(self, callback: UnitWatcher) -> Callable[[], None]:
        return self._sd.watch(callback)


class TransientEngineUnits(EngineUnitsBase):
    mode = "transient"
    collected = True
    patterns = tuple(unit_patterns())

    def __init__(self, systemd: Systemd, config: GatewayConfig, *, manager: str,
                 run_root: str, kv_cache: KvCache | None = None) -> None:
        super().__init__(systemd, config, kv_cache)
        self.manager = manager
        self._run_root = run_root
        self._lot = ParkingLot(config.state_dir / "parked", config.parked_engines)
        self._preload = preload_library()
        self._takes_preload: dict[str, bool] = {}   # per engine binary
        if self._preload is None:
            log.info("the preloaded wait (gatewayd/engine_park.c) is not built: parked "
                     "engines wait behind %s, their linking on the request's path", PARK_SHELL)
        elif manager == "system" and (why := engine_cannot_reach(self._preload)):
            # the dynamic linker would skip a library it cannot open, and the "parked"
            # engine would start loading at once
            log.warning("engines (user %s) cannot read the preloaded wait %s: %s; parked "
                        "engines wait behind %s", ENGINE_USER, self._preload, why, PARK_SHELL)
            self._preload = None
        self._watchers: list[UnitWatcher] = []
        self._unwatch_systemd: Callable[[], None] | None = None
        self.private_network = manager != "system" or manager_can_configure_networks()
        if not self.private_network:
            log.warning("systemd (PID 1) lacks CAP_NET_ADMIN (a container sharing the "
                        "host's network?): it cannot bring up loopback in a private network "
                        "namespace, so TCP engines (whisper, openai servers told {port}) "
                        "listen on a free loopback port of this namespace, still reached "
                        "only through their unix socket")

    def layout(self, model_id: str) -> EngineLayout:
        return EngineLayout.for_model(model_id, run_root=self._run_root)

    def reconfigure(self, config: GatewayConfig) -> None:
        super().reconfigure(config)
        self._lot.limit = config.parked_engines
        self._lot.discard_surplus(self.stop_engine)   # a smaller limit holds from now on

    def _specs(self, model: Model, layout: EngineLayout) -> Callable[[str | None], UnitSpec]:
        """The model's unit for the given CUDA_VISIBLE_DEVICES; the engine binary and
        the KV cache directory looked up once. On the system manager the engine runs as
        ENGINE_USER: a model or binary that user cannot read is a clear error here, not
        an engine that fails to load."""
        binary = resolve_binary(*server_binary(model, self._config))
        system = self.manager == "system"
        if system:
            check_engine_can_read(model, binary)
        slot_save_path = self._slot_save_path(model, layout)
        return lambda visible_devices: transient_spec(
            model, layout, binary, private_network=self.private_network,
            slot_save_path=slot_save_path, visible_devices=visible_devices, system=system,
            hidden=gateway_secrets(self._config) if system else (),
            shown=in_private_tmp(own_code()) if system else ())

    async def start_engine(self, model: Model,
                           visible_devices: str | None = None) -> EngineLayout:
        layout = self.layout(model.id)
        if await self._wake_parked(model, layout, visible_devices):
            return layout
        spec = self._specs(model, layout)(visible_devices)
        if not self.private_network and listens_on_tcp(model):
            log.warning("%s: its server listens on a loopback port of this host's network "
                        "(no private network namespace: PID 1 lacks CAP_NET_ADMIN), where "
                        "any local user can reach it", model.id)
        await self._start(layout.unit, lambda: self._sd.start_transient(spec))
        return layout

    # -- parked units (adapters/parked_units.py) ------------------------------------

    def parks(self, model: Model) -> bool:
        """Whether this model's engine is parked after a stop: llama engines (whisper's
        launcher is a Python process of its own), while parked_engines allows any."""
        return self._lot.limit > 0 and model.backend is Backend.LLAMA

    async def park(self, model: Model) -> bool:
        """Create the model's unit parked, so that its next start is a wake; the least
        recently parked beyond parked_engines are stopped. False: not parked (this
        model is not, or the unit exists already: the reconciler's to look at)."""
        layout = self.layout(model.id)
        unit = layout.unit
        if not self.parks(model) or unit in self._lot.hidden:
            return False
        await self._lot.settled(unit)
        spec = self._specs(model, layout)(None)
        binary = spec.argv[0]
        preload = self._preload if self._preloads(binary) else None
        fifo = self._lot.make_fifo(layout.instance)
        self._lot.hidden.add(unit)
        try:
            await self._start(unit, lambda: self._sd.start_transient(
                parked_spec(spec, str(fifo), preload)))
            state = await self._unit_state(unit)
        except Exception:
            self._lot.hidden.discard(unit)
            with contextlib.suppress(OSError):
                fifo.unlink()
            raise
        if state is None:   # gone at once (the engine or shell failed): nothing parked
            self._lot.hidden.discard(unit)
            return False
        unit_props, service = state
        parked = ParkedUnit(unit, spec_digest(spec), fifo, time.time(), {
            "ActiveState": unit_props.get("ActiveState"),
            "SubState": unit_props.get("SubState"),
            "MainPID": service.get("MainPID", 0), "NRestarts": service.get("NRestarts", 0)},
            model_id=model.id, spec=spec, made_for=(model, self._config))
        waiting_name = PARKED_COMM if preload is not None else os.path.basename(PARK_SHELL)
        if not await settle(parked.props["MainPID"], layout.socket, PARK_SETTLE_S,
                            waiting_name):
            # not waiting on its FIFO: the engine went on (the preload did not take) or
            # the unit is failing. Its signals stay held back until it is gone
            await self._lot.discard(parked, self.stop_engine)
            if preload is None:
                return False
            log.warning("%s: %s did not wait when parked with the preloaded wait; its "
                        "engines are parked behind %s from now on", model.id, binary,
                        PARK_SHELL)
            self._takes_preload[binary] = False
            return await self.park(model)
        self._lot.parked[unit] = parked
        await asyncio.gather(*self._lot.discard_surplus(self.stop_engine))
        return True

    def _preloads(self, binary: str) -> bool:
        """Whether the engine binary is parked with the preloaded wait (looked at once)."""
        if self._preload is None:
            return False
        if (known := self._takes_preload.get(binary)) is None:
            known = self._takes_preload[binary] = takes_preload(binary)
        return known

    def parked(self) -> list[str]:
        return self._lot.models()

    async def _wake_parked(self, model: Model, layout: EngineLayout,
                           visible_devices: str | None) -> bool:
        """Wake the unit's parked engine if it is the engine asked for: then it is the
        start's unit, running. Otherwise a parked unit is stopped first. Parked for this
        very model and configuration, it is that engine with no spec made again: the
        wake is the cold start's first step, and making and hashing the spec (the
        engine's settings stamp, its KV cache directory) there would delay the engine's load
        (docs/benchmarks.md, "Figures behind choices in the code")."""
        unit = layout.unit
        await self._lot.settled(unit)
        parked = self._lot.claim(unit)
        if parked is None:
            return False
        spec = parked.made_from(model, self._config)
        same = spec is not None
        if spec is None:
            spec = self._specs(model, layout)(None)
        if (same or parked.digest == spec_digest(spec)) \
                and parked.props.get("ActiveState") == "active" \
                and await wake(parked.fifo, wake_line(spec, visible_devices)):
            self._lot.woken(parked)
            # what the engine layer would have heard, had it watched the unit all along
            self._on_signal(unit, {k: v for k, v in parked.props.items() if v is not None})
            return True
        log.info("%s: its parked unit is not the engine asked for (or not waiting): "
                 "stopping it, then starting anew", unit)
        await self._lot.discard(parked, self.stop_engine)
        return False

    async def engine_info(self, unit: str) -> EngineUnitInfo | None:
        """None for a parked unit: it is no engine (yet)."""
        state = await self._unit_state(unit)
        if state is None:
            return None
        info = info_from_properties(unit, *state)
        env = unit_environment(state[1])
        instance = unit.removeprefix(f"{UNIT_PREFIX}-").removesuffix(".service")
        if not self._lot.is_parked(unit, instance, env, info.main_pid):
            return info
        if info.active_state in RUNNING:
            self._lot.adopt(unit, instance, env, {
                "ActiveState": info.active_state, "SubState": info.sub_state,
                "MainPID": info.main_pid, "NRestarts": info.n_restarts}, info.started_at_us)
        return None

    def watch(self, callback: UnitWatcher) -> Callable[[], None]:
        if self._unwatch_systemd is None:
            self._unwatch_systemd = self._sd.watch(self._on_signal)
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback)

    def _on_signal(self, unit: str, changed: Mapping[str, Any]) -> None:
        if self._lot.seen(unit, changed):
            return
        for callback in list(self._watchers):
            callback(unit, changed)

    async def close(self) -> None:
        await self._lot.close()


class TemplateEngineUnits(EngineUnitsBase):
    """Engines as instances of llm-engine@.service (the unprivileged system service)."""

    mode = "template"
    manager = "system"
    collected = False
    patterns = (f"{UNIT_PREFIX}@*.service",)

    def __init__(self, systemd: Systemd, config: GatewayConfig,
                 kv_cache: KvCache | None = None) -> None:
        super().__init__(systemd, config, kv_cache)
        self.settings_dir = config.state_dir / "engines"

    def layout(self, model_id: str) -> EngineLayout:
        return EngineLayout.for_model(model_id, template=True)

    def _slot_save_path(self, model: Model, layout: EngineLayout) -> str | None:
        """The KV cache directory, shared with the engine's user through group llm-engine:
        llama-server writes its slot files there, the gateway counts and deletes them."""
        path = super()._slot_save_path(model, layout)
        if path is None:
            return None
        try:
            share_with_engines(Path(path))
        except (OSError, KeyError) as e:
            log.warning("%s: its KV cache directory cannot be shared with the engine's "
                        "user %s (%s); it runs without one", model.id, ENGINE_USER, e)
            return None
        return path

    async def start_engine(self, model: Model,
                           visible_devices: str | None = None) -> EngineLayout:
        layout = self.layout(model.id)
        self.settings_dir.mkdir(parents=True, exist_ok=True)
        binary = resolve_binary(*server_binary(model, self._config))
        check_engine_can_read(model, binary)
        write_atomic(self.settings_dir / f"{layout.instance}.json",
                     json.dumps(template_settings(
                         model, layout, binary, slot_save_path=self._slot_save_path(model, layout),
                         visible_devices=visible_devices)).encode())
        if limits := resource_limits(model):
            await self._sd.set_unit_properties(layout.unit, limits, runtime=True)
        await self._start(layout.unit, lambda: self._sd.start_unit(layout.unit))
        return layout

    async def engine_info(self, unit: str) -> EngineUnitInfo | None:
        info = await super().engine_info(unit)
        if info is None:
            return None
        instance = unit.removeprefix(f"{UNIT_PREFIX}@").removesuffix(".service")
        try:   # the model id and socket live in the settings file, not the unit
            settings = json.loads((self.settings_dir / f"{instance}.json").read_text())
        except (OSError, ValueError):
            return info
        env = settings.get("env") or {}
        return replace(info, model_id=settings.get("model"), socket=settings.get("socket"),
                       visible_devices=env.get(DEVICES_ENV), adapters=adapters_of(env))


def engine_identity() -> tuple[int | None, frozenset[int]]:
    """ENGINE_USER's uid and groups; (None, {}) where it is not a static user (a dynamic
    one of that name then: it owns nothing and is in no group)."""
    try:
        user = pwd.getpwnam(ENGINE_USER)
    except KeyError:
        return None, frozenset()
    return user.pw_uid, frozenset(os.getgrouplist(ENGINE_USER, user.pw_gid))


def own_code() -> list[str]:
    """Where the gateway's own code lives (what holds its package: site-packages, or a
    checkout's root; its Python environment): what an engine runs from it (whisper's
    launcher, the parked wait's library, a checkout's bench/fake-llama-server) must
    reach it."""
    paths = sorted({str(Path(__file__).resolve().parents[2]), os.path.realpath(sys.prefix)})
    return [p for p in paths if within(p, [q for q in paths if q != p]) is None]   # outermost


def path_chain(path: str) -> list[tuple[str, int, int, int]]:
    """(path, mode, uid, gid) of every directory the engine passes to reach a file, the
    way it is named and the way a symlink leads, from / down; then the file's own."""
    named, real = Path(os.path.abspath(path)), Path(os.path.realpath(path))
    chain: list[tuple[str, int, int, int]] = []
    seen: set[Path] = set()
    for parent in (named.parent, real.parent):
        for directory in [*reversed(parent.parents), parent]:
            if directory not in seen:
                seen.add(directory)
                st = os.stat(directory)
                chain.append((str(directory), st.st_mode, st.st_uid, st.st_gid))
    st = os.stat(real)
    return [*chain, (str(real), st.st_mode, st.st_uid, st.st_gid)]


def engine_cannot_reach(name: str) -> str | None:
    """Why the engine's user could not read a file (None: it can; or it is missing, which
    the engine's own error says)."""
    uid, gids = engine_identity()
    try:
        chain = path_chain(name)
    except OSError:
        return None
    bound = within(name, in_private_tmp(own_code())) is not None
    return unreadable_by_engine(chain, uid, gids, bound=bound)


def check_engine_can_read(model: Model, binary: str) -> None:
    """ConfigError naming the file and the reason where the engine's user could not
    read the model (its mmproj, its adapters) or run the engine server (for whisper, the gateway's
    launcher, which runs it: this Python and the gatewayd package)."""
    files = [binary, *(str(p) for p in (model.config.path, model.config.mmproj) if p),
             *(str(a.path) for a in model.config.adapters)]
    if listens_on_tcp(model):
        files += [sys.executable, str(Path(__file__).resolve().parents[1] / "engine_launch.py")]
    for name in files:
        if why := engine_cannot_reach(name):
            raise ConfigError(f"{model.id}: {name} is not readable by the engine user "
                              f"{ENGINE_USER}: {why}; move it, or give that user read "
                              "access", model=model.id)


def missing(path: Path) -> str | None:
    """Why path is not there (None: it is, or the gateway may not look: the engine's
    user may, and its own error says more)."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "no such file"
    except OSError:
        return None
    return None


def share_with_engines(directory: Path, group: str = ENGINE_USER) -> None:
    """Hand a model's KV directory to the engines' group: 0770, so llama-server writes its
    slot files there (0660 and its group under its UMask=0007) and the gateway counts
    and deletes them. The group comes from the parent, kv-cache/, setgid 2710
    llm-gateway:llm-engine by the package's tmpfiles.d: the gateway never calls chown
    (its unit's SystemCallFilter=~@privileged forbids it) nor sets a setgid bit
    (RestrictSUIDSGID=). OSError where the directories are not the group's; KeyError: no
    such group."""
    gid = grp.getgrnam(group).gr_gid
    for path in (directory.parent, directory):
        if path.stat().st_gid != gid:
            raise OSError(f"{path} is not group {group}: the package's tmpfiles.d makes "
                          f"{directory.parent} setgid {group} (systemd-tmpfiles --create)")
    if directory.stat().st_mode & 0o777 != 0o770:
        os.chmod(directory, 0o770)


def unit_environment(service: Mapping[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in service.get("Environment", []) if "=" in item)


def info_from_properties(unit: str, unit_props: dict[str, Any],
                         service: dict[str, Any]) -> EngineUnitInfo:
    env = unit_environment(service)
    memory = service.get("MemoryCurrent")
    cpu = service.get("CPUUsageNSec")
    control_group = service.get("ControlGroup")   # "" while the unit has no cgroup
    return EngineUnitInfo(
        unit=unit,
        model_id=env.get(MODEL_ENV),
        socket=env.get(SOCKET_ENV),
        active_state=unit_props.get("ActiveState", "unknown"),
        sub_state=unit_props.get("SubState", "unknown"),
        main_pid=int(service.get("MainPID", 0)),
        n_restarts=int(service.get("NRestarts", 0)),
        memory_bytes=None if memory in (None, _UNSET) else int(memory),
        cpu_ns=None if cpu in (None, _UNSET) else int(cpu),
        started_at_us=int(service.get("ExecMainStartTimestamp", 0)),
        visible_devices=env.get(DEVICES_ENV),
        control_group=str(control_group) if control_group else None,
        adapters=adapters_of(env),
    )


def runtime_root(manager: str) -> str:
    """Where RuntimeDirectory= lives: /run for the system manager, $XDG_RUNTIME_DIR for users."""
    if manager == "user":
        return os.environ.get("XDG_RUNTIME_DIR", f"/run/user/{os.getuid()}")
    return "/run"


def manager_can_configure_networks(status: str | None = None) -> bool:
    """Whether PID 1 holds CAP_NET_ADMIN, which PrivateNetwork= needs to bring up the
    namespace's loopback (nspawn without --private-network drops it). Unknown: yes."""
    try:
        text = status if status is not None else Path("/proc/1/status").read_text()
    except OSError:
        return True
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << CAP_NET_ADMIN))
    return True


def binary_identity(name: str) -> str:
    """Which file an engine server is on disk (replaced in place, it is another build,
    with perhaps other defaults); "" where it cannot be found."""
    try:
        st = os.stat(resolve_binary(name))
    except (EngineBinaryMissing, OSError):
        return ""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def resolve_binary(name: str, key: str = "llama_server") -> str:
    """The absolute path of an engine server (a bare name is looked up in PATH), or a
    clear error naming the configuration key."""
    if os.path.isabs(name):
        path = Path(name)
        if not path.is_file():
            raise EngineBinaryMissing(f"{key} = {name!r}: no such file; set {key} to the "
                                      "engine server's path", key=key)
        if not os.access(path, os.X_OK):
            raise EngineBinaryMissing(f"{key} = {name!r}: not executable", key=key)
        return name
    search = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    for directory in search.split(":"):
        candidate = Path(directory, name)
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise EngineBinaryMissing(f"{key} = {name!r}: not found in PATH ({search}); set {key} "
                              "to the engine server's absolute path", key=key)
