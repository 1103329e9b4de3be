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
    return config


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
