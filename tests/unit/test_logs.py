"""Reading journals, the pure part (core/logs): the gateway's own unit from its cgroup,
a follow's line filter, and what a failed engine's last lines say."""

from __future__ import annotations

import pytest

from gatewayd.core.logs import OwnUnit, failure_cause, line_filter, unit_of_cgroup


@pytest.mark.parametrize("text,unit", [
    # cgroup v2, a system service
    ("0::/system.slice/llm-gateway.service\n", OwnUnit("llm-gateway.service", "system")),
    # a transient unit (systemd-run), as the container tests run the gateway
    ("0::/system.slice/llm-gateway-test-18300.service\n",
     OwnUnit("llm-gateway-test-18300.service", "system")),
    # a template instance, and a service with cgroups of its own below it (Delegate=)
    ("0::/system.slice/system-llm\\x2dgw.slice/llm-gw@a.service\n",
     OwnUnit("llm-gw@a.service", "system")),
    ("0::/system.slice/llm-gateway.service/payload\n", OwnUnit("llm-gateway.service", "system")),
    # a user manager's service: journalctl --user-unit
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/llm-gateway.service\n",
     OwnUnit("llm-gateway.service", "user")),
    # a terminal in a session, or one of a user manager's apps: a scope is no service, and
    # the user manager's own service above it is not ours
    ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/app-term-1.scope\n", None),
    ("0::/user.slice/user-1000.slice/user@1000.service/init.scope\n", None),
    ("0::/\n", None),       # a container's root, no systemd
    ("", None),
    # cgroup v1 (and hybrid: the unified line wins)
    ("12:memory:/system.slice/x.service\n1:name=systemd:/system.slice/llm-gateway.service\n",
     OwnUnit("llm-gateway.service", "system")),
    ("1:name=systemd:/system.slice/old.service\n0::/system.slice/new.service\n",
     OwnUnit("new.service", "system")),
    # systemd's escape of a name that could be mistaken for a kernel file
    ("0::/system.slice/_cpu.service\n", OwnUnit("cpu.service", "system")),
])
def test_the_unit_from_the_cgroup(text: str, unit: OwnUnit | None) -> None:
    assert unit_of_cgroup(text) == unit


def test_grep_is_plain_text_in_any_case() -> None:
    lines = ["2024-01-01T00:00:00 srv ERROR: out of memory", "srv: loaded [model].gguf",
             "srv: all good", "srv: Error 12", "ünïcode ÉRROR"]
    assert [x for x in lines if line_filter("error")(x)] == [lines[0], lines[3]]
    assert [x for x in lines if line_filter("[model].")(x)] == [lines[1]]   # not a pattern
    assert [x for x in lines if line_filter("érror")(x)] == [lines[4]]
    assert [x for x in lines if line_filter(None)(x)] == lines
    assert [x for x in lines if line_filter("")(x)] == lines


@pytest.mark.parametrize("lines,exit_code,code", [
    # the launcher's own words: a server on the wrong port (its exit 78, not restarted)
    (["engine_launch: fake listens on TCP port 9999, not on 8080, the port its command's "
      "{port} says; it cannot be reached. Pass {port} where the server takes its port (and "
      "127.0.0.1 or 0.0.0.0 as its host)"], 78, "wrong_port"),
    (["engine_launch: loopback is down in this engine's private network namespace: ..."],
     78, "no_loopback"),
    # llama-server (the build scripts/get_llama_server.sh makes)
    (["error while handling argument \"--no-mmap\": error: invalid argument: --no-mmap"],
     1, "bad_argument"),
    (["llama_model_load: error loading model: tensor 'x' data is not within the file bounds",
      "srv    load_model: failed to load model, '/models/broken.gguf'"], 1, "model_load"),
    (["ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9000.00 MiB on device 0: "
      "cudaMalloc failed: out of memory", "llama_model_load: error loading model: ..."],
     1, "gpu_out_of_memory"),
    (["srv    start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080"],
     1, "address_in_use"),
    (["ModuleNotFoundError: No module named 'vllm'"], 1, "missing_module"),
    # systemd's own status: the server never ran, whatever its lines say
    (["llm-engine-x.service: Failed at step EXEC spawning /opt/srv: No such file"], 203,
     "systemd_exec"),
    (["a server that says nothing we know"], 1, None),
    ([], None, None),
])
def test_a_failed_engines_lines_say_a_cause_in_a_fixed_sentence(
        lines: list[str], exit_code: int | None, code: str | None) -> None:
    cause = failure_cause(lines, exit_code)
    assert (cause and cause.code) == code
    if cause is not None:   # never the lines' own words: the caller is told this
        assert not any(word in cause.text for word in ("9999", "/models", "vllm", "/opt"))
