"""`llm-gateway endpoints`: llm-d's file-discovery endpoints file for a fleet, as that
plugin reads it (YAML, IPv4 literals, string ports, a unique name each), and a warning for
a gateway whose metrics a picker could not read."""

from __future__ import annotations

import http.server
import io
import json
import socket
import threading
from collections.abc import Iterator

import pytest
import yaml

from gatewayd.cli import build_parser
from gatewayd.cli_fleet import (
    METRICS_PATH,
    Endpoint,
    EndpointError,
    endpoint_of,
    metrics_answer,
    resolve_ipv4,
    run_endpoints,
)

HOSTS = {"gpu1.lan": "10.0.0.1", "gpu2.lan": "10.0.0.2"}


def resolve(host: str) -> str:
    if host not in HOSTS:
        raise EndpointError(f"{host!r}: no IPv4 address")
    return HOSTS[host]


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["endpoints", "--no-check", *argv]
                                     if "--json" not in argv else
                                     ["--json", "endpoints", "--no-check",
                                      *(a for a in argv if a != "--json")])
    rc = run_endpoints(args, out, err, resolve=resolve)
    return rc, out.getvalue(), err.getvalue()


def test_the_file_is_the_yaml_llm_d_reads_one_entry_per_gateway() -> None:
    rc, out, err = run("gpu1.lan", "gpu2.lan:8081", "10.0.0.3:9000")
    assert (rc, err) == (0, "")
    assert yaml.safe_load(out) == {"endpoints": [
        {"name": "gpu1-lan-8080", "address": "10.0.0.1", "port": "8080",
         "labels": {"llm-d.ai/engine-type": "llm-gateway"}},
        {"name": "gpu2-lan-8081", "address": "10.0.0.2", "port": "8081",
         "labels": {"llm-d.ai/engine-type": "llm-gateway"}},
        {"name": "10-0-0-3-9000", "address": "10.0.0.3", "port": "9000",
         "labels": {"llm-d.ai/engine-type": "llm-gateway"}}]}
    rc, as_json, _ = run("--json", "gpu1.lan", "gpu2.lan:8081", "10.0.0.3:9000")
    assert rc == 0 and json.loads(as_json) == yaml.safe_load(out)


@pytest.mark.parametrize("given, why", [
    ("::1", "IPv4 addresses only"), ("[fe80::1]:8080", "IPv4 addresses only"),
    ("gpu1.lan:0", "1-65535"), ("gpu1.lan:70000", "1-65535"), ("gpu1.lan:http", "1-65535"),
    ("gpu1.lan:\u00b2", "1-65535"), ("gpu1.lan:\uff18\uff10", "1-65535"),
    (":8080", "no host"), ("nowhere.lan", "no IPv4 address")])
def test_a_host_the_file_cannot_name_is_refused_saying_why(given: str, why: str) -> None:
    with pytest.raises(EndpointError, match=why):
        endpoint_of(given, resolve)
    rc, out, err = run("gpu1.lan", given)
    assert rc == 1 and out == "" and why in err


def test_one_gateway_named_twice_is_refused_and_like_names_are_made_unique(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rc, _, err = run("gpu1.lan", "10.0.0.1:8080")
    assert rc == 1 and "same gateway (10.0.0.1:8080)" in err
    monkeypatch.setitem(HOSTS, "10-0-0-1", "10.0.0.9")   # a host name like an address
    rc, out, _ = run("10.0.0.1:8080", "10-0-0-1:8080")
    names = [e["name"] for e in yaml.safe_load(out)["endpoints"]]
    assert rc == 0 and names == ["10-0-0-1-8080", "10-0-0-1-8080-2"]
    monkeypatch.setitem(HOSTS, "a.b", "10.0.0.5")
    monkeypatch.setitem(HOSTS, "a-b", "10.0.0.6")
    monkeypatch.setitem(HOSTS, "a-b-8080", "10.0.0.7")
    rc, out, _ = run("a.b:8080", "a-b:8080", "a-b-8080:2")
    names = [e["name"] for e in yaml.safe_load(out)["endpoints"]]
    assert rc == 0 and len(set(names)) == 3, names


@pytest.mark.parametrize("host", ["a..b", "x" * 64 + ".lan"])
def test_a_name_idna_refuses_is_a_clear_refusal(host: str) -> None:
    with pytest.raises(EndpointError, match="no IPv4 address"):
        resolve_ipv4(host)


def test_a_port_that_speaks_no_http_is_named_and_the_file_written() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def ssh() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
                conn.recv(4096)
        threading.Thread(target=ssh, daemon=True).start()
        why = metrics_answer(Endpoint("x", "127.0.0.1", port, f"127.0.0.1:{port}"))
    assert why is not None and METRICS_PATH in why


@pytest.fixture
def answering() -> Iterator[dict[str, int]]:
    """A local HTTP server answering each GET with the status asked for."""
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status["code"])
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    status["port"] = server.server_address[1]
    yield status
    server.shutdown()
    server.server_close()


def test_a_gateway_whose_metrics_a_picker_cannot_read_is_named(
        answering: dict[str, int]) -> None:
    e = Endpoint("x", "127.0.0.1", answering["port"], f"127.0.0.1:{answering['port']}")
    assert metrics_answer(e) is None
    answering["code"] = 403
    assert "public_metrics" in (metrics_answer(e) or "")
    args = build_parser().parse_args(["endpoints", e.given])
    out, err = io.StringIO(), io.StringIO()
    assert run_endpoints(args, out, err) == 0   # the file all the same: hosts may be down
    assert "warning" in err.getvalue() and "403" in err.getvalue()
    assert yaml.safe_load(out.getvalue())["endpoints"][0]["port"] == str(e.port)
