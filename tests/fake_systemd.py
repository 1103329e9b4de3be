"""A fake systemd for engine units whose signals arrive late, early, reordered or twice.

It implements the UnitControl port with systemd's rules and timings (start and stop
jobs take time; a stopped transient unit is collected; Restart=on-failure restarts a
crashed one after RestartSec) and keeps score of the rules the gateway must never
break, as `violations`:
- a start of a unit whose previous instance still exists (its stop is under way), and a
  stop of a unit whose start job has not finished (one lifecycle at a time);
- a start that makes more units exist than max_engines (a restarting one counts);
- an eviction (or idle stop) of an engine that is serving requests (asked of the
  dispatcher; an operator's explicit stop may stop a busy engine);
- with a GPU (gpu_total_mib), a start while the engines' memory would not fit: each
  engine holds engine_mib, which shows in the free figure only once it has loaded, and
  until free_delay_s after its unit is gone (the driver frees it a moment after the
  process exits): the gateway must count loads in progress and wait for freed memory.
Faults the tests inject: a crash (systemd restarts the engine), a failed start, a unit
started or stopped behind the gateway's back (`systemctl` by hand; the stop's signals
lost), and a stop whose signals are held back for a while (they arrive out of order
with the next instance's).
Signals (PropertiesChanged) are delivered by the event loop, never inside the call that
sent them, after a delay the test chooses per signal: zero (in order, before the job
returns, as one D-Bus connection does), later than the job, in another order than sent,
or twice. Like systemd, it refuses a start of a unit that runs (UnitExists, as
unit_control raises it: UnitAlreadyActive) and a kill of a unit it does not have
(NoSuchUnit); a stop of one is done, with no signal.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gatewayd.adapters.systemd import NO_SUCH_UNIT
from gatewayd.core.catalog import Model
from gatewayd.core.engine_units import EngineLayout
from gatewayd.core.errors import UnitAlreadyActive, UnitOperationFailed
from gatewayd.core.placement import DeviceMemory
from gatewayd.core.ports import EngineUnitInfo, UnitWatcher

RUNNING = ("active", "activating", "reloading")
SIGNAL_MODES = ("in_order", "late", "shuffled", "duplicated")
BUS_ROUND_TRIP_S = 0.002   # a method call's answer (signals sent before it arrive first)


@dataclass
class FakeUnit:
    model_id: str
    socket: str
    active: str
    sub: str
    pid: int
    restarts: int = 0
    loaded_at: float = 0.0      # /health answers 200 from then on


class FakeSystemd:
    mode, manager = "transient", "system"

    def __init__(self, rng: random.Random, *, max_engines: int, signal_mode: str = "in_order",
                 job_s: float = 0.05, load_s: float = 0.2, stop_s: float = 0.05,
                 collect_s: float = 0.05, restart_s: float = 1.0,
                 gpu_total_mib: int | None = None, engine_mib: int = 0,
                 ram_fits: int | None = None,
                 free_delay_s: float = 0.5) -> None:
        self.rng = rng
        self.max_engines = max_engines
        self.fail_next_start: set[str] = set()
        # model -> when a fault hit: a failed start, a unit stopped behind our back
        self.faults: dict[str, list[float]] = {}
        # model -> when its process crashed (systemd restarts it: only the requests the
        # dead process was serving may fail for it)
        self.crashes: dict[str, list[float]] = {}
        self.signal_mode = signal_mode
        self.job_s, self.load_s, self.stop_s, self.restart_s = job_s, load_s, stop_s, restart_s
        self.collect_s = collect_s
        self.units: dict[str, FakeUnit] = {}
        self.stopping: set[str] = set()
        self.starting: set[str] = set()
        self.watchers: list[UnitWatcher] = []
        self.violations: list[str] = []
        self.starts = 0
        self.in_flight: Callable[[str], int] = lambda model_id: 0
        self.stop_reason: Callable[[str], str | None] = lambda model_id: None
        self.gpu_total_mib, self.engine_mib = gpu_total_mib, engine_mib
        self.ram_fits = ram_fits   # engines the gateway's RAM budget holds (None: no budget)
        self.free_delay_s = free_delay_s
        self.freeing_mib = 0                        # of units gone, not yet shown as free
        self.held_back: dict[str, float] = {}       # model -> delay of its next stop's signals
        self._pid = 1000

    # -- UnitControl -------------------------------------------------------------------

    def layout(self, model_id: str) -> EngineLayout:
        return EngineLayout.for_model(model_id)

    def check_startable(self, model: Model) -> None:
        pass   # every fake engine can start

    async def start_engine(self, model: Model,
                           visible_devices: str | None = None) -> EngineLayout:
        layout = self.layout(model.id)
        unit = layout.unit
        if unit in self.stopping:
            self.violations.append(f"start of {unit} while its previous instance is stopping")
        existing = self.units.get(unit)
        if existing is not None:
            if existing.active in RUNNING:
                raise UnitAlreadyActive(f"{unit} is already {existing.active}", unit=unit)
            self.violations.append(f"start of {unit} while its previous instance exists")
            raise UnitOperationFailed(f"Unit {unit} was already loaded",
                                      dbus_error="org.freedesktop.systemd1.UnitExists")
        if model.id in self.fail_next_start:
            self.fail_next_start.discard(model.id)
            self.faults.setdefault(model.id, []).append(asyncio.get_running_loop().time())
            raise UnitOperationFailed(f"systemd could not start {unit}: job failed",
                                      unit=unit, job_result="failed")
        if len(self.running()) >= self.max_engines:
            self.violations.append(f"start of {unit} with {sorted(self.running())} running "
                                   f"(max_engines {self.max_engines})")
        if self.gpu_total_mib is not None and self.engine_mib > self.uncommitted_mib():
            self.violations.append(f"start of {unit} needing {self.engine_mib} MiB with "
                                   f"{self.uncommitted_mib()} MiB not held or loading")
        self.starts += 1
        self._pid += 1
        u = FakeUnit(model.id, layout.socket, "activating", "start", self._pid)
        self.units[unit] = u
        self._signal(unit, ActiveState="inactive", SubState="dead")   # a unit being created
        self._signal(unit, ActiveState="activating", SubState="start")
        self._signal(unit, MainPID=u.pid)
        self.starting.add(unit)
        try:
            await asyncio.sleep(self.job_s)
        finally:
            self.starting.discard(unit)
        if self.units.get(unit) is u and u.active == "activating":
            self._run(unit, u)
        return layout

    async def stop_engine(self, unit: str) -> None:
        u = self.units.get(unit)
        if u is None:
            return
        if unit in self.starting:
            self.violations.append(f"stop of {unit} while its start job runs")
        if unit in self.stopping:   # a stop by hand runs: our stop job joins it
            while unit in self.units:
                await asyncio.sleep(0.01)
            return
        reason = self.stop_reason(u.model_id)
        if (serving := self.in_flight(u.model_id)) and reason is not None \
                and reason.split(" ", 1)[0] in ("evicted", "idle_ttl"):
            self.violations.append(f"{reason} {unit} while it serves {serving} request(s)")
        self.stopping.add(unit)
        delay = self.held_back.pop(u.model_id, None)
        u.active, u.sub = "deactivating", "stop-sigterm"
        self._signal(unit, delay, ActiveState="deactivating", SubState="stop-sigterm")
        await asyncio.sleep(self.stop_s)
        u.active, u.sub, u.pid = "inactive", "dead", 0
        self._signal(unit, delay, ActiveState="inactive", SubState="dead", Result="success")
        # the adapter's stop returns once the unit is collected (UnitRemoved), a moment
        # after its inactive signal: a start in that moment would meet the old instance
        await asyncio.sleep(self.collect_s)
        self._remove(unit)
        self.stopping.discard(unit)

    async def park(self, model: Model) -> bool:
        return False   # parked units are tested on the real systemd (test_unit_lifecycle)

    def parked(self) -> list[str]:
        return []

    async def list_engines(self) -> list[EngineUnitInfo]:
        await asyncio.sleep(BUS_ROUND_TRIP_S)
        return [self._info(name, u) for name, u in self.units.items()]

    async def engine_info(self, unit: str) -> EngineUnitInfo | None:
        await asyncio.sleep(BUS_ROUND_TRIP_S)
        u = self.units.get(unit)
        return None if u is None else self._info(unit, u)

    def watch(self, callback: UnitWatcher) -> Callable[[], None]:
        self.watchers.append(callback)
        return lambda: self.watchers.remove(callback)

    # -- faults --------------------------------------------------------------------------

    def crash(self, model_id: str) -> bool:
        """The engine's process dies; systemd restarts it after restart_s."""
        unit = self.layout(model_id).unit
        u = self.units.get(unit)
        if u is None or u.active != "active":
            return False
        u.active, u.sub, u.pid = "activating", "auto-restart", 0
        self.crashes.setdefault(model_id, []).append(asyncio.get_running_loop().time())
        self._signal(unit, ActiveState="activating", SubState="auto-restart",
                     ExecMainCode=2, ExecMainStatus=9, MainPID=0)
        asyncio.get_running_loop().call_later(self.restart_s, self._restart, unit, u)
        return True

    async def limit_memory(self, unit: str, high_bytes: int) -> None:
        await asyncio.sleep(0)

    async def kill_engine(self, unit: str) -> None:
        u = self.units.get(unit)
        if u is None:
            raise UnitOperationFailed(f"KillUnit failed: Unit {unit} not loaded.",
                                      dbus_error=NO_SUCH_UNIT)
        self.crash(u.model_id)

    def start_behind_our_back(self, model_id: str) -> bool:
        """`systemctl start` of the engine unit by hand (only where there is room): the
        gateway hears signals for a unit it does not know."""
        unit = self.layout(model_id).unit
        if unit in self.units or len(self.running()) >= min(
                self.max_engines, self.ram_fits or self.max_engines) or (
                self.gpu_total_mib is not None and self.engine_mib > self.uncommitted_mib()):
            return False
        self._pid += 1
        self.units[unit] = u = FakeUnit(model_id, self.layout(model_id).socket, "activating",
                                        "start", self._pid)
        self._signal(unit, ActiveState="activating", SubState="start", MainPID=u.pid)
        self._run(unit, u)
        return True

    def stop_behind_our_back(self, model_id: str) -> bool:
        """`systemctl stop` by hand while the gateway's bus connection misses the signals
        (a bus restart): only a listing can tell the gateway the unit is gone."""
        unit = self.layout(model_id).unit
        u = self.units.get(unit)
        if u is None or unit in self.starting or unit in self.stopping:
            return False
        self.faults.setdefault(model_id, []).append(asyncio.get_running_loop().time())
        self._remove(unit)
        return True

    async def stop_by_hand(self, model_id: str, exit_s: float | None = None) -> bool:
        """`systemctl stop` by hand: the gateway hears the signals of a stop it did not ask
        for (a place freed by an exit that only systemd can confirm)."""
        unit = self.layout(model_id).unit
        u = self.units.get(unit)
        if u is None or unit in self.starting or unit in self.stopping:
            return False
        self.faults.setdefault(model_id, []).append(asyncio.get_running_loop().time())
        self.stopping.add(unit)
        u.active, u.sub = "deactivating", "stop-sigterm"
        self._signal(unit, ActiveState="deactivating", SubState="stop-sigterm")
        await asyncio.sleep(self.stop_s if exit_s is None else exit_s)
        u.active, u.sub, u.pid = "inactive", "dead", 0
        self._signal(unit, ActiveState="inactive", SubState="dead", Result="success")
        self._remove(unit)
        self.stopping.discard(unit)
        return True

    def hold_back_signals(self, model_id: str, seconds: float) -> None:
        """The next stop of this model's unit: its signals arrive seconds late."""
        self.held_back[model_id] = seconds

    # -- what the tests read ---------------------------------------------------------------

    def running(self) -> dict[str, str]:
        """model -> ActiveState of every unit that exists and runs or will run again."""
        return {u.model_id: u.active for u in self.units.values() if u.active != "inactive"}

    def free_mib(self) -> int:
        """Free memory as NVML shows it: an engine's memory shows once it has loaded."""
        now = asyncio.get_running_loop().time()
        used = sum(self.engine_mib for u in self.units.values() if 0 < u.loaded_at <= now)
        return (self.gpu_total_mib or 0) - used - self.freeing_mib

    def uncommitted_mib(self) -> int:
        """Memory no engine holds or is loading into: what a new start may take."""
        return (self.gpu_total_mib or 0) - self.engine_mib * len(self.units) - self.freeing_mib

    def health(self, socket: str) -> int | None:
        for u in self.units.values():
            if u.socket == socket:
                loop = asyncio.get_running_loop()
                return 200 if u.active == "active" and loop.time() >= u.loaded_at else 503
        return None

    # -- plumbing ----------------------------------------------------------------------------

    def _run(self, unit: str, u: FakeUnit) -> None:
        u.active, u.sub = "active", "running"
        u.loaded_at = asyncio.get_running_loop().time() + self.load_s
        self._signal(unit, ActiveState="active", SubState="running")

    def _remove(self, unit: str) -> None:
        u = self.units.pop(unit)
        if self.gpu_total_mib is not None and self.engine_mib and u.loaded_at > 0:
            self.freeing_mib += self.engine_mib
            asyncio.get_running_loop().call_later(self.free_delay_s, self._freed)

    def _freed(self) -> None:
        self.freeing_mib -= self.engine_mib

    def _restart(self, unit: str, u: FakeUnit) -> None:
        if self.units.get(unit) is not u or u.sub != "auto-restart":
            return
        self._pid += 1
        u.pid, u.restarts = self._pid, u.restarts + 1
        self._signal(unit, NRestarts=u.restarts, MainPID=u.pid)
        self._run(unit, u)

    def _info(self, name: str, u: FakeUnit) -> EngineUnitInfo:
        return EngineUnitInfo(unit=name, model_id=u.model_id, socket=u.socket,
                              active_state=u.active, sub_state=u.sub, main_pid=u.pid,
                              n_restarts=u.restarts, memory_bytes=None, started_at_us=0)

    def _signal(self, unit: str, held_back: float | None = None, **props: Any) -> None:
        loop = asyncio.get_running_loop()
        if held_back is not None:
            loop.call_later(held_back, self._deliver, unit, props)
            return
        mode = self.signal_mode
        copies = 2 if mode == "duplicated" and self.rng.random() < 0.5 else 1
        for _ in range(copies):
            if mode == "in_order":   # by the loop, in order, before the job returns
                loop.call_soon(self._deliver, unit, props)
            elif mode == "late":
                loop.call_later(self.job_s * 3, self._deliver, unit, props)
            else:
                loop.call_later(self.rng.uniform(0, self.job_s * 4), self._deliver, unit, props)

    def _deliver(self, unit: str, props: dict[str, Any]) -> None:
        for watcher in list(self.watchers):
            watcher(unit, props)


class FakeSystemdHealth:
    def __init__(self, systemd: FakeSystemd) -> None:
        self._systemd = systemd

    async def status(self, socket: str, timeout: float = 2.0,
                     path: str = "/health") -> int | None:
        await asyncio.sleep(0)
        return self._systemd.health(socket)


class FakeSystemdGpu:
    """The GPU the fake systemd's engines use (a GpuProbe): free memory as NVML shows it."""

    def __init__(self, systemd: FakeSystemd) -> None:
        self._systemd = systemd
        self.description = "fake device (fake systemd's engines)"

    def devices(self) -> list[DeviceMemory] | None:
        total = self._systemd.gpu_total_mib
        if total is None:
            return None
        return [DeviceMemory(0, "0", "fake", total, self._systemd.free_mib())]

    def process_mib(self) -> dict[int, int] | None:
        return None
