"""Journals from journald (journalctl): an engine's last lines, for failures and the admin
API; and journals followed as they are written (the admin API's ?follow=1), the
gateway's own among them.

A follow is one `journalctl -f` process per client, read line by line. It ends by its
PID (SIGTERM, SIGKILL after TERM_WAIT_S, then reaped) when its client goes away or the
gateway stops (Journals.close), so a page left open never holds a stop nor leaves a
process behind; at most MAX_FOLLOWS run at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from gatewayd.core.errors import JournalUnavailable, ShuttingDown, TooManyLogFollows
from gatewayd.core.logs import OwnUnit, unit_of_cgroup

log = logging.getLogger("gatewayd.journal")
MAX_FOLLOWS = 8
TERM_WAIT_S = 2.0          # a follow's journalctl gets this long to end on SIGTERM
MAX_LINE_BYTES = 1 << 20   # journald cuts a message at 48 KiB (LineMax=) by default
CGROUP_FILE = Path("/proc/self/cgroup")


def unit_flag(manager: str) -> str:
    return "--user-unit" if manager == "user" else "--unit"


class Journalctl:
    def __init__(self, manager: str = "system") -> None:
        self._unit_flag = unit_flag(manager)

    async def tail(self, unit: str, lines: int) -> list[str]:
        try:
            proc = await asyncio.create_subprocess_exec(
                "journalctl", self._unit_flag, unit, "-n", str(lines), "-o", "short-iso",
                "--no-pager", "--quiet", stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            return [f"(journal unavailable: {e})"]
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return ["(journalctl did not answer in 10 s)"]
        if proc.returncode != 0:
            return [f"(journalctl failed: {err.decode(errors='replace').strip()})"]
        return out.decode(errors="replace").splitlines()


def own_unit() -> OwnUnit | None:
    """The systemd service the gateway runs as; None where it does not run under systemd
    (systemd sets INVOCATION_ID for every service it starts)."""
    if not os.environ.get("INVOCATION_ID"):
        return None
    try:
        return unit_of_cgroup(CGROUP_FILE.read_text())
    except OSError:
        return None


class JournalFollow:
    """One `journalctl -f`: its lines as they are written."""

    def __init__(self, proc: asyncio.subprocess.Process,
                 on_end: Callable[[JournalFollow], None]) -> None:
        self._proc = proc
        self._on_end = on_end
        self._ending: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def exit_status(self) -> int | None:
        return self._proc.returncode

    async def line(self) -> str | None:
        """The next line (waits for it to be written); None once journalctl ended."""
        assert self._proc.stdout is not None   # (a pipe: follow() asks for one)
        try:
            raw = await self._proc.stdout.readline()
        except ValueError:   # longer than MAX_LINE_BYTES: readline dropped what it had
            return "(a line longer than the follow's limit was left out)"
        return raw.decode(errors="replace").rstrip("\n") if raw else None

    def terminate(self) -> None:
        """SIGTERM to its PID, now (the line() waiting then sees the end)."""
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.terminate()

    async def end(self) -> None:
        """Ended by its PID and reaped; any caller (the client's handler, the gateway's
        stop) waits for the one ending."""
        if self._ending is None:
            self._ending = asyncio.get_running_loop().create_task(self._end())
        await asyncio.shield(self._ending)

    async def _end(self) -> None:
        try:
            self.terminate()
            try:
                await asyncio.wait_for(self._proc.wait(), TERM_WAIT_S)
            except TimeoutError:
                log.warning("journalctl (PID %d) did not end on SIGTERM: killing it",
                            self._proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                await self._proc.wait()
        finally:
            self._on_end(self)


class Journals:
    """The journals the admin API reads: at most `limit` follows at once."""

    def __init__(self, limit: int = MAX_FOLLOWS) -> None:
        self.limit = limit
        self._follows: set[JournalFollow] = set()
        self._opening = 0          # follows whose journalctl is being started
        self.closed = False

    @property
    def following(self) -> int:
        return len(self._follows) + self._opening

    async def tail(self, unit: str, manager: str, lines: int) -> list[str]:
        return await Journalctl(manager).tail(unit, lines)

    async def follow(self, unit: str, manager: str, lines: int) -> JournalFollow:
        """`journalctl -f` of the unit, its last `lines` first. The unit is the caller's
        (an engine's, or the gateway's own), never text from a request; argv, no shell."""
        if self.closed:
            raise ShuttingDown("the gateway is stopping")
        if self.following >= self.limit:
            raise TooManyLogFollows(
                f"{self.limit} journal follows already run (the gateway's and its engines' "
                "together, each a journalctl process held while its client stays): end one "
                "(a page or an `llm-gateway logs -f` left open) and ask again",
                retry_after=5)
        self._opening += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                "journalctl", unit_flag(manager), unit, "-f", "-n", str(lines),
                "-o", "short-iso", "--no-pager", "--quiet",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                # its complaints (no such unit, no permission) are lines of the follow
                stderr=asyncio.subprocess.STDOUT, limit=MAX_LINE_BYTES)
        except OSError as e:
            raise JournalUnavailable(f"journalctl could not run: {e}") from None
        finally:
            self._opening -= 1
        follow = JournalFollow(proc, self._follows.discard)
        self._follows.add(follow)
        if self.closed:   # the stop came while it started
            follow.terminate()
        return follow

    def close(self) -> None:
        """The gateway is stopping: every follow's journalctl is sent SIGTERM now (each
        client then hears the end), and no new one starts."""
        self.closed = True
        for follow in list(self._follows):
            follow.terminate()

    async def aclose(self) -> None:
        """close(), and every journalctl ended and reaped."""
        self.close()
        follows = list(self._follows)
        if follows:
            await asyncio.gather(*(f.end() for f in follows), return_exceptions=True)

    def own_unit(self) -> OwnUnit | None:
        return own_unit()
