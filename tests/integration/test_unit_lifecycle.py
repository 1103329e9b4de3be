"""The engine-unit adapter's lifecycle promises, on a real systemd with a real llama-server.

- a stop returns only once the transient unit is gone, so the next StartTransientUnit of
  the same name never meets the previous instance ("already loaded" under sustained load
  with eviction was the start of a collapse);
- systemd already running the unit is reported as UnitAlreadyActive (to be adopted), not
  as a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gatewayd.adapters.systemd import SERVICE, Systemd
from gatewayd.adapters.unit_control import TransientEngineUnits
from gatewayd.core.catalog import Model
from gatewayd.core.config import GatewayConfig, ModelConfig
from gatewayd.core.errors import UnitAlreadyActive
from tests.integration.engine_helpers import stop_quietly, wait_healthy

pytestmark = [pytest.mark.systemd, pytest.mark.engine]


def _model(name: str, path: Path) -> Model:
    return Model(id=name, config=ModelConfig(name=name, path=path, threads=1, ctx_size=512),
                 names=frozenset({name}), size_bytes=path.stat().st_size)


def _engine_units(systemd: Systemd, llama_server: Path, state: Path) -> TransientEngineUnits:
    config = GatewayConfig(llama_server=str(llama_server), state_dir=state)
    return TransientEngineUnits(systemd, config, manager="system", run_root="/run")


async def test_stop_then_start_of_one_unit_back_to_back_never_collides(
        systemd: Systemd, llama_server: Path, tiny_models: dict[str, Path],
        tmp_path: Path) -> None:
    units = _engine_units(systemd, llama_server, tmp_path)
    model = _model("lifecycle-a", tiny_models["alpha"])
    layout = units.layout(model.id)
    pids = []
    try:
        for _ in range(6):
            await units.start_engine(model)
            await wait_healthy(layout.socket)
            pids.append((await systemd.properties(layout.unit, SERVICE))["MainPID"])
            await units.stop_engine(layout.unit)
            # gone, not merely inactive: a start right now creates a new unit
            assert not await systemd.unit_loaded(layout.unit)
        assert len(set(pids)) == 6 and all(pids)
    finally:
        await stop_quietly(systemd, layout.unit)


async def test_starting_a_unit_systemd_already_runs_says_so(
        systemd: Systemd, llama_server: Path, tiny_models: dict[str, Path],
        tmp_path: Path) -> None:
    units = _engine_units(systemd, llama_server, tmp_path)
    model = _model("lifecycle-b", tiny_models["beta"])
    layout = units.layout(model.id)
    try:
        await units.start_engine(model)
        await wait_healthy(layout.socket)
        pid = (await systemd.properties(layout.unit, SERVICE))["MainPID"]
        with pytest.raises(UnitAlreadyActive):
            await units.start_engine(model)
        info = await units.engine_info(layout.unit)   # untouched: the same process runs
        assert info is not None and info.main_pid == pid and info.active_state == "active"
    finally:
        await stop_quietly(systemd, layout.unit)
