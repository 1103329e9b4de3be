"""Runs a TCP-only engine (whisper-server, an openai server told {port}) so that only a
unix socket reaches it.

    python -m gatewayd.engine_launch --socket /run/llm-engine-x/engine.sock \
        --port 8080 -- whisper-server ... --port {port} ...

This is the main process of a TCP engine's unit. The unit has
PrivateNetwork=yes, so whisper-server listens on 127.0.0.1:8080 in a network
namespace of its own (every whisper engine can use 8080, and nothing outside
the unit can reach it), and systemd-socket-proxyd, handed the unix socket by
the socket-activation protocol, relays to it: the systemd-socket-proxyd(8)
pattern, in one unit. Unix sockets are reached by
path, across network namespaces.

Where the namespace is not private (PrivateNetwork unavailable), a free
loopback port is chosen under a lock and checked after start: whisper-server
sets SO_REUSEPORT, so a port cannot be reserved by bind-close-pass, and two
servers on one port would split its connections. Either way the gateway only
ever talks to the unix socket.

If either process dies, the other is stopped and the launcher exits non-zero,
so systemd's Restart= policy applies to the pair.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

PROXYD_CANDIDATES = ("/lib/systemd/systemd-socket-proxyd", "/usr/lib/systemd/systemd-socket-proxyd")
FALLBACK_PORTS = range(39000, 40000)
EX_CONFIG = 78


def has_private_network() -> bool:
    """True when this process does not share the system's network namespace."""
    try:
        return os.stat("/proc/self/ns/net").st_ino != os.stat("/proc/1/ns/net").st_ino
    except OSError:
        # not root (PID 1's namespace is not ours to look at), or PID 1 hidden
        # (ProtectProc=invisible): a systemd private namespace has only lo. Read from
        # /proc/net/dev, this namespace's interfaces: no socket needed, so a sandbox
        # with RestrictAddressFamilies= (no AF_NETLINK) can tell too
        return interfaces() == ["lo"]


def interfaces(dev: str = "/proc/net/dev") -> list[str]:
    """The network interfaces of this namespace."""
    try:
        lines = Path(dev).read_text().splitlines()[2:]   # two header lines
    except OSError:
        return []
    return [line.split(":", 1)[0].strip() for line in lines if ":" in line]


def loopback_works() -> bool:
    """Whether 127.0.0.1 can be listened on and connected to in this namespace."""
    try:
        with socket.socket() as server, socket.socket() as client:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            client.settimeout(2)
            client.connect(server.getsockname())
        return True
    except OSError:
        return False


def listening_tcp(port: int) -> set[str]:
    """Inodes of sockets listening on a loopback/any TCP port in this namespace."""
    return {inode for listened, inode in listeners() if listened == port}


def listeners() -> list[tuple[int, str]]:
    """(port, socket inode) of every listening TCP socket in this namespace."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    found.append((int(fields[1].rsplit(":", 1)[1], 16), fields[9]))
    return found


WRONG_PORT_GRACE_S = 5.0


def await_listener(server: subprocess.Popen[bytes], port: int, *,
                   grace_s: float = WRONG_PORT_GRACE_S, every_s: float = 0.05,
                   timeout_s: float = 3600) -> str | None:
    """Until the server listens on port in this private network namespace, or exits.
    Until then the unix socket is not bound: the gateway's readiness looks find no socket
    (instead of a proxy that logs each refused connection, which filled the engine's
    journal, and so its failure's log tail, while it loaded). Every listener here is the
    server's: one that listens on other ports and, grace_s later, still not on ours was
    not told {port} (or ignores it): the reason is returned, where the gateway would
    otherwise wait out its load timeout on an engine that can never answer."""
    since: float | None = None
    began = time.monotonic()
    while server.poll() is None and time.monotonic() - began < timeout_s:
        ports = {listened for listened, _ in listeners()}
        if port in ports:
            return None
        if ports and since is None:
            since = time.monotonic()
        if since is not None and time.monotonic() - since >= grace_s:
            return wrong_port(server, ports, port)
        # often while a small model loads, seldom through a big one's minutes
        time.sleep(min(every_s * (1 + time.monotonic() - began), 0.5))
    return None


def wrong_port(server: subprocess.Popen[bytes], ports: set[int], port: int) -> str:
    """What the launcher says of a server that listens on ports, not on port."""
    others = ", ".join(str(p) for p in sorted(ports))
    name = os.path.basename(str(server.args[0]))   # type: ignore[index]
    return (f"engine_launch: {name} listens on TCP port {others}, not on {port}, "
            "the port its command's {port} says; it cannot be reached. Pass {port} "
            "where the server takes its port (and 127.0.0.1 or 0.0.0.0 as its host)")


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


@contextlib.contextmanager
def port_lock(socket_path: str) -> Iterator[None]:
    """Serialises fallback port choice between engines started at the same time."""
    lock = Path(socket_path).parent.parent / "llm-engine-ports.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def choose_fallback_port(socket_path: str) -> int:
    start = zlib.crc32(socket_path.encode()) % len(FALLBACK_PORTS)
    for i in range(len(FALLBACK_PORTS)):
        port = FALLBACK_PORTS[(start + i) % len(FALLBACK_PORTS)]
        if not listening_tcp(port):
            return port
    raise SystemExit("engine_launch: no free loopback port in "
                     f"{FALLBACK_PORTS.start}-{FALLBACK_PORTS.stop - 1}")


def wait_exclusive_listener(server: subprocess.Popen[bytes], port: int,
                            timeout: float = 600, *,
                            grace_s: float = WRONG_PORT_GRACE_S) -> str | None:
    """Until the server listens on port; fail if anyone else listens there too. In the
    host's namespace other listeners are not the server's: its own sockets (its main
    process's) that listen on other ports and, grace_s later, still not on ours say it
    was not told {port}, as await_listener says it in a private namespace: the reason is
    returned (a server whose listening is done by a child process is not seen here)."""
    deadline = time.monotonic() + timeout
    since: float | None = None
    while time.monotonic() < deadline and server.poll() is None:
        listeners = listening_tcp(port)
        mine = socket_inodes(server.pid)
        if listeners:
            ours = listeners & mine
            if ours and ours != listeners:
                raise SystemExit(f"engine_launch: another process also listens on port {port}")
            if ours:
                return None
        elsewhere = {listened for listened, inode in listeners_of(mine) if listened != port}
        if elsewhere and since is None:
            since = time.monotonic()
        if since is not None and time.monotonic() - since >= grace_s:
            return wrong_port(server, elsewhere, port)
        time.sleep(0.05)
    return None


def listeners_of(inodes: set[str]) -> list[tuple[int, str]]:
    """The listening TCP sockets among these socket inodes: (port, inode)."""
    return [(port, inode) for port, inode in listeners() if inode in inodes] if inodes else []


def proxyd() -> str:
    for path in PROXYD_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    raise SystemExit("engine_launch: systemd-socket-proxyd not found (package systemd)")


def run(socket_path: str, port: int, server_argv: Sequence[str]) -> int:
    # the unix socket's mode comes from the unit's UMask=: srwx------ for a transient
    # unit (a root gateway), srwxrwx--- for llm-engine@ (the gateway is in its group)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)  # a stale socket would make the bind fail
    private = has_private_network()
    children: list[subprocess.Popen[bytes]] = []

    def stop_children(*_: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.terminate()

    def on_sigterm(*_: object) -> None:
        stop_children()
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=10)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    if private and not loopback_works():
        print("engine_launch: loopback is down in this engine's private network namespace: "
              "systemd could not bring it up (PID 1 lacks CAP_NET_ADMIN, e.g. a container "
              "sharing the host's network). The gateway's transient units fall back to a "
              "loopback port by themselves; for llm-engine@ units add a drop-in with "
              "PrivateNetwork=no.", flush=True)
        return EX_CONFIG
    with port_lock(socket_path) if not private else contextlib.nullcontext():
        if not private:
            port = choose_fallback_port(socket_path)
            print(f"engine_launch: no private network namespace; using 127.0.0.1:{port} "
                  "of the host's network, where any local user can reach the server",
                  flush=True)
        argv = [a.replace("{port}", str(port)) for a in server_argv]
        # an openai model's env values may say {port} too
        env = {k: v.replace("{port}", str(port)) for k, v in os.environ.items()}
        # restore_signals=False: SIGPIPE stays ignored, as systemd starts services; with
        # Python's default the children got it back, and systemd-socket-proxyd died of it
        # when a client closed early, taking the engine down (seen in CI)
        server = subprocess.Popen(argv, env=env, restore_signals=False)
        children.append(server)
        wrong = wait_exclusive_listener(server, port) if not private else None
    if private:
        wrong = await_listener(server, port)
    if wrong is not None:
        print(wrong, flush=True)
        stop_children()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=10)
        return EX_CONFIG
    if server.poll() is not None:
        code = server.returncode
        print(f"engine_launch: {os.path.basename(argv[0])} exited ({code}) before it "
              f"listened on port {port}", flush=True)
        return code if code > 0 else 1
    # Bound here, under the unit's UMask=, and handed to systemd-socket-proxyd
    # as fd 3 by the socket-activation protocol (LISTEN_FDS/LISTEN_PID).
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(128)
    fd = listener.fileno()
    proxy = subprocess.Popen(
        ["/bin/sh", "-c", f'export LISTEN_FDS=1 LISTEN_PID=$$; exec "$0" "$@" 3<&{fd}',
         proxyd(), f"127.0.0.1:{port}"], pass_fds=(fd,), restore_signals=False)
    listener.close()
    children.append(proxy)
    pid, status = os.wait()
    stop_children()
    for child in children:
        with contextlib.suppress(ChildProcessError):
            child.wait(timeout=10)
    name = os.path.basename(argv[0]) if pid == server.pid else "systemd-socket-proxyd"
    code = os.waitstatus_to_exitcode(status)
    print(f"engine_launch: {name} exited ({code}); stopping the engine", flush=True)
    return code if code > 0 else 1


def run_settings(path: str) -> int:
    """Template mode: llm-engine@.service runs this with the settings file the gateway wrote
    (a copy systemd hands over as a credential: the engine's user cannot read the gateway's
    state directory).

    {"backend": "llama"|"whisper"|"openai", "tcp": bool, "argv": [...], "socket": "...",
     "env": {...}}
    A unix-socket engine is exec'd (its process becomes the unit's main process); a TCP
    one ("tcp", or whisper in settings written before "tcp" was) gets the unix-socket
    arrangement above.
    """
    try:
        settings = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        print(f"engine_launch: cannot read the engine settings {path}: {e}", flush=True)
        return 2
    os.environ.update(settings.get("env", {}))
    argv = [str(a) for a in settings["argv"]]
    if settings.get("tcp", settings.get("backend") == "whisper"):
        return run(settings["socket"], int(settings.get("port", 8080)), argv)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(settings["socket"])   # a server refuses to start on a stale socket
    os.execv(argv[0], argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gatewayd.engine_launch")
    parser.add_argument("--settings", help="template mode: the engine's settings file")
    parser.add_argument("--socket")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("server", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.settings:
        return run_settings(args.settings)
    server = args.server[1:] if args.server[:1] == ["--"] else args.server
    if not server or not args.socket:
        parser.error("give --settings FILE, or --socket PATH -- SERVER ARGV")
    return run(args.socket, args.port, server)


if __name__ == "__main__":
    sys.exit(main())
