"""The admin API's unix socket, and who is at the other end of a connection to it.

The gateway binds it itself (mode 0660; its group the admin group when one is
configured) under its runtime directory: systemd's $RUNTIME_DIRECTORY
(/run/llm-gateway for the packaged service), else $XDG_RUNTIME_DIR/llm-gateway,
else /run/llm-gateway. File permissions keep strangers from connecting; each
request is checked again by the peer's credentials (SO_PEERCRED): root, the
gateway's own user, or a member of the admin group (`[admin] group`; else the
gateway's own group, which the socket file belongs to). The peer's supplementary
groups are the kernel's record from connect() (SO_PEERGROUPS), not
/proc/<pid>/status read later: by then the pid may be another process's. The CLI talks to it by
default, so it needs neither the configuration file nor a key.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

SOCKET_NAME = "admin.sock"
_PEERCRED = struct.Struct("3i")   # struct ucred: pid, uid, gid
# Linux's SO_PEERGROUPS (4.13; Python has no constant for it): the peer's supplementary
# groups as they were at connect(). 59 on every architecture but alpha/mips/parisc/sparc.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_GID = 4                          # bytes per gid_t
_GROUPS_FIRST_TRY = 64            # most users have a handful of groups
_NGROUPS_MAX = 65536              # the kernel's limit: the buffer that always fits


def default_path() -> Path:
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime:
        return Path(runtime) / SOCKET_NAME
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "llm-gateway" / SOCKET_NAME
    return Path("/run/llm-gateway") / SOCKET_NAME


def candidate_paths() -> list[Path]:
    """Where a CLI looks for a gateway's admin socket, the system service's first."""
    paths = [Path("/run/llm-gateway") / SOCKET_NAME]
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        paths.append(Path(xdg) / "llm-gateway" / SOCKET_NAME)
    return paths


class AdminSocketInUse(OSError):
    pass


def group_id(name: str | None) -> int | None:
    """The admin group's id; KeyError names an unknown group."""
    return None if name is None else grp.getgrnam(name).gr_gid


def bind(path: Path, group: str | None) -> socket.socket:
    """A listening socket at path (mode 0660, group: the admin group). A socket file left
    by a gateway that is gone is replaced; one a running gateway answers on is not."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()   # nobody listens: a leftover
            else:
                raise AdminSocketInUse(f"another gateway answers on {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o660)
        if (gid := group_id(group)) is not None:
            os.chown(path, -1, gid)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    return sock


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of an admin-socket connection (SO_PEERCRED and groups)."""
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


def peer_of(sock: socket.socket) -> Peer | None:
    """Who connected, in the kernel's words: SO_PEERCRED, and SO_PEERGROUPS for the
    supplementary groups. Both were recorded when the peer connected, so a peer that
    has exited (its pid reused) or changed its groups since changes nothing. None:
    unknown, which admits nobody."""
    try:
        pid, uid, gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        groups = peer_groups(sock)
    except OSError:
        return None
    return Peer(pid, uid, gid, groups)


def peer_groups(sock: socket.socket) -> frozenset[int]:
    """The peer's supplementary groups at connect() (SO_PEERGROUPS); OSError if the
    kernel cannot say (then the peer is unknown: refused, never guessed from /proc)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GID * _GROUPS_FIRST_TRY)
    except OSError as e:
        if e.errno != errno.ERANGE:   # ERANGE: more groups than the buffer holds
            raise
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GID * _NGROUPS_MAX)
    return frozenset(struct.unpack(f"{len(raw) // _GID}I", raw[:len(raw) // _GID * _GID]))


def may_administer(peer: Peer | None, own_uid: int, admin_gid: int | None) -> bool:
    if peer is None:
        return False
    if peer.uid in (0, own_uid):
        return True
    return admin_gid is not None and (peer.gid == admin_gid or admin_gid in peer.groups)
