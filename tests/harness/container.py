"""A Python face for systemd-container.sh: a throwaway systemd system manager.

The shell script does the booting (it is also what a developer uses by hand);
this class gives tests typed verbs and the paths that reach into the container
from the host. Every verb raises ContainerError with the script's own message.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shlex
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

SCRIPT = Path(__file__).with_name("systemd-container.sh")
DEFAULT_STATE_ROOT = Path("/var/tmp/llm-gateway-containers")


class ContainerError(RuntimeError):
    """The container could not be booted, entered or stopped."""


def why_unavailable() -> str | None:
    """Why a container cannot boot on this machine, or None if it should."""
    if os.geteuid() != 0:
        return "the systemd test container needs root (nspawn, overlayfs, cgroups)"
    if not Path("/lib/systemd/systemd").exists():
        return "systemd is not installed on this machine (/lib/systemd/systemd missing)"
    if not any(Path(d, "systemd-nspawn").exists() for d in ("/usr/bin", "/bin")):
        return (f"systemd-nspawn is missing: run '{SCRIPT} deps' "
                "(installs systemd-container pinned to the installed systemd)")
    return None


PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Adopt our orphaned descendants, so we can reap them.

    The script detaches the container's supervisor (setsid ... &). Where PID 1
    reaps orphans (systemd), that is enough; on machines whose PID 1 does not,
    the exited supervisor would stay behind as a zombie forever. As a child
    subreaper, this process inherits it instead and reaps it in stop().
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def engine_workdir(prefix: str) -> Path:
    """A host directory to bind into a container for models and state that its engines
    must read: outside /tmp and /var/tmp (an engine has a private /tmp of its own) and
    passable by the engines' user (mkdtemp makes it 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/srv"))
    path.chmod(0o755)
    return path


class SystemdContainer:
    """One booted container. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        name: str,
        *,
        binds: Iterable[str | Path] = (),
        binds_ro: Iterable[str | Path] = (),
        private_network: bool = True,
        memory_cgroup: bool = True,
        state_root: Path = DEFAULT_STATE_ROOT,
    ) -> None:
        """memory_cgroup=False: on a hybrid cgroup host, leave the container's memory
        hierarchy read-only (no MemoryCurrent, MemoryMax= not enforced)."""
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,30}", name):
            raise ValueError(f"bad container name {name!r}")
        self.name = name
        self.state_root = state_root
        self._supervisor: int | None = None
        self._env = {
            **os.environ,
            "LAB_STATE": str(state_root),
            "LAB_BIND": " ".join(str(b) for b in binds),
            "LAB_BIND_RO": " ".join(str(b) for b in binds_ro),
            "LAB_PRIVATE_NETWORK": "1" if private_network else "0",
            "LAB_MEMORY_CGROUP": "1" if memory_cgroup else "0",
        }

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> str:
        _become_subreaper()
        try:
            out = self._script("start", self.name, timeout=90).strip()
        except ContainerError:   # a boot that failed or timed out leaves nothing running
            with contextlib.suppress(ContainerError):
                self._script("stop", self.name, timeout=90)
            self._reap_supervisor_from_file()
            raise
        self._supervisor = int((self.state_dir / "supervisor.pid").read_text())
        return out

    def reboot(self) -> str:
        return self._script("reboot", self.name, timeout=90).strip()

    def stop(self) -> str:
        out = self._script("stop", self.name, timeout=90).strip()
        self._reap_supervisor()
        return out

    def _reap_supervisor_from_file(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._supervisor = int((self.state_dir / "supervisor.pid").read_text())
        self._reap_supervisor()

    def _reap_supervisor(self, timeout: float = 10) -> None:
        pid, self._supervisor = self._supervisor, None
        if pid is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:  # not ours (started by another process) or reaped
                return
            time.sleep(0.02)

    def __enter__(self) -> SystemdContainer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- running things inside -----------------------------------------------------

    def exec(self, *argv: str, check: bool = True, timeout: float = 120,
             input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run argv inside every namespace of the container (not as a service)."""
        return self._run_script(["exec", self.name, *argv], check=check, timeout=timeout,
                                input=input)

    def run(self, *argv: str, properties: Mapping[str, str] | None = None,
            env: Mapping[str, str] | None = None, check: bool = True,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Run argv inside as a transient service of the container's PID 1.

        It gets its own cgroup and journal stream like any real service;
        stdout/stderr are piped back (systemd-run --pipe --wait).
        """
        opts: list[str] = []
        for key, value in (properties or {}).items():
            opts += ["-p", f"{key}={value}"]
        for key, value in (env or {}).items():
            opts += ["-E", f"{key}={value}"]
        return self._run_script(["run", self.name, *opts, *argv], check=check,
                                timeout=timeout)

    def shell(self, script: str, check: bool = True) -> str:
        return self.exec("bash", "-c", script, check=check).stdout

    # -- reaching in from the host ------------------------------------------------

    @property
    def leader(self) -> int:
        """PID (in the host's PID namespace) of the container's systemd."""
        return int(self._script("leader", self.name).strip())

    def host_path(self, inside: str) -> Path:
        """A path inside the container as the host can open it right now."""
        if not inside.startswith("/"):
            raise ValueError("inside path must be absolute")
        return Path(f"/proc/{self.leader}/root{inside}")

    @property
    def bus_address(self) -> str:
        """The container's system bus, as a D-Bus address usable from the host."""
        return f"unix:path={self.host_path('/run/dbus/system_bus_socket')}"

    @property
    def state_dir(self) -> Path:
        return self.state_root / self.name

    # -- plumbing --------------------------------------------------------------

    def _script(self, *args: str, timeout: float = 60) -> str:
        return self._run_script(list(args), check=True, timeout=timeout).stdout

    def _run_script(self, args: Sequence[str], *, check: bool, timeout: float,
                    input: str | None = None) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(["bash", str(SCRIPT), *args], env=self._env, text=True,
                                  capture_output=True, timeout=timeout, input=input,
                                  stdin=None if input is not None else subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise ContainerError(f"{shlex.join(args)}: no answer in {timeout}s") from e
        if check and proc.returncode != 0:
            raise ContainerError(
                f"{shlex.join(args)} exited {proc.returncode}:\n{proc.stderr.strip()}\n"
                f"{proc.stdout.strip()}".strip())
        return proc
