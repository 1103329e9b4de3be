"""backend = "openai" for real: a second engine that is not llama-server.

llama-cpp-python's OpenAI server (built from its sdist by scripts/get_llama_cpp_python.sh)
serves a generated GGUF model as a generic engine, inside the test container's systemd:
over TCP in its unit's own network namespace behind the launcher's socket proxy, and on a
unix socket (uvicorn's --uds). Both SDKs, eviction against a llama engine, a crash
mid-stream, systemd's restart, adoption after a gateway restart, a reload, and the clear
errors of a server that is missing, dies at once, listens on the wrong port or never
becomes ready.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import GatewayService, tcp_listeners, toml_str
from tests.integration.test_front_door_e2e import client, records

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

# a server that answers on the unix socket only once its model is loaded (create_app
# loads it before uvicorn listens), so its first /v1/models answer is its readiness
TCP_MODEL = """
[models.lcpp]
backend = "openai"
path = {path}
command = [{python}, "-m", "llama_cpp.server", "--model", "{{model_path}}",
           "--model_alias", "{{model}}", "--host", "127.0.0.1", "--port", "{{port}}",
           "--n_ctx", "512", "--n_threads", "1"{extra}]
ram_mib = 400
"""
UDS_MODEL = """
[models.lcpp-uds]
backend = "openai"
path = {path}
command = [{python}, "-m", "uvicorn", "--factory", "--uds", "{{socket}}",
           "llama_cpp.server.app:create_app"]
env = {{ MODEL = "{{model_path}}", MODEL_ALIAS = "{{model}}", N_CTX = "512", N_THREADS = "1" }}
"""


def tcp_model(python: Path, model: Path, extra: str = "") -> str:
    return TCP_MODEL.format(path=toml_str(str(model)), python=toml_str(str(python)),
                            extra=extra)


def chat(gw: GatewayService, model: str, **kw: Any) -> Any:
    return client(gw).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=kw.pop(
            "max_tokens", 8), temperature=0, **kw)


def start(gw: GatewayService, model: str) -> dict[str, Any]:
    status, body = gw.api("POST", "/admin/engines/start", {"model": model})
    assert status == 200, body
    engine: dict[str, Any] = body["engine"]
    return engine


def test_llama_cpp_python_over_tcp_in_a_network_of_its_own(
        gateway_factory: GatewayFactory, llama_cpp_python: Path,
        tiny_models: dict[str, Path]) -> None:
    gw = gateway_factory(extra=tcp_model(llama_cpp_python, tiny_models["beta"]))
    listening = tcp_listeners()
    status, body = gw.api("GET", "/v1/models/lcpp")
    assert status == 200 and body["backend"] == "openai" and body["kind"] == "chat"
    assert body["ram_estimate_source"] == "declared" and body["ram_estimate_mib"] == 400
    engine = start(gw, "lcpp")
    assert engine["state"] == "ready"
    # its port is inside its unit's network namespace: nothing new listens here
    assert tcp_listeners() == listening
    assert os.readlink(f"/proc/{engine['pid']}/ns/net") != os.readlink("/proc/self/ns/net")
    with socket.socket() as probe:   # the port it was told, as seen from the host's side
        assert probe.connect_ex(("127.0.0.1", 8080)) != 0
    unit = engine["unit"]
    pids = subprocess.run(["systemctl", "show", "-p", "ControlGroup", "--value", unit],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert pids   # a cgroup of its own: systemd kills the whole of it at the stop

    plain = chat(gw, "lcpp")
    assert plain.choices[0].message.content is not None and plain.usage is not None
    assert plain.usage.completion_tokens > 0
    streamed = list(chat(gw, "lcpp", stream=True))
    assert streamed and any(c.choices and c.choices[0].delta.content for c in streamed)
    listed = {m.id for m in client(gw).models.list()}
    assert "lcpp" in listed
    # llama-cpp-python serves no Anthropic messages: its 404 reaches the SDK in
    # Anthropic's error shape, as a NotFoundError, not a crash or a hang
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0).messages.create(
            model="lcpp", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    rows = records(gw, 3, model="lcpp")
    by_stream = {r["stream"]: r for r in rows if r["endpoint"] == "/v1/chat/completions"}
    assert by_stream[0]["completion_tokens"] == plain.usage.completion_tokens
    assert all(r["bytes_out"] > 0 and r["latency_ms"] > 0 for r in by_stream.values())
    # a llama-server path is refused for it: it is not llama-server
    status, body = gw.api("GET", "/props?model=lcpp")
    assert status == 400 and "openai" in body["error"]["message"]


def test_llama_cpp_python_on_a_unix_socket_gets_no_network(
        gateway_factory: GatewayFactory, llama_cpp_python: Path,
        tiny_models: dict[str, Path]) -> None:
    gw = gateway_factory(extra=UDS_MODEL.format(path=toml_str(str(tiny_models["gamma"])),
                                                python=toml_str(str(llama_cpp_python))))
    listening = tcp_listeners()
    engine = start(gw, "lcpp-uds")
    # exec'd as the unit's main process, in the host's network namespace but with no
    # address family besides AF_UNIX
    assert Path(f"/proc/{engine['pid']}/exe").resolve().name.startswith("python")
    assert tcp_listeners() == listening
    families = subprocess.run(["systemctl", "show", "-p", "RestrictAddressFamilies",
                               "--value", engine["unit"]], capture_output=True, text=True,
                              check=True).stdout.split()
    assert families == ["AF_UNIX"]
    out = chat(gw, "lcpp-uds")
    assert out.usage is not None and out.usage.completion_tokens > 0
    assert [c for c in chat(gw, "lcpp-uds", stream=True) if c.choices]


def test_eviction_crash_restart_adoption_and_reload(
        gateway_factory: GatewayFactory, llama_cpp_python: Path,
        tiny_models: dict[str, Path]) -> None:
    gw = gateway_factory(extra=tcp_model(llama_cpp_python, tiny_models["beta"]),
                         max_engines=1)
    # eviction both ways against a llama engine: one place, each request takes it
    assert chat(gw, "lcpp").choices
    assert chat(gw, "tiny-alpha").choices
    assert set(gw.engines()) == {"tiny-alpha"}
    assert chat(gw, "lcpp").choices
    assert set(gw.engines()) == {"lcpp"}

    # a crash mid-stream: the stream ends with an error, systemd restarts the engine
    engine = gw.engines()["lcpp"]
    with pytest.raises(openai.APIError):
        for n, _ in enumerate(chat(gw, "lcpp", stream=True, max_tokens=400,
                                   extra_body={"ignore_eos": True})):
            if n == 2:
                os.kill(engine["pid"], signal.SIGKILL)
    restarted = gw.wait_engine("lcpp", lambda e: e["state"] == "ready" and e["restarts"] == 1,
                               timeout=60)
    assert restarted["pid"] != engine["pid"]
    assert chat(gw, "lcpp").choices
    failed = [r for r in records(gw, 1, model="lcpp") if r["outcome"] != "ok"]
    assert failed and failed[0]["status"] == 200   # the stream had begun

    # adoption: the engine outlives the gateway's restart, same process
    gw.stop()
    assert Path(f"/proc/{restarted['pid']}").exists()
    gw.start()
    adopted = gw.wait_engine("lcpp", lambda e: e["state"] == "ready", timeout=30)
    assert adopted["pid"] == restarted["pid"] and adopted["adopted"]
    assert chat(gw, "lcpp").choices

    # a reload that changes its command restarts it (another process), one that does not
    # keeps it
    text = gw.config.read_text()
    gw.config.write_text(text.replace('"--n_threads", "1"',
                                      '"--n_threads", "1", "--verbose", "false"'))
    status, body = gw.api("POST", "/admin/reload", {})
    assert status == 200, body
    reloaded = gw.wait_engine("lcpp", lambda e: e["state"] == "ready"
                              and e["pid"] != adopted["pid"], timeout=60)
    assert chat(gw, "lcpp").choices and reloaded["pid"] != adopted["pid"]


FAKE_SERVER = r"""
import http.server, json, os, sys, time
mode = sys.argv[1]
# "env": told its port only through the environment (llama-server's LLAMA_ARG_PORT)
port = int(os.environ["FAKE_PORT"] if sys.argv[2] == "env" else sys.argv[2])
if mode == "exit":
    print("fake server: cannot load the model", flush=True)
    sys.exit(3)
if mode == "wrong-port":
    port = 9999
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        status = 503 if mode == "never-ready" else 200
        body = json.dumps(dict(object="list", data=[])).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def fake_server_model(name: str, mode: str) -> str:
    return (f"[models.{name}]\nbackend = \"openai\"\n"
            f"command = [{toml_str(sys.executable)}, \"-c\", {toml_str(FAKE_SERVER)}, "
            f"\"{mode}\", \"{{port}}\"]\n")


def test_servers_that_fail_end_in_clear_errors_and_the_rest_keeps_serving(
        gateway_factory: GatewayFactory) -> None:
    extra = "".join(fake_server_model(f"fake-{mode}", mode)
                    for mode in ("exit", "wrong-port", "never-ready", "ok"))
    extra += ('[models.missing]\nbackend = "openai"\n'
              'command = ["/nonexistent/server", "--port", "{port}"]\n')
    extra += (f"[models.fake-env-port]\nbackend = \"openai\"\n"
              f"command = [{toml_str(sys.executable)}, \"-c\", {toml_str(FAKE_SERVER)}, "
              f"\"ok\", \"env\"]\nenv = {{ FAKE_PORT = \"{{port}}\" }}\n")
    gw = gateway_factory(extra=extra, load_timeout_s=8)

    def error_of(model: str) -> dict[str, Any]:
        # the admin API's start: its error holds the engine's last journal lines (an
        # inference caller is told where they are, not what they say)
        t0 = time.monotonic()
        status, body = gw.api("POST", "/admin/engines/start", {"model": model})
        assert status >= 400, body
        return {"status": status, "took": time.monotonic() - t0, **body["error"]}

    missing = error_of("missing")
    assert "/nonexistent/server" in missing["message"] and "models.missing.command" in \
        missing["message"]
    exited = error_of("fake-exit")
    assert exited["status"] == 502 and "journalctl -u" in exited["message"]
    assert "fake server: cannot load the model" in "\n".join(exited["failure"]["log_tail"])
    wrong = error_of("fake-wrong-port")
    assert "failure" in wrong, wrong
    assert "listens on TCP port 9999, not on 8080" in "\n".join(
        wrong["failure"]["log_tail"]), wrong
    assert wrong["took"] < 8    # said by the launcher, not found by the load timeout
    never = error_of("fake-never-ready")
    assert never["status"] == 502 and "load timeout" in never["message"], never
    status, body = gw.api("POST", "/v1/chat/completions", {
        "model": "fake-exit", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 502 and "journalctl -u" in body["error"]["message"]
    assert "log_tail" not in json.dumps(body)
    assert body["error"]["failure"]["cause"]["code"] == "model_load", body
    # the wrong port's cause reaches the inference caller too (not "exited with status 78")
    status, body = gw.api("POST", "/v1/chat/completions", {
        "model": "fake-wrong-port", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 502 and "another TCP port than the one its {port} says" in \
        body["error"]["message"], body
    assert "9999" not in json.dumps(body)   # the lines' words are the admin's
    for model in ("fake-exit", "fake-wrong-port", "fake-never-ready"):
        state = gw.engines().get(model, {}).get("state", "stopped")
        assert state in ("failed", "stopped"), (model, state)   # none stuck starting
    # the gateway serves every other model all along
    status, body = gw.api("GET", "/v1/models")
    assert status == 200 and "fake-ok" in {m["id"] for m in body["data"]}
    engine = start(gw, "fake-ok")
    assert engine["state"] == "ready"
    # {port} only in env: a TCP engine all the same (the literal "{port}" reached it)
    assert start(gw, "fake-env-port")["state"] == "ready"
