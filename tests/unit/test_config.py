from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gatewayd.adapters.config_file import load_config
from gatewayd.adapters.unit_control import resolve_binary
from gatewayd.core.config import Backend, GatewayConfig, ModelKind, UnitMode, parse_config
from gatewayd.core.errors import ConfigError, EngineBinaryMissing


def test_missing_default_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(tmp_path / "absent.toml") == GatewayConfig()


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml", required=True)


def test_full_config_parses_with_paths_relative_to_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.toml"
    cfg.write_text('''
models_dir = "models"
max_engines = 2
vram_margin_mib = 512
unit_mode = "transient"
[listen]
port = 9000
[models.whisper-small]
path = "/srv/whisper.bin"
backend = "whisper"
[models.chat]
path = "chat.gguf"
mmproj = "mmproj.gguf"
aliases = ["gpt-4o", "Chat"]
args = ["--flash-attn", "on"]
ctx_size = 8192
env = { GGML_X = "1" }
memory_max = "8G"
cpu_quota = "150%"
cuda_visible_devices = "1"
''')
    config = load_config(cfg)
    assert config.models_dir == tmp_path / "models"
    assert config.max_engines == 2 and config.vram_margin_mib == 512
    assert config.unit_mode is UnitMode.TRANSIENT and config.listen_port == 9000
    whisper, chat = config.models
    assert whisper.backend is Backend.WHISPER and whisper.path == Path("/srv/whisper.bin")
    assert chat.path == tmp_path / "chat.gguf" and chat.mmproj == tmp_path / "mmproj.gguf"
    assert chat.aliases == ("gpt-4o", "Chat") and chat.args == ("--flash-attn", "on")
    assert chat.memory_max == 8 << 30 and chat.cpu_quota == 150.0
    assert chat.env == {"GGML_X": "1"} and chat.ctx_size == 8192


@pytest.mark.parametrize("data,message", [
    ({"max_engines": 0}, "max_engines = 0 is out of range: allowed 1..16"),
    ({"max_engines": 17}, "out of range"),
    ({"parked_engines": -1}, "parked_engines = -1 is out of range: allowed 0..32"),
    ({"parked_engines": 33}, "out of range"),
    ({"parked_engines": "4"}, "parked_engines must be a int"),
    ({"max_engines": "4"}, "max_engines must be a int"),
    ({"max_engines": True}, "max_engines must be a int"),
    ({"max_engine": 4}, r"unknown key\(s\) max_engine"),
    ({"unit_mode": "magic"}, "unit_mode must be one of"),
    ({"listen": {"port": 70000}}, "not a TCP port"),
    ({"models": {"a": {}}}, r"\[models.a\] needs a path"),
    ({"models": {"a": {"path": "/x", "backend": "vllm"}}}, "one of 'llama', 'whisper', 'openai'"),
    ({"models": {"a": {"path": "/x", "pat": 1}}}, "unknown key"),
    ({"models": {"a": {"path": "/x", "memory_max": "lots"}}}, "is not a size"),
    ({"models": {"a": {"path": "/x", "cpu_quota": "2"}}}, "is not a CPU quota"),
    ({"models": {"a": {"path": "/x", "args": ["-t", 4]}}}, "must be a str"),
    ({"models_dir": "/m", "models": {"a": {"source": "org/r:Q4_0", "path": "/x"}}},
     "a path and a source"),
    ({"models": {"a": {"source": "org/r:Q4_0"}}}, "no models_dir to pull into"),
    ({"models_dir": "/m", "models": {"a": {"source": "not a repo"}}}, "a.source: 'not a repo'"),
    ({"models_dir": "/m", "models": {"a:7b": {"source": "org/r"}}}, "cannot name a model"),
    ({"models_dir": "/m", "models": {"a": {"source": "org/r", "backend": "whisper"}}},
     "for llama models"),
])
def test_invalid_config_names_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_bad_toml_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.toml"
    cfg.write_text("max_engines = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(cfg)


def test_engine_server_paths(tmp_path: Path) -> None:
    """A bare name is looked up in PATH at start; a path with a slash is taken from the
    configuration file's directory; an empty one is refused, naming the key."""
    config = tmp_path / "gateway.toml"
    config.write_text('llama_server = "bin/llama-server"\nwhisper_server = "whisper-server"\n')
    loaded = load_config(config)
    assert loaded.llama_server == str(tmp_path / "bin" / "llama-server")
    assert loaded.whisper_server == "whisper-server"
    config.write_text('llama_server = " "\n')
    with pytest.raises(ConfigError, match="llama_server is empty"):
        load_config(config)


def test_an_engine_server_that_cannot_run_is_named_by_its_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EngineBinaryMissing, match=r"whisper_server = 'ws': not found in PATH"):
        resolve_binary("ws", "whisper_server")
    with pytest.raises(EngineBinaryMissing, match="no such file"):
        resolve_binary(str(tmp_path / "nope"), "llama_server")
    (tmp_path / "ls").write_text("#!/bin/sh\n")
    with pytest.raises(EngineBinaryMissing, match="not executable"):
        resolve_binary(str(tmp_path / "ls"), "llama_server")
    (tmp_path / "ls").chmod(0o755)
    assert resolve_binary("ls") == str(tmp_path / "ls")


def test_the_health_table(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text("[health]\ninterval_s = 2\ntimeout_s = 1.5\nmisses = 0\n")
    loaded = load_config(config)
    assert (loaded.health_interval_s, loaded.health_timeout_s, loaded.health_misses) == \
        (2.0, 1.5, 0)
    assert GatewayConfig().health_misses == 3
    for bad, match in (("misses = -1", "health.misses cannot be negative"),
                       ("timeout_s = 0", "health.timeout_s must be positive"),
                       ("every = 3", "every")):
        config.write_text(f"[health]\n{bad}\n")
        with pytest.raises(ConfigError, match=match):
            load_config(config)


def test_kind_is_checked_against_the_backend(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[models.e]\npath = "e.gguf"\nkind = "embedding"\n')
    assert load_config(config).models[0].kind is ModelKind.EMBEDDING
    config.write_text('[models.w]\npath = "w.bin"\nbackend = "whisper"\nkind = "rerank"\n')
    with pytest.raises(ConfigError, match="does not fit backend 'whisper'"):
        load_config(config)
    config.write_text('[models.e]\npath = "e.gguf"\nkind = "embeddings"\n')
    with pytest.raises(ConfigError, match="kind must be one of 'chat', 'embedding'"):
        load_config(config)


@pytest.mark.parametrize("key", [
    "read_timeout_s", "load_timeout_s", "shutdown_timeout_s", "eviction_wait_s",
    "health.interval_s", "health.timeout_s", "records.max_age_days",
    "models.m.idle_ttl_s", "upstreams.far.connect_timeout_s", "upstreams.far.read_timeout_s",
    "upstreams.far.health_interval_s"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "-1"])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_by_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: str) -> None:
    """TOML has inf and nan: `read_timeout_s = inf` was accepted, and is no timeout at all
    (an asyncio timer's wait would overflow on it). `llm-gateway check` and a reload (which read
    the file the same way) refuse it, naming the key."""
    from gatewayd import cli
    table, _, option = key.rpartition(".")
    tables = {"": "", "health": "[health]\n", "records": "[records]\n",
              "models.m": '[models.m]\npath = "/srv/m.gguf"\n',
              "upstreams.far": '[upstreams.far]\nurl = "http://far.example/v1"\n'
                               'models = ["x"]\n'}
    text = tables[table] + f"{option} = {value}\n"
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(cfg)
    assert cli.main(["--config", str(cfg), "check"]) == 1
    assert option in capsys.readouterr().err


def test_the_bounds_have_defaults_and_are_checked(tmp_path: Path) -> None:
    config = GatewayConfig()
    assert config.max_answer_bytes == 256 << 20 and config.max_event_bytes == 4 << 20
    assert config.records_max_age_days == 30 and config.records_max_bytes == 1 << 30
    assert config.queue_limit == 100
    cfg = tmp_path / "gateway.toml"
    cfg.write_text("max_answer_mb = 8\nmax_event_mb = 1\n[records]\nmax_age_days = 0.5\n"
                   "max_mb = 0\n")
    config = load_config(cfg)
    assert config.max_answer_bytes == 8 << 20 and config.max_event_bytes == 1 << 20
    assert config.records_max_age_days == 0.5 and config.records_max_bytes == 0
    refused: list[tuple[dict[str, Any], str]] = [
        ({"max_answer_mb": 0}, "max_answer_mb must be at least 1"),
        ({"max_event_mb": 0.5}, "max_event_mb must be a int"),
        ({"records": {"max_mb": -1}}, "records.max_mb cannot be negative"),
        ({"records": {"max_age_days": -1}}, "records.max_age_days cannot")]
    for data, message in refused:
        with pytest.raises(ConfigError, match=message):
            parse_config(data)
    for size in ("inf", "nan", "infG"):
        with pytest.raises(ConfigError, match="is not a size"):
            parse_config({"models": {"a": {"path": "/x", "memory_max": size}}})
    with pytest.raises(ConfigError, match="is not a CPU quota"):
        parse_config({"models": {"a": {"path": "/x", "cpu_quota": "inf%"}}})


def test_a_source_is_where_a_model_without_a_file_comes_from() -> None:
    config = parse_config({"models_dir": "/m", "models": {
        "tiny": {"source": "hf://org/Tiny-GGUF/Tiny-Q8_0.gguf", "preload": True}}})
    tiny = config.models[0]
    assert tiny.source == "org/Tiny-GGUF:Tiny-Q8_0.gguf" and tiny.path is None
    assert not tiny.downloaded and tiny.preload


def test_the_schedule_its_bound_and_priorities() -> None:
    default = parse_config({})
    assert (default.schedule, default.max_wait_s, default.priority_aging_s) == \
        ("grouped", 20.0, 120.0)
    config = parse_config({"schedule": "fifo", "max_wait_s": 5, "priority_aging_s": 60,
                           "models": {"a": {"path": "/m/a.gguf", "priority": "high",
                                            "max_wait_s": 2.5}}})
    assert (config.schedule, config.max_wait_s, config.priority_aging_s) == ("fifo", 5, 60)
    (a,) = config.models
    assert (a.priority, a.max_wait_s) == (2, 2.5)
    for bad, words in (({"schedule": "lifo"}, "schedule must be one of grouped, fifo"),
                       ({"max_wait_s": 0}, "max_wait_s must be positive"),
                       ({"max_wait_s": float("inf")}, "max_wait_s = inf is not a finite"),
                       ({"models": {"a": {"path": "/m/a.gguf", "priority": "urgent"}}},
                        "models.a.priority must be one of low, normal, high")):
        with pytest.raises(ConfigError, match=words):
            parse_config(bad)
