"""Fixtures for tests that run the real gateway inside the test container."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

from tests.integration.gateway_helpers import GatewayService, stop_all_engine_units, toml_str

_ports = iter(range(18300, 18480))
# the tests drive the admin API over the gateway's port (a loopback workstation's choice);
# the admin socket alone, the default, is tested on its own (test_admin_socket_e2e)
ADMIN_ON_PORT = "[admin]\npublic = true\n"


class GatewayFactory(Protocol):
    def __call__(self, extra: str = "", max_engines: int = 4,
                 env: dict[str, str] | None = None,
                 llama_server_setting: str | None = None,
                 load_timeout_s: float = 60) -> GatewayService: ...


def write_config(tmp_path: Path, llama_server: Path | str, tiny_models: dict[str, Path], *,
                 extra: str = "", max_engines: int = 4,
                 load_timeout_s: float = 60) -> tuple[Path, int]:
    """A config over the three tiny models; extra goes before [listen] (top-level keys, tables)."""
    port = next(_ports)
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    for name in ("alpha", "beta", "gamma"):
        link = models / f"tiny-{name}.gguf"
        if not link.exists():
            link.symlink_to(tiny_models[name])
    config = tmp_path / "gateway.toml"
    config.write_text(f"""
models_dir = {toml_str(str(models))}
llama_server = {toml_str(str(llama_server))}
state_dir = {toml_str(str(tmp_path / "state"))}
max_engines = {max_engines}
load_timeout_s = {load_timeout_s}
{extra}
[listen]
port = {port}
{"" if "[admin]" in extra else ADMIN_ON_PORT}""")
    return config, port


@pytest.fixture
def gateway_factory(tmp_path: Path, llama_server: Path,
                    tiny_models: dict[str, Path]) -> Iterator[GatewayFactory]:
    started: list[GatewayService] = []

    def make(extra: str = "", max_engines: int = 4,
             env: dict[str, str] | None = None,
             llama_server_setting: str | None = None,
             load_timeout_s: float = 60) -> GatewayService:
        config, port = write_config(tmp_path, llama_server_setting or llama_server,
                                    tiny_models, extra=extra, max_engines=max_engines,
                                    load_timeout_s=load_timeout_s)
        gw = GatewayService(config, port, env=env or {})
        gw.start()
        started.append(gw)
        return gw
    yield make
    for gw in started:
        gw.stop()
    stop_all_engine_units()


@pytest.fixture
def gateway(gateway_factory: GatewayFactory) -> GatewayService:
    return gateway_factory()
