"""The engine-unit adapter's lifecycle promises, on a real systemd with a real llama-server.

- a stop returns only once the transient unit is gone, so the next StartTransientUnit of
  the same name never meets the previous instance ("already loaded" under sustained load
  with eviction was the start of a collapse);
- systemd already running the unit is reported as UnitAlreadyActive (to be adopted), not
  as a failure;
- a parked unit is no engine (not listed, its signals held back) until a start wakes it
  into one, in place (the same MainPID, now llama-server); systemd's restart of that
  engine goes straight to the engine; a parked unit for another setup, or beyond
  parked_engines, is stopped; one parked by a previous gateway is found and woken;
- it waits as llama-server itself with the preloaded wait (linked, named llm-parked),
  behind /bin/sh without the library, and behind /bin/sh from then on where the preload
  did not take (the engine went on loading: stopped at once).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gatewayd.adapters.systemd import SERVICE, Systemd
from gatewayd.adapters.unit_control import TransientEngineUnits
from gatewayd.core.catalog import Model
from gatewayd.core.config import GatewayConfig, ModelConfig
from gatewayd.core.engine_units import PARKED_COMM
from gatewayd.core.errors import UnitAlreadyActive
from tests.integration.engine_helpers import stop_quietly, wait_for, wait_healthy

pytestmark = [pytest.mark.systemd, pytest.mark.engine]


def _model(name: str, path: Path) -> Model:
    return Model(id=name, config=ModelConfig(name=name, path=path, threads=1, ctx_size=512),
                 names=frozenset({name}), size_bytes=path.stat().st_size)


def _engine_units(systemd: Systemd, llama_server: Path, state: Path,
                  parked_engines: int = 4) -> TransientEngineUnits:
    config = GatewayConfig(llama_server=str(llama_server), state_dir=state,
                           parked_engines=parked_engines)
    return TransientEngineUnits(systemd, config, manager="system", run_root="/run")


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


async def _main_pid(systemd: Systemd, unit: str) -> int:
    return int((await systemd.properties(unit, SERVICE))["MainPID"])


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


@pytest.mark.parametrize("how", ["preload", "shell"])
async def test_a_parked_unit_is_no_engine_until_a_start_wakes_it_in_place(
        systemd: Systemd, llama_server: Path, tiny_models: dict[str, Path],
        tmp_path: Path, how: str) -> None:
    units = _engine_units(systemd, llama_server, tmp_path)
    if how == "shell":
        units._preload = None    # as where the library was not built
    else:
        assert units._preload is not None, "the preloaded wait is not built"
    heard: list[tuple[str, dict[str, Any]]] = []

    def listen(unit: str, changed: Mapping[str, Any]) -> None:
        heard.append((unit, dict(changed)))
    units.watch(listen)
    model = _model("parked-a", tiny_models["alpha"])
    layout = units.layout(model.id)
    try:
        assert await units.park(model)
        parked_pid = await _main_pid(systemd, layout.unit)
        assert parked_pid and _comm(parked_pid) == (PARKED_COMM if how == "preload" else "sh")
        if how == "preload":   # the engine program itself, linked, before its main()
            assert Path(f"/proc/{parked_pid}/exe").resolve() == llama_server.resolve()
        assert (tmp_path / "parked" / layout.instance).exists()
        assert not Path(layout.socket).exists()
        # no engine: not listed, no engine_info, none of its signals heard
        assert layout.unit not in [i.unit for i in await units.list_engines()]
        assert await units.engine_info(layout.unit) is None
        assert [u for u, _ in heard if u == layout.unit] == []

        t0 = time.monotonic()
        await units.start_engine(model)
        await wait_healthy(layout.socket, timeout=30)
        took = time.monotonic() - t0
        # the same process, now the engine: woken, not created anew
        assert await _main_pid(systemd, layout.unit) == parked_pid
        assert _comm(parked_pid) == "llama-server"
        assert not (tmp_path / "parked" / layout.instance).exists()
        # the engine layer heard the unit run, as for a start
        assert (layout.unit, {"ActiveState": "active", "SubState": "running",
                              "MainPID": parked_pid, "NRestarts": 0}) in heard
        info = await units.engine_info(layout.unit)
        assert info is not None and info.main_pid == parked_pid and info.model_id == model.id
        assert layout.unit in [i.unit for i in await units.list_engines()]
        print(f"woken and healthy in {took * 1000:.1f} ms")

        # systemd's restart of the crashed engine goes straight to the engine
        os.kill(parked_pid, signal.SIGKILL)

        async def restarted() -> bool:
            pid = await _main_pid(systemd, layout.unit)
            return pid not in (0, parked_pid) and _comm(pid) == "llama-server"
        await wait_for(restarted, timeout=20, what="the engine restarted by systemd")
        await wait_healthy(layout.socket, timeout=30)
        await units.stop_engine(layout.unit)
        assert not await systemd.unit_loaded(layout.unit)
    finally:
        await stop_quietly(systemd, layout.unit)


async def test_where_the_preload_does_not_take_the_unit_parks_behind_the_shell(
        systemd: Systemd, llama_server: Path, tiny_models: dict[str, Path],
        tmp_path: Path) -> None:
    """A library that holds nothing (as the wait would be in a program it cannot
    interpose): the engine goes on loading, is stopped, and the model is parked behind
    the shell instead, for this park and the next."""
    units = _engine_units(systemd, llama_server, tmp_path)
    units._preload = "libm.so.6"    # loads fine, waits for nothing
    model = _model("parked-f", tiny_models["alpha"])
    layout = units.layout(model.id)
    try:
        assert await units.park(model)
        parked_pid = await _main_pid(systemd, layout.unit)
        assert _comm(parked_pid) == "sh"
        assert units._takes_preload[str(llama_server)] is False
        await units.start_engine(model)
        await wait_healthy(layout.socket, timeout=30)
        assert await _main_pid(systemd, layout.unit) == parked_pid
    finally:
        await stop_quietly(systemd, layout.unit)


async def test_a_parked_unit_for_another_setup_is_replaced_by_a_new_unit(
        systemd: Systemd, llama_server: Path, tiny_models: dict[str, Path],
        tmp_path: Path) -> None:
    units = _engine_units(systemd, llama_server, tmp_path)
    model = _model("parked-b", tiny_models["beta"])
    layout = units.layout(model.id)
    try:
        assert await units.park(model)
        parked_pid = await _main_pid(systemd, layout.unit)
        changed = replace(model, config=replace(model.config, ctx_size=256))
        await units.start_engine(changed)
        await wait_healthy(layout.socket, timeout=30)
        pid = await _main_pid(systemd, layout.unit)
        assert pid != parked_pid and _comm(pid) == "llama-server"
        info = await units.engine_info(layout.unit)
        assert info is not None and info.main_pid == pid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"-c") + 1] == b"256"
    finally:
        await stop_quietly(systemd, layout.unit)


async def test_units_parked_by_a_previous_gateway_are_found_and_woken(
        systemd: Systemd, llama_server: Path, tiny_models: dict[str, Path],
        tmp_path: Path) -> None:
    model = _model("parked-c", tiny_models["gamma"])
    before = _engine_units(systemd, llama_server, tmp_path)
    layout = before.layout(model.id)
    try:
        assert await before.park(model)
        parked_pid = await _main_pid(systemd, layout.unit)
        after = _engine_units(systemd, llama_server, tmp_path)   # a restarted gateway
        assert layout.unit not in [i.unit for i in await after.list_engines()]
        await after.start_engine(model)
        await wait_healthy(layout.socket, timeout=30)
        assert await _main_pid(systemd, layout.unit) == parked_pid
        assert _comm(parked_pid) == "llama-server"
    finally:
        await stop_quietly(systemd, layout.unit)


async def test_parked_units_beyond_the_limit_are_stopped_oldest_first(
        systemd: Systemd, llama_server: Path, tiny_models: dict[str, Path],
        tmp_path: Path) -> None:
    units = _engine_units(systemd, llama_server, tmp_path, parked_engines=1)
    first, second = _model("parked-d", tiny_models["alpha"]), _model("parked-e",
                                                                     tiny_models["beta"])
    try:
        assert await units.park(first)
        assert await units.park(second)
        assert not await systemd.unit_loaded(units.layout(first.id).unit)
        assert not (tmp_path / "parked" / units.layout(first.id).instance).exists()
        assert _comm(await _main_pid(systemd, units.layout(second.id).unit)) == PARKED_COMM
        # the stopped one starts anew
        await units.start_engine(first)
        await wait_healthy(units.layout(first.id).socket, timeout=30)
        # a reload to parked_engines = 0 stops the one left parked
        units.reconfigure(replace(units._config, parked_engines=0))
        second_unit = units.layout(second.id).unit

        async def gone() -> bool:
            return not await systemd.unit_loaded(second_unit)
        await wait_for(gone, timeout=20, what="the parked unit stopped by the reload")
        assert await units.engine_info(units.layout(first.id).unit) is not None
    finally:
        for m in (first, second):
            await stop_quietly(systemd, units.layout(m.id).unit)
