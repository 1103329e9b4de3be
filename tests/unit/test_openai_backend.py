"""backend = "openai": any OpenAI-compatible server run from the model's `command`.

Its configuration (placeholders, where it listens, kinds, readiness, declared memory),
its unit (a unix-socket server exec'd in the llama sandbox; a TCP one behind the
launcher in a network namespace of its own) and its memory need. Pure: no I/O.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gatewayd.core.budget import model_need
from gatewayd.core.catalog import Model, build_catalog, health_of
from gatewayd.core.config import Backend, ModelKind, fill, parse_config, placeholders
from gatewayd.core.engine_units import (
    EngineLayout,
    engine_fingerprint,
    listens_on_tcp,
    server_binary,
    template_settings,
    transient_spec,
)
from gatewayd.core.errors import ConfigError

UDS = ["/opt/venv/bin/python", "-m", "uvicorn", "--factory", "--uds", "{socket}",
       "llama_cpp.server.app:create_app"]
TCP = ["/opt/venv/bin/python", "-m", "llama_cpp.server", "--model", "{model_path}",
       "--host", "127.0.0.1", "--port", "{port}", "--model_alias", "{model}"]


def openai_model(model_id: str = "srv", **table: Any) -> Model:
    config = parse_config({"models": {model_id: {"backend": "openai", **table}}})
    return build_catalog(config, [], {}).get(model_id)   # type: ignore[return-value]


def props(model: Model, **kw: Any) -> dict[str, list[tuple[str, object]]]:
    spec = transient_spec(model, EngineLayout.for_model(model.id), model.config.command[0],
                          **kw)
    out: dict[str, list[tuple[str, object]]] = {}
    for name, sig, value in spec.properties():
        out.setdefault(name, []).append((sig, value))
    return out


def test_a_unix_socket_server_is_run_as_is_with_its_placeholders_filled() -> None:
    model = openai_model(command=UDS, env={"MODEL": "{model_path}", "N_CTX": "{ctx_size}",
                                           "LITERAL": "{{not a placeholder}}"},
                         path="/models/tiny.gguf", ctx_size=2048)
    layout = EngineLayout.for_model("srv")
    spec = transient_spec(model, layout, "/opt/venv/bin/python")
    assert spec.argv == ["/opt/venv/bin/python", "-m", "uvicorn", "--factory", "--uds",
                         layout.socket, "llama_cpp.server.app:create_app"]
    assert spec.environment["MODEL"] == "/models/tiny.gguf"
    assert spec.environment["N_CTX"] == "2048"
    assert spec.environment["LITERAL"] == "{not a placeholder}"
    assert not listens_on_tcp(model)
    assert server_binary(model, parse_config({})) == ("/opt/venv/bin/python",
                                                      "models.srv.command")


def test_a_unix_socket_server_gets_no_network_at_all() -> None:
    got = props(openai_model(command=UDS), system=True)
    assert got["RestrictAddressFamilies"] == [("(bas)", (True, ["AF_UNIX"]))]
    assert "IPAddressAllow" not in got and "PrivateNetwork" not in got
    assert got["IPAddressDeny"]


def test_a_tcp_server_runs_behind_the_launcher_in_a_network_of_its_own() -> None:
    model = openai_model(command=TCP, path="/models/tiny.gguf")
    assert listens_on_tcp(model)
    layout = EngineLayout.for_model("srv")
    spec = transient_spec(model, layout, "/opt/venv/bin/python", system=True)
    assert spec.argv[1:5] == ["-m", "gatewayd.engine_launch", "--socket", layout.socket]
    server = spec.argv[spec.argv.index("--") + 1:]
    # {port} is the launcher's to fill (8080 in the private namespace, else a free one)
    assert server == ["/opt/venv/bin/python", "-m", "llama_cpp.server", "--model",
                      "/models/tiny.gguf", "--host", "127.0.0.1", "--port", "{port}",
                      "--model_alias", "srv"]
    got = props(model, system=True)
    assert got["PrivateNetwork"] == [("b", True)]
    assert got["RestrictAddressFamilies"] == [("(bas)", (True, ["AF_UNIX", "AF_INET"]))]
    assert got["IPAddressAllow"][0][1] == [(2, b"\x7f\0\0\0", 8),
                                           (10, bytes(15) + b"\x01", 128)]
    assert "PrivateNetwork" not in props(model, system=True, private_network=False)


def test_a_port_told_only_through_env_is_a_tcp_server_too() -> None:
    # llama-server reads LLAMA_ARG_PORT: the check counted env's {port}, the unit did
    # not, and the literal "{port}" reached the server, which restarted to its limit
    model = openai_model(command=["/usr/bin/llama-server", "-m", "{model_path}"],
                         env={"LLAMA_ARG_PORT": "{port}", "LLAMA_ARG_HOST": "127.0.0.1"},
                         path="/models/tiny.gguf")
    assert model.config.listens_on_port and listens_on_tcp(model)
    layout = EngineLayout.for_model("srv")
    spec = transient_spec(model, layout, "/usr/bin/llama-server", system=True)
    assert spec.argv[1:3] == ["-m", "gatewayd.engine_launch"]   # the launcher fills it
    assert spec.environment["LLAMA_ARG_PORT"] == "{port}"
    assert props(model, system=True)["PrivateNetwork"] == [("b", True)]
    assert template_settings(model, EngineLayout.for_model("srv", template=True),
                             "/usr/bin/llama-server")["tcp"] is True


def test_the_template_runs_a_tcp_server_behind_the_launcher_and_a_socket_one_as_is() -> None:
    layout = EngineLayout.for_model("srv", template=True)
    tcp = template_settings(openai_model(command=TCP, path="/m.gguf"), layout, "/opt/py")
    uds = template_settings(openai_model(command=UDS), layout, "/opt/py")
    assert tcp["tcp"] is True and uds["tcp"] is False
    assert uds["argv"] == ["/opt/py", "-m", "uvicorn", "--factory", "--uds", layout.socket,
                           "llama_cpp.server.app:create_app"]


def test_a_changed_command_is_another_engine() -> None:
    config = parse_config({})
    one = engine_fingerprint(openai_model(command=UDS), config)
    assert one == engine_fingerprint(openai_model(command=UDS), config)
    assert one != engine_fingerprint(openai_model(command=[*UDS, "--workers", "1"]), config)
    assert one != engine_fingerprint(openai_model(command=UDS, env={"A": "b"}), config)


@pytest.mark.parametrize(("table", "message"), [
    ({"command": ["srv", "--port", "8000"]}, "exactly one of {socket}"),
    ({"command": ["srv", "--uds", "{socket}", "--port", "{port}"]}, "it has port and socket"),
    ({"command": ["srv", "--uds", "{sockt}"]}, r"'\{sockt\}' in '\{sockt\}' is not a "
                                               r"placeholder \(known: \{socket\}"),
    ({"command": ["srv", "--uds", "{socket"]}, "is not a placeholder"),
    ({"command": ["srv", "--uds", "{socket}", "{model_path}"]}, "has no path"),
    ({"command": ["srv", "--uds", "{socket}", "-c", "{ctx_size}"]}, "has no ctx_size"),
    ({"command": ["srv", "--uds", "{socket}"], "env": {"T": "{threads}"}}, "has no threads"),
    ({"command": ["srv", "--uds", "{socket}"], "env": {"T": "{nope}"}}, "models.srv.env"),
    ({"command": []}, "non-empty list of strings"),
    ({"command": ["", "{socket}"]}, "non-empty list of strings"),
    ({"command": "srv --uds {socket}"}, "must be a list"),
    ({}, "must be a list"),
    ({"command": UDS, "args": ["-x"]}, "whole command line is its `command`"),
    ({"command": UDS, "kind": "vision"}, "or a list of them"),
    ({"command": UDS, "kind": []}, "is an empty list"),
    ({"command": UDS, "ready_path": "health"}, "is not a path"),
    ({"command": UDS, "ready_status": 503}, "is not a success status"),
    ({"command": UDS, "vram_mib": 0}, "positive number of MiB"),
    ({"command": UDS, "ram_mib": "4G"}, "must be a int"),
])
def test_a_hostile_or_mistaken_command_is_refused_naming_the_key(table: dict[str, Any],
                                                                  message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"models": {"srv": {"backend": "openai", **table}}})


@pytest.mark.parametrize(("table", "message"), [
    ({"path": "/m.gguf", "command": UDS}, "only for backend = \"openai\""),
    ({"path": "/m.gguf", "ready_path": "/x"}, "only for backend = \"openai\""),
    ({"backend": "whisper", "path": "/w.bin", "kind": "image"}, "does not fit backend"),
    ({"path": "/m.gguf", "kind": ["chat"]}, "must be one of"),    # a list: openai only
])
def test_openai_keys_and_kinds_stay_with_openai_models(table: dict[str, Any],
                                                       message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"models": {"m": table}})


def test_placeholders_and_literal_braces() -> None:
    assert placeholders("--a={socket}:{port}", "w", "k") == ["socket", "port"]
    assert placeholders('{{"json": true}}', "w", "k") == []
    assert fill('{{"n": {ctx_size}}}', {"ctx_size": "8"}) == '{"n": 8}'
    assert fill("--port {port}", {"socket": "/s"}) == "--port {port}"   # the launcher's


def test_kinds_of_an_openai_server_give_it_each_ones_capabilities() -> None:
    model = openai_model(command=UDS, kind=["chat", "speech", "chat"])
    assert model.kinds == (ModelKind.CHAT, ModelKind.SPEECH)
    assert set(model.capabilities) == {"completion", "speech"}
    assert openai_model(command=UDS).kind is ModelKind.CHAT     # no header to read it from
    assert openai_model(command=UDS, kind="image").capabilities == ("image",)


def test_an_openai_server_is_ready_when_its_own_path_says_so() -> None:
    catalog = build_catalog(parse_config({"models": {
        "srv": {"backend": "openai", "command": UDS, "ready_path": "/health",
                "ready_status": 204},
        "plain": {"backend": "openai", "command": UDS},
        "llama": {"path": "/m.gguf"}}}), [], {})
    assert health_of(catalog, "srv") == ("/health", 204)
    assert health_of(catalog, "plain") == ("/v1/models", 200)
    assert health_of(catalog, "llama") == ("/health", 200)
    assert health_of(catalog, "adopted-but-gone") == ("/health", 200)


@pytest.mark.parametrize(("args", "kind"), [
    (["--embeddings"], ModelKind.EMBEDDING), (["--embedding", "-c", "512"], ModelKind.EMBEDDING),
    (["--rerank"], ModelKind.RERANK), (["--reranking"], ModelKind.RERANK),
    (["--embeddings", "--rerank"], ModelKind.RERANK), (["-c", "512"], None)])
def test_a_llama_models_flags_make_its_kind(args: list[str], kind: ModelKind | None) -> None:
    config = parse_config({"models": {"m": {"path": "/m.gguf", "args": args}}})
    assert config.models[0].kind is kind


@pytest.mark.parametrize(("args", "kind"), [
    (["--embeddings"], "chat"), (["--rerank"], "chat"), (["--reranking"], "embedding")])
def test_a_llama_kind_its_flags_contradict_is_refused(args: list[str], kind: str) -> None:
    with pytest.raises(ConfigError, match=f"contradicts {args[0]}"):
        parse_config({"models": {"m": {"path": "/m.gguf", "args": args, "kind": kind}}})


def test_a_rerank_kind_with_the_embeddings_flag_is_consistent() -> None:
    config = parse_config({"models": {"m": {"path": "/m.gguf", "args": ["--embeddings"],
                                            "kind": "rerank"}}})
    assert config.models[0].kind is ModelKind.RERANK


def need(model: Model, **kw: Any) -> tuple[int, str, int, str]:
    got = model_need(model, gpu=kw.pop("gpu", True), vram_margin_mib=1024, ram_margin_mib=256,
                     learned_vram_mib=kw.pop("vram", None), learned_ram_mib=kw.pop("ram", None),
                     estimate=None)
    return got.vram_mib, got.vram_source, got.ram_mib, got.ram_source


def test_declared_memory_is_the_need_until_a_run_teaches_otherwise() -> None:
    model = openai_model(command=UDS, vram_mib=40_000, ram_mib=6_000)
    assert need(model) == (40_000, "declared", 6_000, "declared")
    # learned: NVML saw it (its margin on top); its cgroup peak only ever raises the RAM
    assert need(model, vram=30_000, ram=7_000) == (31_024, "learned", 7_000, "learned")
    assert need(model, ram=5_000) == (40_000, "declared", 6_000, "declared")
    # nothing declared, no file: the margins, until its first run is measured
    assert need(openai_model(command=UDS), gpu=False) == (1024, "files", 256, "files")


def test_the_launchers_cannot_work_exit_is_the_one_systemd_does_not_restart() -> None:
    from gatewayd import engine_launch
    from gatewayd.core import engine_units
    assert engine_launch.EX_CONFIG == engine_units.EX_CONFIG
    got = props(openai_model(command=TCP, path="/m.gguf"))
    assert got["RestartPreventExitStatus"] == [("(aiai)", ([engine_units.EX_CONFIG], []))]
    unit = (Path(__file__).resolve().parents[2] / "units/llm-engine@.service").read_text()
    assert f"RestartPreventExitStatus={engine_units.EX_CONFIG}\n" in unit


def test_the_backend_is_named_in_the_models_description() -> None:
    model = openai_model(command=UDS)
    assert model.backend is Backend.OPENAI
    assert model.describe()["backend"] == "openai" and model.describe()["path"] is None
    assert model.names == frozenset({"srv"})


def test_check_says_where_a_port_server_would_get_no_private_network(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """PID 1 without CAP_NET_ADMIN (a container sharing the host's network, as the demo
    runs): a {port} server would listen on a port of the host; check says so, not only
    the gateway's log at its start."""
    from gatewayd import cli
    from gatewayd.adapters import unit_control
    config = tmp_path / "gateway.toml"
    config.write_text('[models.srv]\nbackend = "openai"\n'
                      'command = ["/bin/true", "--uds", "{socket}"]\n'
                      '[models.tcp]\nbackend = "openai"\ncommand = ["/bin/true"]\n'
                      'env = { LLAMA_ARG_PORT = "{port}" }\n')
    monkeypatch.setattr(unit_control, "manager_can_configure_networks", lambda: True)
    assert cli.main(["--config", str(config), "check"]) == 0
    assert "warning" not in capsys.readouterr().out
    monkeypatch.setattr(unit_control, "manager_can_configure_networks", lambda: False)
    assert cli.main(["--config", str(config), "check"]) == 0
    out = capsys.readouterr().out
    assert "warning: tcp: TCP engines" in out and "any local user can reach" in out
    assert "srv" not in out.split("warning:")[1]   # a {socket} server needs no network


async def test_a_port_servers_start_without_a_private_network_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from gatewayd.adapters import unit_control
    from gatewayd.core.config import GatewayConfig

    class Started:
        def __init__(self) -> None:
            self.specs: list[Any] = []

        async def start_transient(self, spec: Any) -> str:
            self.specs.append(spec)
            return "/job/1"

    monkeypatch.setattr(unit_control, "manager_can_configure_networks", lambda: False)
    config = GatewayConfig(state_dir=tmp_path / "state", parked_engines=0)
    systemd = Started()
    units = unit_control.TransientEngineUnits(
        systemd, config, manager="system", run_root=str(tmp_path))  # type: ignore[arg-type]
    monkeypatch.setattr(unit_control, "check_engine_can_read", lambda model, binary: None)
    caplog.set_level("WARNING")
    await units.start_engine(openai_model(command=["/bin/true", "--uds", "{socket}"]))
    assert "any local user can reach it" not in caplog.text
    await units.start_engine(openai_model("tcp", command=["/bin/true", "--port", "{port}"]))
    assert "tcp: its server listens on a loopback port of this host's network" in caplog.text
    assert "PrivateNetwork" not in dict((n, v) for n, _, v in systemd.specs[-1].properties())
