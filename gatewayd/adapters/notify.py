"""sd_notify (READY=1, STATUS=, WATCHDOG=1) and the listening socket systemd hands over."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import sdnotify

SD_LISTEN_FDS_START = 3


class Notifier:
    """Talks to systemd when NOTIFY_SOCKET is set; does nothing otherwise."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._sd = sdnotify.SystemdNotifier() if self.enabled else None
        self._watchdog: asyncio.Task[None] | None = None

    def notify(self, message: str) -> None:
        if self._sd is not None:
            self._sd.notify(message)

    def ready(self, status: str) -> None:
        self.notify(f"READY=1\nSTATUS={status}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self) -> None:
        self.notify("STOPPING=1\nSTATUS=shutting down, letting streams finish")

    def start_watchdog(self) -> None:
        """Ping at half of WatchdogSec= (WATCHDOG_USEC), if the unit asked for it."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or not self.enabled or (pid and int(pid) != os.getpid()):
            return
        interval = int(usec) / 1e6 / 2

        async def ping() -> None:
            while True:
                self.notify("WATCHDOG=1")
                await asyncio.sleep(interval)
        self._watchdog = asyncio.get_running_loop().create_task(ping())

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()


ADMIN_FD_NAME = "admin"   # FileDescriptorName= of llm-gateway-admin.socket


def inherited_sockets() -> tuple[socket.socket | None, socket.socket | None]:
    """(public, admin): the sockets passed by systemd socket activation, if they are meant
    for us. The admin API's is the one named "admin" (LISTEN_FDNAMES); the public one is
    the first other."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None, None
    try:
        count = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None, None
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)  # not for our children
    public = admin = None
    for index in range(max(count, 0)):
        sock = socket.socket(fileno=SD_LISTEN_FDS_START + index)
        with contextlib.suppress(OSError):
            sock.setblocking(False)
        name = names[index] if index < len(names) else ""
        if name == ADMIN_FD_NAME and admin is None:
            admin = sock
        elif public is None:
            public = sock
        else:
            sock.close()   # not one we know what to do with
    return public, admin
