"""Whether a request comes from this gateway's own world: its Host and its Origin. Pure.

A web page the user has open can send requests to 127.0.0.1:8080 (a CORS "simple"
POST needs no preflight) and, through DNS rebinding (its own name made to resolve to
127.0.0.1), read the answers too. Neither needs a key when keys are off, the default on
loopback. So, before anything else runs:

- the Host header must name this gateway: a loopback name or address ("localhost",
  "*.localhost", 127.0.0.0/8, ::1), the address the client connected to, this
  machine's host name, or one of `[listen] allowed_hosts`; a rebinding page's own
  name is none of these (421);
- a request that carries an Origin (browsers send it on every cross-origin request
  and on every POST) must come from the gateway's own origin (the status page) or
  one of `[listen] allowed_origins` (403).

curl, the SDKs and scripts send a Host of the address they were given and no
Origin: they pass with no configuration.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Collection
from dataclasses import dataclass

ANY = "*"


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port, lower case, no trailing dot;
    an IPv6 address keeps its brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[:end + 1] if end != -1 else host
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit():
        host = name
    return host.rstrip(".")


@functools.lru_cache(maxsize=256)   # parsing an address: most of a request's Host check
def is_loopback_name(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True      # RFC 6761: always loopback; browsers resolve it so themselves
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class BrowserPolicy:
    """Which Host names and web origins may reach the gateway."""
    allowed_hosts: frozenset[str] = frozenset()     # besides loopback and own_names
    allowed_origins: frozenset[str] = frozenset()   # besides the gateway's own
    own_names: frozenset[str] = frozenset()         # this machine's host name(s)

    @classmethod
    def of(cls, hosts: Collection[str], origins: Collection[str],
           own_names: Collection[str] = ()) -> BrowserPolicy:
        return cls(frozenset(h.lower() for h in hosts),
                   frozenset(o.lower().rstrip("/") for o in origins),
                   frozenset(n.lower().rstrip(".") for n in own_names if n))

    def host_allowed(self, host_header: str | None, local_address: str | None) -> bool:
        """local_address: the address the client connected to (None: not TCP)."""
        if host_header is None:
            return True     # HTTP/1.0 clients; every browser sends a Host
        host = host_name(host_header)
        if ANY in self.allowed_hosts or is_loopback_name(host) or host in self.allowed_hosts \
                or host in self.own_names:
            return True
        if local_address is None:
            return False
        local = local_address.lower().split("%", 1)[0]
        return host.strip("[]") == local

    def origin_allowed(self, origin: str, host_header: str | None) -> tuple[bool, bool]:
        """(allowed, cross-origin): the gateway's own origin is allowed and not cross."""
        origin = origin.strip().lower().rstrip("/")
        scheme, sep, authority = origin.partition("://")
        if sep and scheme in ("http", "https") and host_header is not None \
                and authority == host_header.strip().lower():
            return True, False     # the status page, served by this gateway
        if ANY in self.allowed_origins or origin in self.allowed_origins:
            return True, True
        return False, True
