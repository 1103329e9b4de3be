"""Reading journals, the pure part: which systemd unit the gateway runs as (read from its
cgroup), and which lines a follow passes on (its grep). The journal itself is read by
adapters/journal."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class OwnUnit:
    """The systemd unit the gateway runs as, and whose manager runs it."""
    unit: str
    manager: str     # "system" or "user" (journalctl --unit or --user-unit)


def unit_of_cgroup(text: str) -> OwnUnit | None:
    """The service a process runs in, from its /proc/self/cgroup text; None for none (a
    scope: a login session, a terminal; or no systemd at all).

    The unified hierarchy's line ("0::/PATH") is read, else the v1 "name=systemd" one.
    From the leaf up, the first unit-like component decides: a .service is the unit (a
    service may have cgroups of its own below it, Delegate=), a .scope is no service.
    A service below a user manager (user@UID.service) is that manager's unit. systemd
    escapes a cgroup name that could be mistaken for a kernel file with a leading "_".
    """
    path = None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, where = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            path = where
            break
        if controllers == "name=systemd":
            path = where
    if not path:
        return None
    parts = [p.removeprefix("_") for p in path.strip().split("/") if p]
    for i in range(len(parts) - 1, -1, -1):
        name = parts[i]
        if name.endswith(".scope"):
            return None
        if name.endswith(".service"):
            user = any(p.startswith("user@") and p.endswith(".service") for p in parts[:i])
            return OwnUnit(name, "user" if user else "system")
    return None


def line_filter(grep: str | None) -> Callable[[str], bool]:
    """Which lines a follow or a tail passes on: with grep, those that contain it, in any
    case: plain text, not a pattern (a user's `[` or `.` means itself, and no regular
    expression runs per journal line); without, every line."""
    if not grep:
        return lambda line: True
    needle = grep.casefold()
    return lambda line: needle in line.casefold()
