"""A transient service unit, described as data. Pure: no D-Bus types here.

The systemd adapter turns `properties()` into the a(sv) array of
StartTransientUnit; the core builds UnitSpecs without importing D-Bus.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class UnitSpec:
    """What a transient service unit should be. Times are in seconds."""

    name: str
    argv: Sequence[str]
    description: str = ""
    environment: Mapping[str, str] = field(default_factory=dict)
    runtime_directory: str | None = None
    runtime_directory_mode: int = 0o700
    umask: int = 0o077
    restart: str = "on-failure"
    restart_sec: float = 1.0
    start_limit_interval_sec: float = 60.0
    start_limit_burst: int = 5
    timeout_stop_sec: float = 10.0
    kill_mode: str = "control-group"
    collect_mode: str = "inactive-or-failed"
    service_type: str = "exec"
    syslog_identifier: str | None = None
    slice: str | None = None
    extra: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    # The unit's own identity (DynamicUser=yes with this name: systemd uses the static
    # user of that name where one exists, else allocates one), and the paths a
    # privileged ExecStartPre hands over to it (chown) before the main process runs.
    user: str | None = None
    hand_over: Sequence[str] = ()
    # properties appended as given: sandboxing settings, some named twice
    # (SystemCallFilter= allow list, then deny list)
    sandbox: Sequence[tuple[str, str, Any]] = ()

    def properties(self) -> list[tuple[str, str, Any]]:
        """(name, D-Bus signature, value) for StartTransientUnit's a(sv) array."""
        if not self.argv or not os.path.isabs(self.argv[0]):
            raise ValueError("argv[0] must be an absolute path")
        props: dict[str, tuple[str, Any]] = {
            "Description": ("s", self.description or self.name),
            "Type": ("s", self.service_type),
            # ExecStart is a(sasb): (path, argv including argv[0], ignore-failure).
            # systemd expands ${VAR} in the arguments (not in the path): double
            # every $ so that an argument is always passed exactly as given.
            "ExecStart": ("a(sasb)", [[self.argv[0], exec_args(self.argv), False]]),
            "Restart": ("s", self.restart),
            "RestartUSec": ("t", _usec(self.restart_sec)),
            "StartLimitIntervalUSec": ("t", _usec(self.start_limit_interval_sec)),
            "StartLimitBurst": ("u", self.start_limit_burst),
            "TimeoutStopUSec": ("t", _usec(self.timeout_stop_sec)),
            "KillMode": ("s", self.kill_mode),
            "CollectMode": ("s", self.collect_mode),
            "UMask": ("u", self.umask),
            "Environment": ("as", [f"{k}={v}" for k, v in self.environment.items()]),
        }
        if self.runtime_directory:
            props["RuntimeDirectory"] = ("as", [self.runtime_directory])
            props["RuntimeDirectoryMode"] = ("u", self.runtime_directory_mode)
        if self.syslog_identifier:
            props["SyslogIdentifier"] = ("s", self.syslog_identifier)
        if self.slice:
            props["Slice"] = ("s", self.slice)
        if self.user:
            props["DynamicUser"] = ("b", True)
            props["User"] = ("s", self.user)
            props["Group"] = ("s", self.user)
            if self.hand_over:
                # "+": run as root outside the sandbox; ignore-failure: a path it cannot
                # hand over fails where the engine uses it (logged), not the start.
                # systemd 252 drops a privileged ExecStartPreEx= at a daemon-reexec (it
                # reads back its own "+" line as nothing): only systemd's own restart of
                # a unit created before a reexec runs without it, the folder already its
                chown = ["/bin/chown", "-R", f"{self.user}:{self.user}", "--",
                         *self.hand_over]
                props["ExecStartPreEx"] = ("a(sasas)", [
                    [chown[0], exec_args(chown), ["privileged", "ignore-failure"]]])
        props.update(self.extra)
        return [(key, sig, value) for key, (sig, value) in props.items()] + list(self.sandbox)


def exec_args(argv: Sequence[str]) -> list[str]:
    """argv for an Exec*= property, immune to systemd's $VAR expansion."""
    return [arg.replace("$", "$$") for arg in argv]


def _usec(seconds: float) -> int:
    return round(seconds * 1_000_000)
