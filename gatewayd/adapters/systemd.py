"""systemd over D-Bus: start, stop, inspect and watch units.

The adapter owns every D-Bus name and signature and translates D-Bus error
replies into our error hierarchy; nothing outside this module sees a dbus_fast
type. It uses dbus-fast's low-level `bus.call` (no introspection round trips)
and subscribes to systemd's signals instead of polling:

- signals arrive only after AddMatch *and* Manager.Subscribe();
- JobRemoved can be dispatched before the reply to StartTransientUnit is
  processed, so finished jobs are remembered until someone asks for them;
- with CollectMode=inactive-or-failed a failed unit disappears, and its exit
  status survives only in the PropertiesChanged signals received before that;
- the bus can go away (`systemctl restart dbus`): the adapter reconnects with
  backoff, subscribes again and tells its owner (on_reconnect), who re-lists
  the units, since signals sent meanwhile are lost. Calls made while it is away
  wait for the new connection (up to RECONNECT_WAIT_S), and operations waiting
  for a signal of the old connection (a job, a removal) end with
  SystemdUnavailable. Ready engines keep serving throughout: requests do not
  use the bus. (Exiting for systemd to restart us instead would cut every open
  request.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.errors import AuthError

from gatewayd.core.errors import AccessDenied, SystemdUnavailable, UnitOperationFailed
from gatewayd.core.unit_spec import UnitSpec

SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
SERVICE = "org.freedesktop.systemd1.Service"
PROPERTIES = "org.freedesktop.DBus.Properties"
DBUS = "org.freedesktop.DBus"
DBUS_PATH = "/org/freedesktop/DBus"
UNIT_PATH_PREFIX = SYSTEMD_PATH + "/unit/"

NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
_ACCESS_DENIED = {
    "org.freedesktop.DBus.Error.AccessDenied",
    "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired",
}

# Properties worth forwarding to watchers: what the engine state machine needs.
WATCHED = frozenset({
    "ActiveState", "SubState", "Result", "MainPID", "NRestarts",
    "ExecMainCode", "ExecMainStatus",
})

UnitChangeCallback = Callable[[str, Mapping[str, Any]], None]
# A job's JobRemoved can only beat the reply that names it by a few messages: a busy
# host's other jobs need not be remembered beyond these.
FINISHED_JOBS_KEPT = 256
RECONNECT_WAIT_S = 10.0      # a call made while the bus is away waits this long for it
RECONNECT_DELAYS_S = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

log = logging.getLogger("gatewayd.systemd")


def unit_object_path(unit: str) -> str:
    """systemd's bus path for a unit: every byte outside [A-Za-z0-9] becomes _xx."""
    return UNIT_PATH_PREFIX + "".join(
        chr(b) if chr(b).isascii() and chr(b).isalnum() else f"_{b:02x}"
        for b in unit.encode())


def unit_name_from_path(path: str) -> str | None:
    if not path.startswith(UNIT_PATH_PREFIX):
        return None
    escaped, out, i = path[len(UNIT_PATH_PREFIX):], bytearray(), 0
    while i < len(escaped):
        if escaped[i] == "_" and i + 2 < len(escaped):
            out.append(int(escaped[i + 1:i + 3], 16))
            i += 3
        else:
            out.append(ord(escaped[i]))
            i += 1
    return out.decode(errors="replace")


@dataclass(frozen=True)
class ListedUnit:
    """A unit as ListUnitsByPatterns names it."""
    name: str


class Systemd:
    """A connection to one systemd manager (system or user) over its bus."""

    def __init__(self, bus: MessageBus,
                 reopen: Callable[[], Awaitable[MessageBus]] | None = None) -> None:
        self._bus = bus
        self._reopen = reopen
        self._online = asyncio.Event()
        self._online.set()
        self._closing = False
        self._keeper: asyncio.Task[None] | None = None
        self._reconnect_listeners: list[Callable[[], None]] = []
        self._jobs: dict[str, asyncio.Future[str]] = {}
        # jobs whose JobRemoved came before we asked (the reply to our call was still on
        # its way); after Subscribe that is every job on the host, so only the latest few
        self._finished_jobs: OrderedDict[str, str] = OrderedDict()
        self._watchers: list[UnitChangeCallback] = []
        self._removals: dict[str, list[asyncio.Future[None]]] = {}

    @classmethod
    async def connect(cls, bus: str = "system") -> Systemd:
        """bus: "system", "user" (the session bus of the caller's user manager) or an address."""
        async def open_bus() -> MessageBus:
            try:
                if bus == "system":
                    return await MessageBus(bus_type=BusType.SYSTEM).connect()
                if bus == "user":
                    return await MessageBus(bus_type=BusType.SESSION).connect()
                return await MessageBus(bus_address=bus).connect()
            except (OSError, AuthError, ValueError) as e:
                raise SystemdUnavailable(
                    f"cannot connect to the {bus} D-Bus: {e}. Is systemd the init system "
                    "here, and dbus running?") from e
        self = cls(await open_bus(), open_bus)
        await self._subscribe()
        self._keeper = asyncio.get_running_loop().create_task(self._keep_connected())
        return self

    def on_reconnect(self, listener: Callable[[], None]) -> None:
        """listener() after each reconnection (signals sent while away were lost)."""
        self._reconnect_listeners.append(listener)

    async def _subscribe(self) -> None:
        self._bus.add_message_handler(self._on_message)
        for rule in (
            f"type='signal',sender='{SYSTEMD}',interface='{MANAGER}'",
            f"type='signal',sender='{SYSTEMD}',interface='{PROPERTIES}',"
            f"member='PropertiesChanged',path_namespace='{SYSTEMD_PATH}/unit'",
        ):
            await self._call(DBUS, DBUS_PATH, DBUS, "AddMatch", "s", [rule])
        await self._manager("Subscribe")

    async def _keep_connected(self) -> None:
        assert self._reopen is not None
        while True:
            reason: object = "closed"
            try:
                await self._bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
            except Exception as e:
                reason = e
            if self._closing:
                return
            self._online.clear()
            log.warning("lost the system bus (%s); reconnecting", reason)
            self._fail_waits(SystemdUnavailable(
                "lost the D-Bus connection to systemd while waiting for it"))
            for attempt in itertools.count():
                await asyncio.sleep(RECONNECT_DELAYS_S[min(attempt,
                                                           len(RECONNECT_DELAYS_S) - 1)])
                try:
                    self._bus = await self._reopen()
                    self._online.set()   # (_subscribe's own calls need it)
                    await self._subscribe()
                    break
                except Exception as e:
                    self._online.clear()
                    log.warning("reconnecting to the system bus failed: %s", e)
            log.warning("reconnected to the system bus; checking the engines' units again")
            for listener in list(self._reconnect_listeners):
                listener()

    def _fail_waits(self, error: Exception) -> None:
        waits: list[asyncio.Future[Any]] = [
            *self._jobs.values(), *(f for futs in self._removals.values() for f in futs)]
        for waiting in waits:
            if not waiting.done():
                waiting.set_exception(error)
        self._jobs.clear()
        self._removals.clear()

    def close(self) -> None:
        self._closing = True
        if self._keeper is not None:
            self._keeper.cancel()
        self._bus.disconnect()

    # -- unit operations ---------------------------------------------------------

    async def start_transient(self, spec: UnitSpec, mode: str = "fail") -> str:
        """Create and start a transient unit; returns the job result ("done")."""
        props = [[name, Variant(sig, value)] for name, sig, value in spec.properties()]
        (job,) = await self._manager("StartTransientUnit", "ssa(sv)a(sa(sv))",
                                     [spec.name, mode, props, []])
        return await self._job_result(job, spec.name, "start")

    async def start_unit(self, name: str, mode: str = "replace") -> str:
        (job,) = await self._manager("StartUnit", "ss", [name, mode])
        return await self._job_result(job, name, "start")

    async def stop_unit(self, name: str, mode: str = "replace") -> str:
        (job,) = await self._manager("StopUnit", "ss", [name, mode])
        return await self._job_result(job, name, "stop")

    async def set_unit_properties(self, name: str, properties: Sequence[tuple[str, str, Any]],
                                  runtime: bool = True) -> None:
        props = [[key, Variant(sig, value)] for key, sig, value in properties]
        await self._manager("SetUnitProperties", "sba(sv)", [name, runtime, props])

    async def kill_unit(self, name: str, signal: int, whom: str = "all") -> None:
        await self._manager("KillUnit", "ssi", [name, whom, signal])

    async def reset_failed_unit(self, name: str) -> None:
        await self._manager("ResetFailedUnit", "s", [name])

    async def list_units(self, patterns: Iterable[str]) -> list[ListedUnit]:
        (units,) = await self._manager("ListUnitsByPatterns", "asas", [[], list(patterns)])
        return [ListedUnit(u[0]) for u in units]

    async def properties(self, unit: str, interface: str = UNIT) -> dict[str, Any]:
        (props,) = await self._call(SYSTEMD, unit_object_path(unit), PROPERTIES, "GetAll",
                                    "s", [interface])
        return {k: v.value for k, v in props.items()}

    async def unit_loaded(self, name: str) -> bool:
        """Whether systemd has the unit loaded at all (GetUnit, which loads nothing)."""
        try:
            await self._manager("GetUnit", "s", [name])
        except UnitOperationFailed as e:
            if e.extra.get("dbus_error") == NO_SUCH_UNIT:
                return False
            raise
        return True

    async def wait_unit_gone(self, name: str, timeout: float) -> bool:
        """Wait until systemd unloads the unit (UnitRemoved), up to timeout seconds.
        True when it is gone. The signal is awaited before asking, so none is missed."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._removals.setdefault(name, []).append(fut)
        try:
            if not await self.unit_loaded(name):
                return True
            await asyncio.wait_for(fut, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            waiting = self._removals.get(name, [])
            if fut in waiting:
                waiting.remove(fut)
            if not waiting:
                self._removals.pop(name, None)

    # -- watching ------------------------------------------------------------------

    def watch(self, callback: UnitChangeCallback) -> Callable[[], None]:
        """Call callback(unit, changed) on every watched property change; returns unwatch."""
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback)

    def _on_message(self, msg: Message) -> None:
        if msg.message_type != MessageType.SIGNAL:
            return
        if msg.member == "JobRemoved" and msg.interface == MANAGER:
            _id, job, _unit, result = msg.body
            fut = self._jobs.pop(job, None)
            if fut is None:
                self._finished_jobs[job] = result
                if len(self._finished_jobs) > FINISHED_JOBS_KEPT:
                    self._finished_jobs.popitem(last=False)
            elif not fut.done():
                fut.set_result(result)
        elif msg.member == "UnitRemoved" and msg.interface == MANAGER:
            for removal in self._removals.pop(msg.body[0], []):
                if not removal.done():
                    removal.set_result(None)
        elif msg.member == "PropertiesChanged" and self._watchers:
            unit = unit_name_from_path(msg.path or "")
            changed = {k: v.value for k, v in msg.body[1].items() if k in WATCHED}
            if unit and changed:
                for callback in list(self._watchers):
                    callback(unit, changed)

    async def _job_result(self, job: str, unit: str, verb: str, timeout: float = 120) -> str:
        result = self._finished_jobs.pop(job, None)
        if result is None:
            fut = self._jobs.setdefault(job, asyncio.get_running_loop().create_future())
            try:
                result = await asyncio.wait_for(fut, timeout)
            finally:
                self._jobs.pop(job, None)
        if result != "done":
            raise UnitOperationFailed(
                f"systemd could not {verb} {unit}: job {result}. "
                f"See: journalctl -u {unit}", unit=unit, job_result=result)
        return result

    # -- plumbing ------------------------------------------------------------------

    async def _manager(self, member: str, signature: str = "",
                       body: Sequence[Any] = ()) -> list[Any]:
        return await self._call(SYSTEMD, SYSTEMD_PATH, MANAGER, member, signature, body)

    async def _call(self, destination: str, path: str, interface: str, member: str,
                    signature: str = "", body: Sequence[Any] = ()) -> list[Any]:
        if not self._online.is_set() or not self._bus.connected:
            with contextlib.suppress(TimeoutError):   # reconnecting: wait for it a while
                await asyncio.wait_for(self._online.wait(), RECONNECT_WAIT_S)
            if not self._online.is_set() or not self._bus.connected:
                raise SystemdUnavailable(f"no D-Bus connection to systemd for {member} "
                                         f"(reconnecting for {RECONNECT_WAIT_S:g}s)")
        try:
            reply = await self._bus.call(Message(
                destination=destination, path=path, interface=interface, member=member,
                signature=signature, body=list(body)))
        except (OSError, EOFError, RuntimeError) as e:   # (RuntimeError: a closed transport)
            raise SystemdUnavailable(f"lost the D-Bus connection to systemd: {e}") from e
        if reply is None:
            raise SystemdUnavailable(f"no reply from systemd to {member}")
        if reply.message_type == MessageType.ERROR:
            detail = reply.body[0] if reply.body else reply.error_name
            if reply.error_name in _ACCESS_DENIED:
                raise AccessDenied(f"{member} denied: {detail}", dbus_error=reply.error_name)
            raise UnitOperationFailed(f"{member} failed: {detail}", dbus_error=reply.error_name)
        return list(reply.body)

