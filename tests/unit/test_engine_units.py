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
    MAX_INSTANCE,
    EngineLayout,
    engine_env,
    engine_fingerprint,
    engine_instance,
    escape_unit_component,
    server_argv,
    template_settings,
    transient_spec,
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
