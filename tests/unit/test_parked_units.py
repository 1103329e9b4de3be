"""Parked engine units, without systemd: both waits' wake protocol run for real (the
preloaded wait in a real program, the shell on a FIFO), the parked unit's spec, and the
register of parked units. On the real systemd with a real llama-server:
tests/integration/test_unit_lifecycle.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gatewayd.adapters.parked_units import (
    ParkedUnit,
    ParkingLot,
    main_waits,
    preload_library,
    process_name,
    settle,
    takes_preload,
    wake,
)
from gatewayd.adapters.systemd import UNIT
from gatewayd.adapters.unit_control import TransientEngineUnits
from gatewayd.core.catalog import Model
from gatewayd.core.config import GatewayConfig, ModelConfig
from gatewayd.core.engine_units import (
    DEVICES_ENV,
    PARK_FIFO_ENV,
    PARK_PROGRAM_ENV,
    PARK_SCRIPT,
    PARK_SHELL,
    PARKED_COMM,
    PARKED_ENV,
    parked_spec,
    spec_digest,
    wake_line,
)
from gatewayd.core.unit_spec import UnitSpec

# the "engine": a real dynamically linked program (dash) that says what it was given
ENGINE = "/bin/sh"
ENV_PRINTER = [ENGINE, "-c", f'echo "devices=${{{DEVICES_ENV}-unset}} args=$*'
               ' preload=${LD_PRELOAD-unset}${LLM_GATEWAY_PARK_FIFO-}"', "engine"]
WAITS = ["preload", "shell"]


def preload() -> str:
    """The preloaded wait's library: scripts/setup builds it (a missing one is a broken
    build, not a reason to skip: the gateway would silently park behind the shell)."""
    library = preload_library()
    assert library is not None, "gatewayd/_engine_park*.so is not built (pip install -e .)"
    return library


def parked_engine(how: str, fifo: Path, *argv: str, env: dict[str, str] | None = None
                  ) -> subprocess.Popen[str]:
    """What a parked unit's ExecStart runs, with the environment its unit gives it."""
    spec = parked_spec(UnitSpec(name="u", argv=[*ENV_PRINTER, *argv],
                                environment=env or {}),
                       str(fifo), preload() if how == "preload" else None)
    return subprocess.Popen(list(spec.argv), stdout=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin", **spec.environment})


@pytest.mark.parametrize("how", WAITS)
async def test_a_woken_engine_runs_with_the_devices_it_is_told(
        tmp_path: Path, how: str) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    engine = parked_engine(how, fifo, "a b")
    try:
        await asyncio.sleep(0)
        # waits for the engine to reach the FIFO (ENXIO until then), then wakes it
        assert await wake(fifo, b"GPU-1,GPU-2\n", wait_s=10)
        out, _ = engine.communicate(timeout=10)
    finally:
        engine.kill()
    # the preloaded wait leaves the engine's children a plain environment
    assert out.strip() == "devices=GPU-1,GPU-2 args=a b preload=unset"
    assert not fifo.exists()   # a restart of the unit runs the engine at once


@pytest.mark.parametrize("how", WAITS)
async def test_keep_devices_leaves_the_units_own_environment(
        tmp_path: Path, how: str) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    engine = parked_engine(how, fifo, env={DEVICES_ENV: "3"})
    try:
        assert await wake(fifo, b"-\n", wait_s=10)
        out, _ = engine.communicate(timeout=10)
    finally:
        engine.kill()
    assert out.strip() == "devices=3 args= preload=unset"


async def test_the_preloaded_engine_waits_linked_and_named_parked(tmp_path: Path) -> None:
    """It is the engine program itself, blocked before its main(), under a name that
    tells the gateway it still waits; its own name comes back once woken."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    engine = parked_engine("preload", fifo)
    try:
        assert await settle(engine.pid, str(tmp_path / "engine.sock"), 10, PARKED_COMM)
        assert process_name(engine.pid) == PARKED_COMM and main_waits(engine.pid)
        assert Path(f"/proc/{engine.pid}/exe").resolve() == Path(ENGINE).resolve()
        await asyncio.sleep(0.05)
        assert engine.poll() is None   # still waiting: nothing ran its main()
        assert await wake(fifo, b"-\n", wait_s=10)
        out, _ = engine.communicate(timeout=10)
    finally:
        engine.kill()
    assert out.strip() == "devices=unset args= preload=unset"


def test_the_units_other_commands_do_not_wait(tmp_path: Path) -> None:
    """The unit's environment reaches its ExecStartPre too: only the engine waits."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    spec = parked_spec(UnitSpec(name="u", argv=["/usr/bin/llama-server"]), str(fifo),
                       preload())
    out = subprocess.run([*ENV_PRINTER, "pre"], capture_output=True, text=True, timeout=10,
                         env={"PATH": "/usr/bin:/bin", **spec.environment}).stdout
    assert out.strip() == "devices=unset args=pre preload=unset"


async def test_a_wake_line_that_cannot_be_written_is_no_wake(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Then the caller stops the unit and starts a new one (the engine, told nothing,
    would run without the devices placement chose)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    shell = parked_engine("preload", fifo)
    real_write = os.write

    def failing_write(fd: int, data: bytes) -> int:
        if data == b"GPU-1\n":
            raise OSError(5, "Input/output error")
        return real_write(fd, data)
    monkeypatch.setattr("gatewayd.adapters.parked_units.os.write", failing_write)
    try:
        assert not await wake(fifo, b"GPU-1\n", wait_s=10)
    finally:
        shell.kill()
        shell.wait()


@pytest.mark.parametrize("how", WAITS)
def test_without_its_fifo_the_engine_runs_at_once(tmp_path: Path, how: str) -> None:
    """systemd's restart of a crashed engine: the same ExecStart, the FIFO gone."""
    out = parked_engine(how, tmp_path / "gone").communicate(timeout=10)[0]
    assert out.strip() == "devices=unset args= preload=unset"
    (tmp_path / "file").write_text("")
    out = parked_engine(how, tmp_path / "file").communicate(timeout=10)[0]
    assert out.strip() == "devices=unset args= preload=unset"


async def test_a_preload_that_does_not_take_is_told_from_a_wait(tmp_path: Path) -> None:
    """settle: a program that went on instead of waiting (its socket appeared), or one
    that never came to wait, is no parked unit."""
    sock = tmp_path / "engine.sock"
    busy = subprocess.Popen(["/bin/sleep", "30"])
    try:
        t0 = time.monotonic()
        assert not await settle(busy.pid, str(sock), 0.1, PARKED_COMM)
        assert time.monotonic() - t0 >= 0.1
        sock.write_text("")
        t0 = time.monotonic()
        assert not await settle(busy.pid, str(sock), 10, PARKED_COMM)
        assert time.monotonic() - t0 < 5
    finally:
        busy.kill()
        busy.wait()
    assert not await settle(busy.pid, str(sock), 10, PARKED_COMM)   # ended


def test_the_library_is_found_where_ld_preload_can_name_it(tmp_path: Path) -> None:
    name = Path(preload()).name
    for folder, found in (("plain", True), ("with space", False), ("with:colon", False)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_bytes(b"")
        assert (preload_library(tmp_path / folder) is not None) is found
    assert preload_library(tmp_path / "missing") is None


def test_which_programs_take_the_preloaded_wait(tmp_path: Path) -> None:
    assert takes_preload(ENGINE)                   # dynamically linked against glibc
    assert takes_preload(os.path.realpath(sys.executable))
    assert not takes_preload("/sbin/ldconfig")     # static: it would run at once
    (tmp_path / "script").write_text("#!/bin/sh\n")
    assert not takes_preload(str(tmp_path / "script"))
    assert not takes_preload(str(tmp_path / "missing"))


async def test_a_fifo_nobody_reads_or_no_fifo_is_no_wake(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    t0 = time.monotonic()
    assert not await wake(fifo, b"-\n", wait_s=0.05)
    assert time.monotonic() - t0 >= 0.05
    assert fifo.exists()            # not unlinked: nothing was woken
    assert not await wake(tmp_path / "missing", b"-\n")
    (tmp_path / "file").write_text("")
    assert not await wake(tmp_path / "file", b"-\n")


def test_a_preloaded_parked_spec_runs_the_engines_own_command_line() -> None:
    engine = UnitSpec(name="llm-engine-x.service", argv=["/usr/bin/llama-server", "-m", "$x"],
                      environment={"A": "1"})
    parked = parked_spec(engine, "/state/parked/x", "/lib/park.so")
    assert parked.argv == engine.argv and parked.name == engine.name
    assert parked.environment == {"A": "1", PARKED_ENV: spec_digest(engine),
                                  "LD_PRELOAD": "/lib/park.so", "LD_BIND_NOW": "1",
                                  PARK_FIFO_ENV: "/state/parked/x",
                                  PARK_PROGRAM_ENV: "/usr/bin/llama-server"}
    # a model that preloads something of its own waits behind the shell
    own = UnitSpec(name=engine.name, argv=engine.argv, environment={"LD_PRELOAD": "/x.so"})
    assert parked_spec(own, "/f", "/lib/park.so").argv[0] == PARK_SHELL


def test_a_parked_spec_wraps_the_engine_and_names_it() -> None:
    engine = UnitSpec(name="llm-engine-x.service", argv=["/usr/bin/llama-server", "-m", "$x"],
                      environment={"A": "1"})
    parked = parked_spec(engine, "/state/parked/x")
    assert list(parked.argv) == [PARK_SHELL, "-c", PARK_SCRIPT, "/state/parked/x",
                                 "/usr/bin/llama-server", "-m", "$x"]
    assert parked.environment == {"A": "1", PARKED_ENV: spec_digest(engine)}
    assert parked.name == engine.name
    (exec_start,) = dict((k, v) for k, _, v in parked.properties())["ExecStart"]
    # systemd's $VAR expansion is defeated for the script as for the engine's arguments
    assert exec_start[1][2] == PARK_SCRIPT.replace("$", "$$")
    assert exec_start[1][-1] == "$$x"
    other = UnitSpec(name=engine.name, argv=engine.argv, environment={"A": "2"})
    assert spec_digest(other) != spec_digest(engine)


def test_the_wake_line_passes_placements_devices_unless_the_model_names_its_own() -> None:
    plain = UnitSpec(name="u", argv=["/bin/x"])
    named = UnitSpec(name="u", argv=["/bin/x"], environment={DEVICES_ENV: "0"})
    assert wake_line(plain, None) == b"-\n"
    assert wake_line(plain, "GPU-a,GPU-b") == b"GPU-a,GPU-b\n"
    assert wake_line(named, "GPU-a") == b"-\n"
    assert wake_line(plain, "1\n2") == b"-\n"   # one line, never two


def test_the_register_holds_back_parked_units_signals_until_woken(tmp_path: Path) -> None:
    lot = ParkingLot(tmp_path / "parked", limit=2)
    fifo = lot.make_fifo("x")
    assert fifo.exists() and oct(fifo.stat().st_mode & 0o777) == "0o600"
    lot.hidden.add("u.service")
    lot.parked["u.service"] = ParkedUnit("u.service", "d", fifo, 1.0, {"MainPID": 5})
    assert lot.seen("u.service", {"MainPID": 6})
    assert lot.parked["u.service"].props["MainPID"] == 6
    assert not lot.seen("other.service", {"ActiveState": "active"})
    # stopped behind the gateway's back: forgotten, its FIFO removed
    assert lot.seen("u.service", {"ActiveState": "inactive"})
    assert "u.service" not in lot.parked and "u.service" not in lot.hidden
    assert not fifo.exists()


def test_the_least_recently_parked_go_first_beyond_the_limit(tmp_path: Path) -> None:
    lot = ParkingLot(tmp_path, limit=2)
    for name, at in (("a", 3.0), ("b", 1.0), ("c", 2.0), ("d", 4.0)):
        lot.parked[name] = ParkedUnit(name, "", tmp_path / name, at)
    lot.parked["b"].model_id, lot.parked["a"].model_id = "model-b", "model-a"
    assert lot.models() == ["model-b", "model-a"]   # least recently parked first
    assert [p.unit for p in lot.surplus()] == ["b", "c"]
    assert sorted(lot.parked) == ["a", "d"]
    assert lot.surplus() == []


def test_what_marks_a_unit_as_parked(tmp_path: Path) -> None:
    lot = ParkingLot(tmp_path, limit=2)
    marked = {PARKED_ENV: "digest"}
    assert not lot.is_parked("u", "x", {}, os.getpid())
    assert not lot.is_parked("u", "x", marked, os.getpid())   # woken: no FIFO, not a shell
    lot.make_fifo("x")
    assert lot.is_parked("u", "x", marked, os.getpid())        # its FIFO waits
    assert not lot.is_parked("u", "x", {}, os.getpid())        # never parked
    shell = subprocess.Popen([PARK_SHELL, "-c", "read x"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not main_waits(shell.pid):   # until the forked child has exec'd sh
            assert time.monotonic() < deadline, "the shell never ran"
            time.sleep(0.001)
        assert lot.is_parked("u", "y", marked, shell.pid)   # no FIFO, but still the shell
    finally:
        shell.kill()
        shell.wait()
    assert not main_waits(0) and not main_waits(os.getpid())


async def test_a_start_waits_for_a_discard_of_its_unit(tmp_path: Path) -> None:
    lot = ParkingLot(tmp_path, limit=1)
    stopping = asyncio.Event()
    stopped: list[str] = []

    async def stop(unit: str) -> None:
        await stopping.wait()
        stopped.append(unit)
    parked = ParkedUnit("u", "", lot.make_fifo("u"), 1.0)
    lot.hidden.add("u")
    lot.discard(parked, stop)
    settled = asyncio.ensure_future(lot.settled("u"))
    await asyncio.sleep(0.01)
    assert not settled.done() and "u" in lot.hidden
    stopping.set()
    await asyncio.wait_for(settled, 5)
    assert stopped == ["u"] and "u" not in lot.hidden
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize("failing", [True, False])
async def test_a_discard_that_fails_still_ends(tmp_path: Path, failing: bool) -> None:
    lot = ParkingLot(tmp_path, limit=1)

    async def stop(unit: str) -> None:
        if failing:
            raise RuntimeError("bus gone")
    lot.hidden.add("u")
    await lot.discard(ParkedUnit("u", "", tmp_path / "u", 1.0), stop)
    assert "u" not in lot.hidden
    await asyncio.wait_for(lot.settled("u"), 1)


def test_a_unit_parked_for_these_very_objects_needs_no_new_spec(tmp_path: Path) -> None:
    """A start for the model and configuration objects it was parked for wakes it with
    the spec made at the park; equal but other objects (a reload, a rescan) make it anew
    and compare digests; one found parked by a previous gateway knows none."""
    spec = UnitSpec(name="u", argv=["/bin/x"])
    model, config = object(), object()
    parked = ParkedUnit("u", spec_digest(spec), tmp_path / "u", 1.0, spec=spec,
                        made_for=(model, config))
    assert parked.made_from(model, config) is spec
    assert parked.made_from(object(), config) is None
    assert parked.made_from(model, object()) is None
    assert ParkedUnit("u", "d", tmp_path / "u", 1.0).made_from(model, config) is None


async def test_the_surplus_is_discarded_all_at_once(tmp_path: Path) -> None:
    """Each surplus unit's discard is under way before any ends: a start of its model
    waits for it instead of meeting the unit still running with no entry."""
    lot = ParkingLot(tmp_path, limit=1)
    for name, at in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        lot.parked[name] = ParkedUnit(name, "", tmp_path / name, at)
        lot.hidden.add(name)
    release = asyncio.Event()
    stopping: list[str] = []

    async def stop(unit: str) -> None:
        stopping.append(unit)
        await release.wait()
    tasks = lot.discard_surplus(stop)
    await asyncio.sleep(0)
    assert sorted(stopping) == ["a", "b"] and list(lot.parked) == ["c"]
    settled = asyncio.ensure_future(lot.settled("b"))
    await asyncio.sleep(0.01)
    assert not settled.done() and "b" in lot.hidden
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks, settled), 5)
    assert lot.hidden == {"c"}


class _Listing:
    """What systemd says about one unit (the parked unit, and the engine it became)."""

    def __init__(self, unit: str, pid: int, env: dict[str, str]) -> None:
        self.unit, self.pid, self.env = unit, pid, env

    async def properties(self, unit: str, interface: str) -> dict[str, Any]:
        assert unit == self.unit
        if interface == UNIT:
            return {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}
        return {"MainPID": self.pid, "NRestarts": 0,
                "Environment": [f"{k}={v}" for k, v in self.env.items()]}


async def test_a_woken_engine_still_named_as_waiting_is_not_taken_for_parked(
        tmp_path: Path) -> None:
    """Right after a wake, until the engine's process runs again (a loaded machine:
    milliseconds), it is still named as waiting and its FIFO is gone. A listing then
    (the reconciler's) must see the engine, not adopt a parked unit: adopted, the
    engine's signals were held back and a surplus discard stopped it unheard (the soak
    saw the gateway say "loading" for a unit systemd no longer had)."""
    model_file = tmp_path / "m.gguf"
    model_file.write_bytes(b"GGUF")
    model = Model(id="woken", config=ModelConfig(name="woken", path=model_file),
                  names=frozenset({"woken"}), size_bytes=4)
    config = GatewayConfig(llama_server=ENGINE, state_dir=tmp_path, parked_engines=2)
    listing = _Listing("", 0, {})
    units = TransientEngineUnits(listing, config, manager="user",  # type: ignore[arg-type]
                                 run_root=str(tmp_path / "run"))
    layout = units.layout(model.id)
    spec = units._specs(model, layout)(None)
    fifo = units._lot.make_fifo(layout.instance)
    # a woken shell park that has read its line but not yet exec'd the engine
    waiting = subprocess.Popen([PARK_SHELL, "-c", f'read x < "{fifo}"; sleep 30; :'])
    try:
        units._lot.parked[layout.unit] = ParkedUnit(
            layout.unit, spec_digest(spec), fifo, time.time(),
            {"ActiveState": "active", "MainPID": waiting.pid}, model_id=model.id,
            spec=spec, made_for=(model, config))
        units._lot.hidden.add(layout.unit)
        listing.unit, listing.pid = layout.unit, waiting.pid
        listing.env = {**spec.environment, PARKED_ENV: spec_digest(spec)}
        assert await units.engine_info(layout.unit) is None   # parked: no engine yet
        assert await units.start_engine(model) == layout       # woken
        assert not fifo.exists() and main_waits(waiting.pid)
        info = await units.engine_info(layout.unit)
        assert info is not None and info.main_pid == waiting.pid
        assert layout.unit not in units._lot.hidden and units.parked() == []
    finally:
        waiting.kill()
        waiting.wait()
