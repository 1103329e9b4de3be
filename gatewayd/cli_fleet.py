"""`llm-gateway endpoints`: the endpoints file of llm-d's router (its endpoint picker's
`file-discovery` plugin) for a fleet of gateways, so that a picker run without Kubernetes
finds them and reads each one's figures as the engine type `llm-gateway` (docs/fleet.md
has the picker's configuration for that type).

The file's format, as llm-d's file-discovery plugin reads it: `endpoints:`, each with a
unique `name`, `address` (an IPv4 literal: the plugin resolves no host names), `port` (a
string) and `labels`. The picker scrapes each endpoint's metrics at the same address and
port, so each gateway must serve them there keyless: `[admin] public_metrics = true`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"   # the label the picker's metrics mapping reads
ENGINE_TYPE = "llm-gateway"
DEFAULT_PORT = 8080                          # [listen] port's default
METRICS_PATH = "/admin/metrics"
PROBE_TIMEOUT_S = 3.0


class EndpointError(Exception):
    """A host the endpoints file cannot name."""


@dataclass(frozen=True)
class Endpoint:
    name: str
    address: str      # IPv4
    port: int
    given: str        # as the operator wrote it


Resolve = Callable[[str], str]


def resolve_ipv4(host: str) -> str:
    """host's IPv4 address (llm-d's file takes no names, nor IPv6)."""
    import socket  # (this module's imports stay off `serve`'s start: cli imports it)

    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as e:   # (IDNA: "a..b", a 64-letter label)
        raise EndpointError(f"{host!r}: no IPv4 address ({e})") from None
    return str(infos[0][4][0])


def endpoint_of(given: str, resolve: Resolve = resolve_ipv4) -> Endpoint:
    """One HOST[:PORT] as an endpoint; EndpointError says what is wrong with it."""
    import ipaddress

    text = given.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or "]" in port_text or (text.count(":") > 1 and not text.startswith("[")):
        host, port_text = text, str(DEFAULT_PORT)   # no port ("[v6]", a bare v6)
    host = host.strip("[]")
    if not host:
        raise EndpointError(f"{given!r}: no host")
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise EndpointError(f"{given!r}: the port must be 1-65535")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        address = resolve(host)
    else:
        if ip.version != 4:
            raise EndpointError(f"{given!r}: llm-d's file discovery takes IPv4 addresses only")
        address = str(ip)
    slug = re.sub(r"[^a-z0-9]+", "-", host.lower()).strip("-") or "gateway"
    return Endpoint(f"{slug}-{port_text}", address, int(port_text), text)


def endpoints_file(endpoints: list[Endpoint]) -> dict[str, Any]:
    """The file's content; EndpointError where two name one address and port (the
    picker would count one gateway twice)."""
    seen: dict[tuple[str, int], str] = {}
    for e in endpoints:
        if (e.address, e.port) in seen:
            raise EndpointError(f"{e.given!r} and {seen[e.address, e.port]!r} are the same "
                                f"gateway ({e.address}:{e.port})")
        seen[e.address, e.port] = e.given
    taken: set[str] = set()
    out = []
    for e in endpoints:
        name, n = e.name, 1
        while name in taken:   # ("a.b:8080" and "a-b:8080" make one name)
            n += 1
            name = f"{e.name}-{n}"
        taken.add(name)
        out.append({"name": name, "address": e.address, "port": str(e.port),
                    "labels": {ENGINE_TYPE_LABEL: ENGINE_TYPE}})
    return {"endpoints": out}


def as_yaml(content: dict[str, Any]) -> str:
    """The file as YAML: block style, every scalar a JSON string (which YAML reads as
    the same string), so no value needs YAML's quoting rules."""
    lines = ["# llm-d file-discovery endpoints (llm-gateway endpoints)", "endpoints:"]
    for e in content["endpoints"]:
        lines += [f"  - name: {json.dumps(e['name'])}",
                  f"    address: {json.dumps(e['address'])}",
                  f"    port: {json.dumps(e['port'])}",
                  "    labels:"]
        lines += [f"      {json.dumps(k)}: {json.dumps(v)}" for k, v in e["labels"].items()]
    return "\n".join(lines) + "\n"


def metrics_answer(e: Endpoint) -> str | None:
    """None where the gateway serves its metrics keyless at the endpoint; else why not."""
    import http.client
    import urllib.error
    import urllib.request

    url = f"http://{e.address}:{e.port}{METRICS_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as resp:
            resp.read(1)
            return None
    except urllib.error.HTTPError as err:
        why = "turn on [admin] public_metrics" if err.code in (401, 403, 404) else ""
        return f"{url} answered {err.code}" + (f": {why}" if why else "")
    except (OSError, http.client.HTTPException) as err:   # (a port that speaks no HTTP)
        return f"{url}: {getattr(err, 'reason', None) or err!r}"


def run_endpoints(args: argparse.Namespace, out: TextIO = sys.stdout,
                  err: TextIO = sys.stderr, resolve: Resolve = resolve_ipv4,
                  probe: Callable[[Endpoint], str | None] = metrics_answer) -> int:
    """Print the file (YAML, or JSON with --json); 1 with the reason where a host cannot
    be named. Gateways whose metrics the picker could not read are named on stderr."""
    try:
        endpoints = [endpoint_of(h, resolve) for h in args.hosts]
        content = endpoints_file(endpoints)
    except EndpointError as refused:
        print(f"llm-gateway: {refused}", file=err)
        return 1
    if not args.no_check:
        for endpoint in endpoints:
            if (why := probe(endpoint)) is not None:
                print(f"llm-gateway: warning: {endpoint.given}: the picker reads its metrics "
                      f"at {METRICS_PATH}, and {why}", file=err)
    out.write(json.dumps(content, indent=2) + "\n" if args.json else as_yaml(content))
    return 0
