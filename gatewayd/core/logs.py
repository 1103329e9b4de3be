"""Reading journals, the pure part: which systemd unit the gateway runs as (read from its
cgroup), which lines a follow passes on (its grep), and what a failed engine's last lines
say (failure_cause). The journal itself is read by adapters/journal."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class FailureCause:
    """What a failed engine's last journal lines say, as one of a closed set: a code and
    a fixed sentence, never the lines' own words (they may hold other clients' prompts,
    paths, the host's details: the inference caller is told this, the admin the lines)."""
    code: str
    text: str


# (code, what the caller is told, phrases of a line that say it, in any case): the first
# cause any line says wins, so the more specific come first
FAILURE_CAUSES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("wrong_port", "its server listens on another TCP port than the one its {port} says",
     ("the port its command's {port} says",)),
    ("no_loopback", "loopback is down in its private network namespace",
     ("engine_launch: loopback is down",)),
    ("bad_argument", "its server refused its command line (an unknown or invalid argument)",
     ("error: invalid argument", "error while handling argument", "unrecognized argument",
      "unknown argument")),
    ("gpu_out_of_memory", "it ran out of GPU memory",
     ("cudamalloc failed", "cuda error: out of memory", "erroroutofdevicememory",
      "cuda out of memory")),
    ("model_load", "its server could not load the model",
     ("failed to load model", "error loading model", "cannot load the model",
      "failed to initialize whisper context", "unable to load model")),
    ("address_in_use", "the address its server was told to listen on is taken",
     ("address already in use", "couldn't bind")),
    ("missing_module", "its server's Python lacks a module it imports",
     ("modulenotfounderror",)),
    ("permission_denied", "its server was denied access to a file or device",
     ("permission denied",)),
)
# systemd's own exit statuses (systemd.exec(5), "Process Exit Codes"): the unit's process
# was never the server, as systemd could not set it up
SYSTEMD_EXIT_STATUSES: dict[int, str] = {
    200: "CHDIR", 203: "EXEC", 204: "MEMORY", 216: "GROUP", 217: "USER",
    218: "CAPABILITIES", 219: "CGROUP", 225: "NETWORK", 226: "NAMESPACE",
    228: "SECCOMP", 232: "ADDRESS_FAMILIES", 233: "RUNTIME_DIRECTORY", 243: "CREDENTIALS",
}


def failure_cause(lines: Sequence[str], exit_code: int | None = None) -> FailureCause | None:
    """The cause a failed engine's last lines (and its exit status) say; None: none known."""
    if exit_code is not None and 200 <= exit_code <= 243:
        name = SYSTEMD_EXIT_STATUSES.get(exit_code, str(exit_code))
        return FailureCause("systemd_exec", f"systemd could not set up its process (exit "
                                            f"status {exit_code}/{name}, systemd.exec(5))")
    folded = [line.casefold() for line in lines]
    for code, text, phrases in FAILURE_CAUSES:
        if any(p in line for line in folded for p in phrases):
            return FailureCause(code, text)
    return None
