"""Model ids reach systemd only escaped; argv and properties are exactly as meant."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gatewayd.adapters.unit_control import info_from_properties, manager_can_configure_networks
from gatewayd.core.catalog import Model
from gatewayd.core.config import Backend, GatewayConfig, ModelConfig, ModelKind
from gatewayd.core.engine_units import (
    ENGINE_USER,
    MAX_INSTANCE,
    EngineLayout,
    engine_env,
    engine_fingerprint,
    engine_instance,
    escape_unit_component,
    parked_spec,
    server_argv,
    template_settings,
    transient_spec,
    unreadable_by_engine,
)
from gatewayd.core.model_facts import GgufFacts
from gatewayd.core.unit_spec import exec_args

HOSTILE = [
    "tiny-alpha", "Qwen2.5-7B-Instruct-Q4_K_M", ".hidden", "a/b/../../c", "../../etc/passwd",
    "x $(touch /tmp/pwned) ${HOME} %n %%i", 'quote"\'`', "new\nline\ttab", "ünïcödé-模型",
    "semi;colon&amp|pipe", "back\\slash", "@at@", "-leading-dash",
]


@pytest.mark.parametrize("model_id", HOSTILE)
def test_escape_matches_systemd_escape(model_id: str) -> None:
    tool = shutil.which("systemd-escape")
    if tool is None:
        pytest.skip("systemd-escape not installed")
    expected = subprocess.run([tool, "--", model_id], capture_output=True, text=True,
                              check=True).stdout.strip()
    assert escape_unit_component(model_id) == expected


@pytest.mark.parametrize("model_id", [*HOSTILE, "x" * 300, "-" * 120, "é" * 90])
def test_layout_is_safe_for_any_id(model_id: str) -> None:
    for template in (False, True):
        layout = EngineLayout.for_model(model_id, template=template)
        assert set(layout.instance) <= set(
            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:_.\\-")
        assert len(layout.instance) <= MAX_INSTANCE
        assert not layout.instance.startswith(".")
        assert "/" not in layout.runtime_directory  # one path component under /run
        assert layout.socket == f"/run/{layout.runtime_directory}/engine.sock"
        assert len(layout.socket.encode()) < 108              # sun_path
        assert layout.unit.endswith(".service") and len(layout.unit) < 256


def test_long_ids_stay_distinct() -> None:
    a, b = "x" * 200 + "a", "x" * 200 + "b"
    assert engine_instance(a) != engine_instance(b)
    dashes = engine_instance("-" * 100)          # each "-" escapes to 4 characters
    assert dashes[-13] == "_" and dashes[:-13].endswith("\\x2d")   # no escape cut in half


def test_dollar_is_doubled_for_exec_lines() -> None:
    assert exec_args(["/bin/x", "${HOME}", "$$", "%n"]) == ["/bin/x", "$${HOME}", "$$$$", "%n"]


def _model(model_id: str, path: Path, **kw: object) -> Model:
    return Model(id=model_id, config=ModelConfig(name=model_id, path=path, **kw),  # type: ignore[arg-type]
                 names=frozenset())


def test_llama_spec(tmp_path: Path) -> None:
    model = _model("my model", tmp_path / "m.gguf", mmproj=tmp_path / "p.gguf", ctx_size=4096,
                   threads=2, args=("--flash-attn", "on"), memory_max=8 << 30, cpu_quota=150.0,
                   cuda_visible_devices="1", env={"A": "b"})
    config = GatewayConfig(llama_server="/opt/llama-server")
    layout = EngineLayout.for_model(model.id)
    spec = transient_spec(model, layout, config.llama_server)
    assert spec.name == "llm-engine-my\\x20model.service"
    assert spec.argv == ["/opt/llama-server", "--host", layout.socket, "-m", str(model.path),
                         "--alias", "my model", "-t", "2", "--metrics",
                         "--mmproj", str(tmp_path / "p.gguf"), "-c", "4096", "--flash-attn", "on"]
    props = {name: (sig, value) for name, sig, value in spec.properties()}
    assert props["ExecStartPre"][1][0][1] == ["/bin/rm", "-f", "--", layout.socket]
    assert "ExecStopPost" not in props   # a crash must not pass through stop-post (design.md)
    assert props["MemoryMax"] == ("t", 8 << 30)
    assert props["CPUQuotaPerSecUSec"] == ("t", 1_500_000)
    assert props["Slice"] == ("s", "llm-engines.slice")
    assert props["LogExtraFields"] == ("aay", [b"LLM_GATEWAY_MODEL=my model"])
    env = props["Environment"][1]
    assert "CUDA_VISIBLE_DEVICES=1" in env and "A=b" in env
    assert "LLM_GATEWAY_MODEL=my model" in env and f"LLM_GATEWAY_SOCKET={layout.socket}" in env
    assert "PrivateNetwork" not in props


def test_placement_sets_the_devices_unless_the_model_names_its_own(tmp_path: Path) -> None:
    layout = EngineLayout.for_model("m")
    placed = _model("m", tmp_path / "m.gguf")
    env = engine_env(placed, layout, "GPU-abc")
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-abc"
    assert "CUDA_VISIBLE_DEVICES" not in engine_env(placed, layout)
    named = _model("m", tmp_path / "m.gguf", cuda_visible_devices="1")
    assert engine_env(named, layout, "GPU-abc")["CUDA_VISIBLE_DEVICES"] == "1"
    spec = transient_spec(placed, layout, "/opt/llama-server", visible_devices="GPU-abc")
    props = {name: value for name, _, value in spec.properties()}
    assert "CUDA_VISIBLE_DEVICES=GPU-abc" in props["Environment"]
    settings = template_settings(placed, layout, "/opt/llama-server", visible_devices="GPU-abc")
    assert settings["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-abc"    # type: ignore[index]
    # the same setup wherever it runs: the learned memory and a reload see no change
    assert "GPU-abc" not in repr(engine_fingerprint(placed, GatewayConfig()))
    info = info_from_properties("u.service", {}, {"Environment": [
        "LLM_GATEWAY_MODEL=m", "CUDA_VISIBLE_DEVICES=GPU-abc"]})
    assert info.visible_devices == "GPU-abc" and info.model_id == "m"


def test_whisper_spec_runs_the_launcher_in_a_private_network(tmp_path: Path) -> None:
    model = _model("whisper", tmp_path / "w.bin", backend=Backend.WHISPER)
    layout = EngineLayout.for_model(model.id)
    spec = transient_spec(model, layout, "/opt/whisper-server")
    props = {name: (sig, value) for name, sig, value in spec.properties()}
    assert props["PrivateNetwork"] == ("b", True)
    assert spec.argv[1:5] == ["-m", "gatewayd.engine_launch", "--socket", layout.socket]
    assert spec.argv[spec.argv.index("--") + 1] == "/opt/whisper-server"
    assert "/v1/audio/transcriptions" in spec.argv and "{port}" in spec.argv


def test_whisper_without_a_usable_private_network_keeps_the_host_namespace(
        tmp_path: Path) -> None:
    model = _model("whisper", tmp_path / "w.bin", backend=Backend.WHISPER)
    spec = transient_spec(model, EngineLayout.for_model(model.id), "/opt/whisper-server",
                          private_network=False)
    assert "PrivateNetwork" not in {name for name, _, _ in spec.properties()}


def test_pid1_without_cap_net_admin_cannot_configure_private_networks() -> None:
    full = "Name:\tsystemd\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n"
    nspawn_shared_net = "Name:\tsystemd\nCapEff:\t00000000fdecafff\n"   # bit 12 cleared
    assert manager_can_configure_networks(full)
    assert not manager_can_configure_networks(nspawn_shared_net)
    assert manager_can_configure_networks("Name:\tsystemd\n")   # unknown: assume it can


def test_an_embeddings_model_starts_an_embeddings_engine_with_pooling(tmp_path: Path) -> None:
    path = tmp_path / "e.gguf"
    layout = EngineLayout.for_model("e")
    plain = Model(id="e", config=ModelConfig(name="e", path=path, kind=ModelKind.EMBEDDING),
                  names=frozenset({"e"}))
    assert server_argv(plain, layout, "/bin/ls")[-3:] == ["--embeddings", "--pooling", "mean"]
    chosen = Model(id="e", config=ModelConfig(name="e", path=path, kind=ModelKind.EMBEDDING,
                                              args=("--pooling", "cls")),
                   names=frozenset({"e"}))
    argv = server_argv(chosen, layout, "/bin/ls")
    assert "--embeddings" in argv and argv.count("--pooling") == 1 and argv[-1] == "cls"
    # the header's own pooling (an embedding model's GGUF has one) is left to llama-server
    facts = GgufFacts(path=str(path), file_size=0, metadata={
        "general.architecture": "bert", "bert.pooling_type": 2})
    from_header = Model(id="e", config=ModelConfig(name="e", path=path), facts=facts,
                        names=frozenset({"e"}))
    assert from_header.kind is ModelKind.EMBEDDING
    argv = server_argv(from_header, layout, "/bin/ls")
    assert "--embeddings" in argv and "--pooling" not in argv


def test_a_reranker_is_known_by_its_header_and_started_with_rerank(tmp_path: Path) -> None:
    path = tmp_path / "r.gguf"
    layout = EngineLayout.for_model("r")
    facts = GgufFacts(path=str(path), file_size=0, metadata={
        "general.architecture": "qwen3", "qwen3.pooling_type": 4})
    reranker = Model(id="r", config=ModelConfig(name="r", path=path), facts=facts,
                     names=frozenset({"r"}))
    assert reranker.kind is ModelKind.RERANK and reranker.capabilities == ("rerank",)
    argv = server_argv(reranker, layout, "/bin/ls")
    assert "--rerank" in argv and "--embeddings" not in argv
    # configured as chat, the header notwithstanding: a plain engine
    chat = Model(id="r", config=ModelConfig(name="r", path=path, kind=ModelKind.CHAT),
                 facts=facts, names=frozenset({"r"}))
    assert not {"--rerank", "--embeddings"} & set(server_argv(chat, layout, "/bin/ls"))


# -- the engine's identity and sandbox (issue 33: "an engine is the gateway") ----------

REPO = Path(__file__).resolve().parents[2]


def _props(spec: object) -> dict[str, list[tuple[str, object]]]:
    """Every property by name, repeats kept (SystemCallFilter= is given twice)."""
    out: dict[str, list[tuple[str, object]]] = {}
    for name, sig, value in spec.properties():   # type: ignore[attr-defined]
        out.setdefault(name, []).append((sig, value))
    return out


def test_a_system_engine_runs_as_its_own_user_in_the_sandbox(tmp_path: Path) -> None:
    model = _model("m", tmp_path / "m.gguf")
    layout = EngineLayout.for_model(model.id)
    kv = str(tmp_path / "kv-cache" / layout.instance)
    props = _props(transient_spec(model, layout, "/opt/llama-server", slot_save_path=kv,
                                  system=True))
    # never root, never the gateway's user: llm-engine (static if the package made it)
    assert props["DynamicUser"] == [("b", True)]
    assert props["User"] == props["Group"] == [("s", ENGINE_USER)] and ENGINE_USER != "root"
    one = {name: values[0] for name, values in props.items()}
    assert one["ProtectSystem"] == ("s", "strict") and one["ProtectHome"] == ("s", "read-only")
    for flag in ("PrivateTmp", "NoNewPrivileges", "ProtectKernelTunables", "RemoveIPC",
                 "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
                 "LockPersonality", "RestrictRealtime", "RestrictSUIDSGID", "ProtectClock"):
        assert one[flag] == ("b", True), flag
    assert one["CapabilityBoundingSet"] == ("t", 0)
    assert one["RestrictNamespaces"] == ("t", 0)
    assert one["RestrictAddressFamilies"] == ("(bas)", (True, ["AF_UNIX"]))
    assert one["IPAddressDeny"][1] == [(2, bytes(4), 0), (10, bytes(16), 0)]   # any
    assert "IPAddressAllow" not in props and "PrivateNetwork" not in props
    assert props["SystemCallFilter"] == [("(bas)", (True, ["@system-service"])),
                                         ("(bas)", (False, ["@privileged"]))]
    # the GPUs stay reachable, nothing else of /dev
    assert one["DevicePolicy"] == ("s", "closed")
    assert {d for d, _ in one["DeviceAllow"][1]} >= {  # type: ignore[attr-defined]
        "char-nvidia-frontend", "char-nvidia-uvm", "char-nvidia-caps"}
    # writable: its KV folder (and its runtime directory); handed to it, as root, first
    assert one["ReadWritePaths"] == ("as", [f"-{tmp_path / 'kv-cache'}"])
    pre = one["ExecStartPreEx"][1][0]   # type: ignore[index]
    assert pre[1] == ["/bin/chown", "-R", "llm-engine:llm-engine", "--", kv]
    assert pre[2] == ["privileged", "ignore-failure"]


def test_a_whisper_engine_gets_loopback_and_af_inet_only(tmp_path: Path) -> None:
    model = _model("w", tmp_path / "w.bin", backend=Backend.WHISPER)
    props = _props(transient_spec(model, EngineLayout.for_model("w"), "/opt/whisper-server",
                                  system=True))
    assert props["RestrictAddressFamilies"] == [("(bas)", (True, ["AF_UNIX", "AF_INET"]))]
    assert props["IPAddressAllow"][0][1] == [(2, b"\x7f\0\0\0", 8), (10, bytes(15) + b"\x01", 128)]
    assert props["PrivateNetwork"] == [("b", True)] and "ExecStartPreEx" not in props


def test_a_user_managers_engine_keeps_what_a_user_manager_can_enforce(tmp_path: Path) -> None:
    props = _props(transient_spec(_model("m", tmp_path / "m.gguf"), EngineLayout.for_model("m"),
                                  "/opt/llama-server"))
    # a user manager cannot change identity nor set up namespaces for an unprivileged user
    for name in ("DynamicUser", "User", "ProtectSystem", "PrivateTmp", "IPAddressDeny",
                 "ExecStartPreEx", "DevicePolicy"):
        assert name not in props, name
    assert props["NoNewPrivileges"] == [("b", True)]
    assert props["RestrictAddressFamilies"] == [("(bas)", (True, ["AF_UNIX"]))]


def test_a_parked_system_engine_is_handed_its_fifo(tmp_path: Path) -> None:
    model = _model("m", tmp_path / "m.gguf")
    spec = transient_spec(model, EngineLayout.for_model("m"), "/opt/llama-server", system=True)
    parked = _props(parked_spec(spec, "/var/lib/x/parked/m.fifo"))
    assert parked["ExecStartPreEx"][0][1][0][1][-1] == "/var/lib/x/parked/m.fifo"  # type: ignore[index]
    assert "ExecStartPreEx" not in _props(parked_spec(transient_spec(
        model, EngineLayout.for_model("m"), "/opt/llama-server"), "/f"))


def test_what_the_engine_user_cannot_read_is_named() -> None:
    d, f = 0o040755, 0o100644
    ok = [("/", d, 0, 0), ("/srv", d, 0, 0), ("/srv/m.gguf", f, 0, 0)]
    assert unreadable_by_engine(ok, None, frozenset()) is None
    private = [("/", d, 0, 0), ("/root", 0o040700, 0, 0), ("/root/m.gguf", f, 0, 0)]
    assert "/root (mode 0700) does not let user llm-engine search" in str(
        unreadable_by_engine(private, None, frozenset()))
    # the static user reads through its group, not a dynamic one
    grouped = [("/", d, 0, 0), ("/m", 0o040750, 0, 990), ("/m/a", 0o100640, 0, 990)]
    assert unreadable_by_engine(grouped, 991, frozenset({990})) is None
    assert "does not let" in str(unreadable_by_engine(grouped, None, frozenset()))
    assert "does not let user llm-engine read" in str(unreadable_by_engine(
        [("/", d, 0, 0), ("/m", 0o100600, 0, 0)], None, frozenset()))
    hidden = [("/", d, 0, 0), ("/tmp", 0o041777, 0, 0), ("/tmp/m", f, 0, 0)]
    assert "private /tmp hides" in str(unreadable_by_engine(hidden, None, frozenset()))


def test_the_template_unit_sandboxes_its_engine_as_llm_engine() -> None:
    """llm-engine@.service: the packaged engines' identity, and what the gateway unit
    needs to reach them (the test_package container test runs both for real)."""
    engine = (REPO / "units/llm-engine@.service").read_text().splitlines()
    gateway = (REPO / "units/llm-gateway.service").read_text().splitlines()
    for line in ("User=llm-engine", "Group=llm-engine", "UMask=0007", "NoNewPrivileges=yes",
                 "RuntimeDirectoryMode=0750", "ProtectSystem=strict", "PrivateTmp=yes",
                 "IPAddressDeny=any", "DevicePolicy=closed", "CapabilityBoundingSet=",
                 "LoadCredential=settings:/var/lib/llm-gateway/engines/%i.json"):
        assert line in engine, line
    assert not any(line.startswith(("User=llm-gateway", "Group=llm-gateway",
                                    "SupplementaryGroups=")) for line in engine)
    assert "SupplementaryGroups=systemd-journal llm-engine" in gateway
    sysusers = (REPO / "packaging/sysusers.d/llm-gateway.conf").read_text()
    assert "u llm-engine " in sysusers


def test_the_launcher_tells_a_private_network_without_a_socket(tmp_path: Path) -> None:
    """Sandboxed (RestrictAddressFamilies=: no AF_NETLINK; ProtectProc=invisible: no PID 1),
    the whisper launcher reads this namespace's interfaces from /proc/net/dev."""
    from gatewayd import engine_launch
    dev = tmp_path / "dev"
    header = ("Inter-|   Receive\n"
              " face |bytes    packets errs drop fifo frame compressed multicast|bytes\n")
    dev.write_text(header + "    lo: 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n")
    assert engine_launch.interfaces(str(dev)) == ["lo"]
    dev.write_text(header + "    lo: 0 0\n  eth0: 1 2\n")
    assert engine_launch.interfaces(str(dev)) == ["lo", "eth0"]
    assert engine_launch.interfaces(str(tmp_path / "none")) == []


def test_the_gateways_own_code_in_a_private_tmp_is_bound_in_read_only(tmp_path: Path) -> None:
    """A checkout under /tmp (a CI's, a user's): the engine's private /tmp would hide the
    launcher whisper runs and the parked wait's library, so the gateway binds them in."""
    from gatewayd.core.engine_units import in_private_tmp
    assert in_private_tmp(["/tmp/ci/repo/gatewayd", "/usr/lib/llm-gateway/venv",
                           "/var/tmp/x", "/tmpfoo", "/srv/tmp/x"]) == [
        "/tmp/ci/repo/gatewayd", "/var/tmp/x"]
    model = _model("m", tmp_path / "m.bin", backend=Backend.WHISPER)
    layout = EngineLayout.for_model("m")
    props = transient_spec(model, layout, "/usr/bin/whisper-server", system=True,
                           shown=["/tmp/ci/repo/gatewayd"]).properties()
    binds = [value for name, _, value in props if name == "BindReadOnlyPaths"]
    assert binds == [[("/tmp/ci/repo/gatewayd", "/tmp/ci/repo/gatewayd", True, 16384)]]
    plain = transient_spec(model, layout, "/usr/bin/whisper-server", system=True).properties()
    assert not [name for name, _, _ in plain if name == "BindReadOnlyPaths"]


def test_a_preloaded_wait_the_engine_user_cannot_read_is_not_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dynamic linker skips an LD_PRELOAD it cannot open: the "parked" engine would
    start loading at once. A root gateway whose library the engine user cannot reach
    parks behind the shell instead."""
    from gatewayd.adapters import unit_control
    from gatewayd.core.engine_units import unreadable_by_engine
    closed = tmp_path / "srv" / "closed"
    closed.mkdir(parents=True)
    library = closed / "_engine_park.so"
    library.write_bytes(b"\x7fELF")
    closed.chmod(0o700)
    monkeypatch.setattr(unit_control, "preload_library", lambda: str(library))
    monkeypatch.setattr(unit_control, "engine_identity", lambda: (65534, frozenset()))
    config = GatewayConfig(state_dir=tmp_path / "state")
    units = unit_control.TransientEngineUnits(None, config, manager="system",  # type: ignore[arg-type]
                                              run_root=str(tmp_path))
    assert units._preload is None
    closed.chmod(0o711)
    units = unit_control.TransientEngineUnits(None, config, manager="user",  # type: ignore[arg-type]
                                              run_root=str(tmp_path))
    assert units._preload == str(library)     # a user's engines are the user: no check
    chain = [("/tmp", 0o41777, 0, 0), ("/tmp/ci", 0o40755, 0, 0), ("/tmp/ci/f", 0o100644, 0, 0)]
    assert "PrivateTmp" in (unreadable_by_engine(chain, None, frozenset()) or "")
    assert unreadable_by_engine(chain, None, frozenset(), bound=True) is None


def test_what_a_start_would_fail_on_is_said_before_it(tmp_path: Path) -> None:
    """check_startable (asked before room is made): the engine server, resolved against
    PATH, and the model's files; the same words start_engine's own failure says."""
    from gatewayd.adapters import unit_control
    from gatewayd.core.errors import ConfigError, EngineBinaryMissing
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF")
    config = GatewayConfig(state_dir=tmp_path / "state", llama_server=str(server))
    units = unit_control.TemplateEngineUnits(None, config)  # type: ignore[arg-type]
    units.manager = "user"   # (the engine user's reach is test_what_the_engine_user...)
    units.check_startable(_model("m", weights))
    with pytest.raises(ConfigError, match=r"m: .*/gone\.gguf: no such file"):
        units.check_startable(_model("m", tmp_path / "gone.gguf"))
    with pytest.raises(ConfigError, match="no such file"):
        units.check_startable(_model("m", weights, mmproj=tmp_path / "gone-mmproj.gguf"))
    server.chmod(0o644)
    with pytest.raises(EngineBinaryMissing, match="not executable"):
        units.check_startable(_model("m", weights))
    units.reconfigure(GatewayConfig(llama_server="no-such-llama-server"))
    with pytest.raises(EngineBinaryMissing, match="not found in PATH"):
        units.check_startable(_model("m", weights))
