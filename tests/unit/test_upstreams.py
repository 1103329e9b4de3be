"""The pure rules of remote upstreams: the [upstreams.NAME] table, health and backoff,
which upstream answers a name, and where a path goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gatewayd.adapters.config_file import load_config
from gatewayd.core.config import parse_config
from gatewayd.core.errors import ConfigError
from gatewayd.core.upstreams import (
    Health,
    RemoteModel,
    RemoteNames,
    UpstreamConfig,
    discovered_ids,
)


def parse(upstreams: dict[str, Any], **top: Any) -> Any:
    return parse_config({"upstreams": upstreams, **top}, Path("/etc/llm-gateway/g.toml"))


def test_an_upstream_table_is_parsed_with_defaults() -> None:
    config = parse({"box": {"url": "https://gpu-box:8443/v1/", "models": ["big"],
                            "api_key_file": "box.key", "max_concurrency": 4}})
    (box,) = config.upstreams
    assert box.url == "https://gpu-box:8443/v1" and box.models == ("big",)
    assert box.api_key_file == Path("/etc/llm-gateway/box.key")
    assert box.tls_verify and box.connect_timeout_s == 5 and box.read_timeout_s is None
    assert box.max_concurrency == 4 and not box.discovers
    assert box.url_for("/v1/chat/completions?x=1") == "https://gpu-box:8443/v1/chat/completions?x=1"
    assert parse({"d": {"url": "http://h/openai/v1"}}).upstreams[0].discovers
    assert parse({"d": {"url": "http://h/openai/v1"}}).upstreams[0].url_for(
        "/v1/models") == "http://h/openai/v1/models"


@pytest.mark.parametrize(("table", "words"), [
    ({}, "needs a url"),
    ({"url": "gpu-box:8080"}, "not an http:// or https:// URL"),
    ({"url": "ftp://h/v1"}, "not an http:// or https:// URL"),
    ({"url": "http://h/v1?x=1"}, "no ?query"),
    ({"url": "http://h", "models": []}, "non-empty list"),
    ({"url": "http://h", "models": "big"}, "non-empty list"),
    ({"url": "http://h", "api_key_file": "a", "api_key_credential": "b"}, "give one"),
    ({"url": "http://h", "api_key_credential": "/etc/key"}, "not a path"),
    ({"url": "http://h", "tls_verify": "no"}, "true or false"),
    ({"url": "http://h", "max_concurrency": 0}, "positive integer"),
    ({"url": "http://h", "connect_timeout_s": -1}, "positive number"),
    ({"url": "http://h", "timeout": 3}, "unknown key(s) timeout"),
])
def test_a_wrong_upstream_table_names_the_key(table: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=r"upstreams\.box") as e:
        parse({"box": table})
    assert words in e.value.message


def test_spill_over_needs_an_upstream() -> None:
    models = {"m": {"path": "/m.gguf", "spill_over": True}}
    with pytest.raises(ConfigError, match="spill_over is set for m"):
        parse_config({"models": models}, None)
    config = parse({"box": {"url": "http://h/v1"}}, models=models)
    assert config.models[0].spill_over


def test_the_upstream_key_comes_from_its_file_or_a_systemd_credential(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "box.key").write_text("sk-box\n")
    (tmp_path / "creds").mkdir()
    (tmp_path / "creds" / "far").write_text("sk-far")
    (tmp_path / "g.toml").write_text(
        '[upstreams.box]\nurl = "http://h/v1"\napi_key_file = "box.key"\n'
        '[upstreams.far]\nurl = "http://f/v1"\napi_key_credential = "far"\n')
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "creds"))
    box, far = load_config(tmp_path / "g.toml").upstreams
    assert (box.api_key, far.api_key) == ("sk-box", "sk-far")
    assert "sk-box" not in repr(box)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    with pytest.raises(ConfigError, match="LoadCredential=far"):
        load_config(tmp_path / "g.toml")
    (tmp_path / "box.key").unlink()
    (tmp_path / "g.toml").write_text('[upstreams.box]\nurl = "http://h/v1"\n'
                                     'api_key_file = "box.key"\n')
    with pytest.raises(ConfigError, match="cannot read the API key"):
        load_config(tmp_path / "g.toml")


def test_health_backs_off_while_down_and_probes_at_the_interval_while_up() -> None:
    health = Health(interval_s=10)
    assert str(health.state) == "unknown"
    waits = []
    for now in range(6):
        health.failed(float(now), "refused")
        waits.append(health.next_probe_at - now)
    assert waits == [1, 2, 4, 8, 10, 10]
    assert str(health.state) == "down" and health.last_error == "refused"
    health.succeeded(100.0)
    assert (str(health.state), health.failures) == ("up", 0)
    assert not health.last_error
    assert health.retry_after_s(103.0) == 7
    health.failed(104.0, "again")
    assert health.next_probe_at == 105.0    # the backoff starts from its first step


def test_names_resolve_case_insensitively_in_configuration_order() -> None:
    names = RemoteNames([("first", ["Big", "small"]), ("second", ["big", "other"])])
    assert names.candidates(["BIG"]) == [RemoteModel("first", "Big"),
                                         RemoteModel("second", "big")]
    # a local model's several names: each upstream once, first match kept
    assert names.candidates(["small", "big"]) == [RemoteModel("first", "small"),
                                                  RemoteModel("second", "big")]
    assert names.candidates(["none"]) == []
    assert len(names) == 4


def test_a_model_list_must_be_openais_shape() -> None:
    assert discovered_ids({"data": [{"id": "a"}, {"id": 3}, "x", {"id": "b"}]}) == ["a", "b"]
    with pytest.raises(ValueError, match="not an OpenAI model list"):
        discovered_ids({"models": []})


def test_an_upstreams_credentials_never_show_in_words_about_it() -> None:
    """An error's words (a library's, which may quote the URL) go to logs, /admin/status
    and clients: the URL's user:password and the API key are taken out."""
    config = UpstreamConfig("box", "https://me:pa55@gpu-box:8443/v1", api_key="sk-secret-1")
    said = ("POST https://me:pa55@gpu-box:8443/v1/chat/completions: 401, "
            "Authorization: Bearer sk-secret-1")
    shown = config.redact(said)
    assert "pa55" not in shown and "sk-secret-1" not in shown
    assert shown == ("POST https://gpu-box:8443/v1/chat/completions: 401, "
                     "Authorization: Bearer ***")
    assert config.shown_url == "https://gpu-box:8443/v1"
    assert UpstreamConfig("plain", "http://box/v1").redact(said) == said   # nothing to hide
