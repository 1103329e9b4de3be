"""API keys, pure (core/auth.py) and as files (adapters/config_file.py), and the CLI's
`key new`, whose output the keys file takes as it is."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from gatewayd.adapters.config_file import load_config
from gatewayd.app import _warn_if_open
from gatewayd.cli import main
from gatewayd.core.auth import ADMIN, INFERENCE, digest, parse_keys, presented_key
from gatewayd.core.config import GatewayConfig
from gatewayd.core.errors import (
    ConfigError,
    InvalidApiKey,
    MissingApiKey,
    ScopeNotAllowed,
)


def test_identify_by_hash_with_scopes() -> None:
    ring = parse_keys({"keys": {"ci": {"sha256": digest("k1"), "models": ["Tiny-Alpha"],
                                       "scopes": ["inference", "admin"]}}}, "f")
    key = ring.identify("k1", ADMIN)
    assert key.name == "ci" and key.may_use("tiny-alpha") and not key.may_use("other")
    assert key.may_use("x", frozenset({"tiny-alpha"}))     # by an alias
    with pytest.raises(MissingApiKey):
        ring.identify(None, INFERENCE)
    with pytest.raises(InvalidApiKey):
        ring.identify("k2", INFERENCE)
    only = parse_keys({"keys": {"app": {"sha256": digest("k3")}}}, "f")
    assert only.identify("k3", INFERENCE).may_use("anything")   # defaults: *, inference
    with pytest.raises(ScopeNotAllowed):
        only.identify("k3", ADMIN)


def test_both_header_styles() -> None:
    assert presented_key("Bearer abc", None) == "abc"
    assert presented_key("bearer  abc ", "other") == "abc"
    assert presented_key(None, "xyz") == "xyz"
    assert presented_key("Basic Zm9v", "xyz") == "xyz"
    assert presented_key("Bearer ", None) is None and presented_key(None, " ") is None


@pytest.mark.parametrize("entry, message", [
    ({"sha256": "abc"}, "64 lowercase hex"),
    ({"sha256": "A" * 64}, "64 lowercase hex"),
    ({"sha256": "a" * 64, "scopes": ["root"]}, "unknown scope(s) root"),
    ({"sha256": "a" * 64, "models": "*"}, "models must be a list"),
    ({"sha256": "a" * 64, "key": "sk-plain"}, "unknown key(s) key"),
])
def test_a_bad_keys_file_is_refused_with_the_reason(entry: dict[str, object],
                                                    message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_keys({"keys": {"x": entry}}, "keys.toml")


def test_the_config_reads_the_keys_file_and_fails_closed(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[auth]\nkeys_file = "keys.toml"\n')
    with pytest.raises(ConfigError, match="no such file"):
        load_config(config)                        # never started without its keys
    (tmp_path / "keys.toml").write_text(f'[keys.a]\nsha256 = "{digest("k")}"\n')
    loaded = load_config(config)
    assert loaded.auth_keys_file == tmp_path / "keys.toml"
    assert loaded.api_keys is not None and loaded.api_keys.identify("k", INFERENCE).name == "a"


def test_key_new_prints_a_table_the_keys_file_takes(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    assert main(["key", "new", "my app", "--models", "tiny-alpha", "--scopes",
                 "inference,admin"]) == 0
    out = capsys.readouterr().out
    key = out.split("(shown only now): ")[1].split()[0]
    table = out[out.index("[keys."):]
    (tmp_path / "keys.toml").write_text(table)
    (tmp_path / "gateway.toml").write_text('[auth]\nkeys_file = "keys.toml"\n')
    ring = load_config(tmp_path / "gateway.toml").api_keys
    assert ring is not None and ring.identify(key, ADMIN).name == "my app"
    assert main(["--json", "key", "new", "x"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["sha256"] == digest(made["key"]) and made["scopes"] == ["inference"]
    assert main(["key", "new", "y", "--scopes", "root"]) == 1


def test_an_open_non_loopback_listener_is_warned_about(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    caplog.set_level(logging.WARNING, "gatewayd")
    _warn_if_open(GatewayConfig(listen_host="127.0.0.1"), None)
    assert not caplog.records
    _warn_if_open(GatewayConfig(listen_host="0.0.0.0"), None)
    assert "with no API keys: anyone who can reach it" in caplog.text
    caplog.clear()
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.bind(("::1", 0))      # a socket from systemd, on loopback: quiet
        _warn_if_open(GatewayConfig(listen_host="0.0.0.0"), sock)
    assert not caplog.records
    keyed = GatewayConfig(listen_host="0.0.0.0", api_keys=parse_keys({}, "f"))
    _warn_if_open(keyed, None)
    assert not caplog.records


def test_a_key_may_set_its_requests_priority() -> None:
    ring = parse_keys({"keys": {"batch": {"sha256": digest("k1"), "priority": "low"},
                                "app": {"sha256": digest("k2")}}}, "f")
    assert ring.identify("k1", INFERENCE).priority == 0
    assert ring.identify("k2", INFERENCE).priority is None      # the model's, then
    with pytest.raises(ConfigError, match="priority must be one of low, normal, high"):
        parse_keys({"keys": {"x": {"sha256": digest("k3"), "priority": "vip"}}}, "f")
