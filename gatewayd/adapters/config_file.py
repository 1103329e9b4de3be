"""Reading the configuration: the TOML file and the environment systemd gives us.

Parsing and validation are the core's (gatewayd.core.config); this adapter
finds the file, reads it, and supplies what comes from the process's
environment ($LLM_GATEWAY_CONFIG, systemd's $STATE_DIRECTORY, the working
directory for relative paths of a config given as text).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path

from gatewayd.core.auth import KeyRing, parse_keys
from gatewayd.core.config import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_STATE_DIR,
    GatewayConfig,
    parse_config,
)
from gatewayd.core.errors import ConfigError
from gatewayd.core.upstreams import UpstreamConfig


def load_config(path: Path | None = None, *, required: bool = False) -> GatewayConfig:
    """Read and validate the configuration file. A missing default file = defaults."""
    path = path or Path(os.environ.get("LLM_GATEWAY_CONFIG", DEFAULT_CONFIG_PATH))
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise ConfigError(f"config file {path} does not exist") from None
        return GatewayConfig(state_dir=default_state_dir())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    config = parse_config(data, source=path, state_dir=default_state_dir())
    if config.auth_keys_file is not None:
        config = dataclasses.replace(config, api_keys=load_keys(config.auth_keys_file))
    if any(u.api_key_file or u.api_key_credential for u in config.upstreams):
        config = dataclasses.replace(config, upstreams=tuple(
            dataclasses.replace(u, api_key=upstream_key(u)) for u in config.upstreams))
    return config


def upstream_key(upstream: UpstreamConfig) -> str | None:
    """The key an upstream is called with: from its api_key_file, or from the systemd
    credential named by api_key_credential ($CREDENTIALS_DIRECTORY/NAME, set up by
    LoadCredential= or SetCredentialEncrypted=). Unreadable or empty is a ConfigError:
    calling the upstream without it would only fail later, request by request."""
    where = f"[upstreams.{upstream.name}]"
    if upstream.api_key_credential is not None:
        directory = os.environ.get("CREDENTIALS_DIRECTORY")
        if not directory:
            raise ConfigError(
                f"{where} api_key_credential = {upstream.api_key_credential!r}: no systemd "
                "credentials here ($CREDENTIALS_DIRECTORY is unset); add LoadCredential="
                f"{upstream.api_key_credential}:/path/to/key to the service, or use "
                "api_key_file")
        path = Path(directory) / upstream.api_key_credential
    elif upstream.api_key_file is not None:
        path = upstream.api_key_file
    else:
        return None
    try:
        key = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the API key {path}: "
                          f"{e.strerror}") from e
    if not key:
        raise ConfigError(f"{where}: the API key file {path} is empty")
    return key


def load_keys(path: Path) -> KeyRing:
    """The API keys file. Unreadable or invalid is a ConfigError: a gateway told to check
    keys never starts (or reloads) without them."""
    where = f"[auth] keys_file {path}"
    try:
        return parse_keys(tomllib.loads(path.read_text()), where)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file (create it with `llm-gateway key new "
                          "NAME`, or remove [auth])") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML: {e}") from e
    except OSError as e:
        raise ConfigError(f"{where}: cannot read: {e.strerror}") from e


def default_state_dir() -> Path:
    """systemd's StateDirectory= (it sets $STATE_DIRECTORY), else /var/lib/llm-gateway."""
    given = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(given) if given else DEFAULT_STATE_DIR
