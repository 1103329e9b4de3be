"""Parked engine units: the FIFOs that hold them and the register of who is parked.

A parked unit (core/engine_units.py, "parked units") is a model's engine unit whose
main process is blocked on its FIFO: the engine itself, held before its main() by the
preloaded wait (gatewayd/engine_park.c), or a shell that execs it. It is not an engine
yet: the engine layer never sees it (its signals are held back here, listings leave it
out) until a start wakes it, and then it is that start's unit, running and about to load.

What marks a unit as parked, also for a gateway that restarted meanwhile: its
environment names the engine it becomes (PARKED_ENV) and its FIFO still exists or its
main process still waits (named PARKED_COMM, or the shell). The gateway removes the FIFO
as it wakes the unit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.machinery
import logging
import os
import stat
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatewayd.core.engine_units import MODEL_ENV, PARK_SHELL, PARKED_COMM, PARKED_ENV
from gatewayd.core.unit_spec import UnitSpec

log = logging.getLogger("gatewayd.units")
WAKE_WAIT_S = 0.5      # a unit parked a moment ago may not have opened its FIFO yet
_WAKE_RETRY_S = 0.002
WAITING_NAMES = frozenset({PARKED_COMM, os.path.basename(PARK_SHELL)})
PRELOAD_NAME = "_engine_park"   # gatewayd/_engine_park*.so, built from engine_park.c


@dataclass
class ParkedUnit:
    """A unit created ahead of its engine's start, its main process waiting on a FIFO."""
    unit: str
    digest: str                 # the engine unit it becomes (engine_units.spec_digest)
    fifo: Path
    parked_at: float            # for the least recently parked to go first
    props: dict[str, Any] = field(default_factory=dict)   # its unit's state, as last seen
    model_id: str | None = None
    # the engine unit it becomes, and the model and configuration objects it was made
    # from: a start for those very objects wakes it without making and comparing the
    # spec again (a reload or a catalog rescan makes new objects). None: found parked
    spec: UnitSpec | None = None
    made_for: tuple[object, object] | None = None

    def made_from(self, model: object, config: object) -> UnitSpec | None:
        """Its engine unit, if it was parked for exactly this model and configuration."""
        if self.made_for is None or self.made_for[0] is not model \
                or self.made_for[1] is not config:
            return None
        return self.spec


class ParkingLot:
    """The parked units of one unit manager, and the units whose signals it holds back:
    parked, being parked, or being stopped because nobody will wake them."""

    def __init__(self, directory: Path, limit: int) -> None:
        self.directory = directory
        self.limit = limit
        self.parked: dict[str, ParkedUnit] = {}
        self.hidden: set[str] = set()
        self._discards: dict[str, asyncio.Task[None]] = {}
        # unit -> the main process a wake turned into its engine: until that process
        # runs again after the wake (a loaded machine: milliseconds), it is still named
        # as waiting, and a listing must not take it for parked again (adopted, its
        # engine's signals were held back and a surplus discard stopped it unheard)
        self._woken: dict[str, int] = {}

    def fifo_for(self, instance: str) -> Path:
        return self.directory / instance

    def make_fifo(self, instance: str) -> Path:
        """A fresh FIFO for the instance (a leftover one is replaced), 0600: the unit
        hands it to the engine's user as it starts (engine_units.parked_spec), so the
        directory lets others pass (0711) but not list."""
        self.directory.mkdir(mode=0o711, parents=True, exist_ok=True)
        if stat.S_IMODE(self.directory.stat().st_mode) != 0o711:   # made 0700 before
            os.chmod(self.directory, 0o711)
        fifo = self.fifo_for(instance)
        with contextlib.suppress(FileNotFoundError):
            fifo.unlink()
        os.mkfifo(fifo, 0o600)
        return fifo

    def models(self) -> list[str]:
        """The models whose unit is parked, least recently parked first."""
        return [p.model_id for p in sorted(self.parked.values(), key=lambda p: p.parked_at)
                if p.model_id is not None]

    def claim(self, unit: str) -> ParkedUnit | None:
        """Take the unit's parked entry for a start (it stays hidden until woken)."""
        return self.parked.pop(unit, None)

    def woken(self, parked: ParkedUnit) -> None:
        """The claimed unit was woken: an engine from now on, its signals heard."""
        self.hidden.discard(parked.unit)
        self._woken[parked.unit] = int(parked.props.get("MainPID") or 0)

    def surplus(self) -> list[ParkedUnit]:
        """The parked units beyond the limit, least recently parked first; taken out."""
        extra = sorted(self.parked.values(), key=lambda p: p.parked_at)
        extra = extra[:max(0, len(extra) - self.limit)]
        for parked in extra:
            del self.parked[parked.unit]
        return extra

    def is_parked(self, unit: str, instance: str, env: Mapping[str, str],
                  main_pid: int) -> bool:
        """Whether a unit systemd lists is a parked one (see the module's docstring)."""
        if unit in self.hidden:
            return True
        if main_pid and self._woken.get(unit) == main_pid:
            return False
        return bool(env.get(PARKED_ENV)) and (
            is_fifo(self.fifo_for(instance)) or main_waits(main_pid))

    def adopt(self, unit: str, instance: str, env: Mapping[str, str],
              props: dict[str, Any], started_at_us: int) -> None:
        """A parked unit found in a listing (a previous gateway parked it). Without its
        FIFO it cannot be woken: a start discards it."""
        if unit in self.hidden:
            return
        self.parked[unit] = ParkedUnit(unit, env.get(PARKED_ENV, ""), self.fifo_for(instance),
                                       parked_at=started_at_us / 1e6, props=props,
                                       model_id=env.get(MODEL_ENV))
        self.hidden.add(unit)

    def seen(self, unit: str, changed: Mapping[str, Any]) -> bool:
        """A unit's signal: True when it is held back here (the unit is parked or going)."""
        if unit not in self.hidden:
            return False
        parked = self.parked.get(unit)
        if parked is not None:
            parked.props.update(changed)
            if changed.get("ActiveState") in ("inactive", "failed"):
                # stopped behind our back: nothing to wake any more
                del self.parked[unit]
                self.hidden.discard(unit)
                with contextlib.suppress(OSError):
                    parked.fifo.unlink()
        return True

    def discard(self, parked: ParkedUnit,
                stop: Callable[[str], Awaitable[None]]) -> asyncio.Task[None]:
        """Stop a parked unit nobody will wake (its signals stay held back until it is
        gone); a start of its model waits for that (settled)."""
        async def run() -> None:
            try:
                with contextlib.suppress(OSError):
                    parked.fifo.unlink()
                await stop(parked.unit)
            except Exception as e:   # the reconciler sees whatever remains
                log.warning("could not stop the parked unit %s: %s", parked.unit, e)
            finally:
                self.hidden.discard(parked.unit)
                self._discards.pop(parked.unit, None)
        task = asyncio.get_running_loop().create_task(run())
        self._discards[parked.unit] = task
        return task

    def discard_surplus(self, stop: Callable[[str], Awaitable[None]]
                        ) -> list[asyncio.Task[None]]:
        """Discard the parked units beyond the limit, all at once: a start of any of
        their models must find its discard under way (settled), not the unit still
        running with no entry here."""
        return [self.discard(extra, stop) for extra in self.surplus()]

    async def settled(self, unit: str) -> None:
        """Returns once no discard of the unit is under way."""
        if (task := self._discards.get(unit)) is not None:
            await asyncio.shield(task)

    async def close(self) -> None:
        for task in list(self._discards.values()):
            task.cancel()


def is_fifo(path: Path) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def process_name(pid: int) -> str | None:
    """The process's name (comm), or None: no such process."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return None


def main_waits(pid: int) -> bool:
    """Whether the unit's main process still waits to be woken (not yet the engine)."""
    return process_name(pid) in WAITING_NAMES


async def settle(pid: int, socket: str, timeout_s: float, waiting_name: str) -> bool:
    """Whether a just parked unit's main process came to wait on its FIFO (named
    waiting_name: PARKED_COMM, or the shell's). False: it went on to be the engine (its
    socket appeared: the preload did not take), ended, or did neither within timeout_s.
    With the preload it is named after the engine binary between its exec and its wait
    (the dynamic linker binds every symbol first, for CUDA's libraries far longer than
    for a CPU llama-server: docs/benchmarks.md, "Figures behind choices in the code")."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        name = process_name(pid)
        if name == waiting_name:
            return True
        if name is None or os.path.exists(socket) or time.monotonic() >= deadline:
            return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


def preload_library(package: Path | None = None) -> str | None:
    """The preloaded wait's library, where it was built (setup.py: a C compiler), in the
    gatewayd package's folder (package: another, for tests). None also where its path
    holds a space or a colon: LD_PRELOAD splits on both."""
    here = package or Path(__file__).resolve().parents[1]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"{PRELOAD_NAME}{suffix}"
        if candidate.is_file():
            return None if {" ", ":"} & set(str(candidate)) else str(candidate)
    return None


def takes_preload(binary: str) -> bool:
    """Whether the program can be parked with the preloaded wait: a dynamically linked
    ELF whose interpreter is glibc's (a static program never loads the library and would
    start loading its model at once; musl's loader cannot load a glibc library)."""
    try:
        with open(binary, "rb") as f:
            ident = f.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2:
                return False    # 64-bit ELF only (the library is built for this machine)
            endian = "<" if ident[5] == 1 else ">"
            phoff, = struct.unpack_from(endian + "Q", ident, 32)
            phentsize, phnum = struct.unpack_from(endian + "HH", ident, 54)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(phnum):
                kind, _, offset, _, _, size = struct.unpack_from(
                    endian + "IIQQQQ", table, i * phentsize)
                if kind == 3 and 0 < size < 4096:   # PT_INTERP
                    f.seek(offset)
                    interpreter = f.read(size).rstrip(b"\0")
                    return os.path.basename(interpreter).startswith(b"ld-linux")
    except (OSError, struct.error):
        return False
    return False


async def wake(fifo: Path, line: bytes, *, wait_s: float = WAKE_WAIT_S) -> bool:
    """Tell the parked unit to go on: its engine's main() starts (or its shell execs the
    engine). The FIFO is unlinked first, so a restart of the unit runs the engine
    directly. False: nobody read it within wait_s (the unit is gone or never got to the
    FIFO)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if not stat.S_ISFIFO(os.stat(fifo).st_mode):
                return False
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            break
        except FileNotFoundError:
            return False
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_WAKE_RETRY_S)   # no reader yet: the unit is starting
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fifo)
        try:
            os.write(fd, line)
        except BrokenPipeError:
            # it died between open and write: its restart finds no FIFO and runs
            # the engine directly, which is what was asked
            return True
        except OSError:
            return False   # not told its devices: the caller stops the unit, starts anew
    finally:
        os.close(fd)
    return True
