"""Memory where a user looks (issue 36): each engine's RAM and VRAM, estimated and
measured with the source of each figure, and each budget's free and used, in /v1/models,
/admin/status, /admin/engines and /admin/metrics; an answer for an engine killed for want
of memory is recorded with its code and the kill counted as one. Over real HTTP, the
engine layer on a fake systemd, a fake /proc/meminfo and a fake cgroup meter."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gatewayd.adapters.gpu import FakeGpu
from gatewayd.core.engines import EngineState
from tests.http.test_front_door import Gateway, _gateway, chat
from tests.unit.test_ram_budget import Book, FakeHost, FakeMeter, oom_kill

MIB = 1 << 20
FILES_MIB = 3            # each fake model's file (tests/fakes.py)
RAM_MARGIN_MIB = 256     # [memory] ram_margin_mib's default: a need without a GPU is files + it


def on_ram(tmp_path: Path, meter: FakeMeter | None = None, **kw: Any) -> Any:
    """A gateway whose RAM is checked: 64000 MiB, 60000 available; each engine's cgroup
    holds 3 MiB."""
    return _gateway(tmp_path, ("a",), host=FakeHost(), meter=meter or FakeMeter(), **kw)


async def json_of(gw: Gateway, path: str) -> Any:
    resp = await gw.client.get(path)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_a_model_object_has_each_memorys_estimate_measure_and_their_sources(
        tmp_path: Path) -> None:
    meter = FakeMeter(holds=400)   # more than its files and the margin
    async for gw in on_ram(tmp_path, meter, learned_ram=Book()):
        meter.peak[f"/system.slice/{gw.units.layout('a').unit}"] = 500
        rows = {m["id"]: m for m in (await json_of(gw, "/v1/models"))["data"]}
        a, b = rows["a"], rows["b"]
        # a ran: its RAM need is what its cgroup was seen holding at its peak (learned),
        # being more than the files-based figure (a learned figure only ever raises it)
        assert (a["ram_estimate_mib"], a["ram_estimate_source"]) == (400, "learned")
        assert (a["ram_measured_mib"], a["ram_measured_source"], a["ram_peak_mib"]) == (
            400, "cgroup", 500)
        # b never ran: no GPU, so its files in RAM and the margin; nothing measured
        assert (b["ram_estimate_mib"], b["ram_estimate_source"]) == (
            FILES_MIB + RAM_MARGIN_MIB, "files")
        assert b["ram_measured_mib"] is b["ram_measured_source"] is b["ram_peak_mib"] is None
        assert (a["vram_estimate_mib"], a["vram_estimate_source"]) == (FILES_MIB + 100, "files")
        assert a["vram_measured_mib"] is None
        one = await json_of(gw, "/v1/models/a")
        assert one == a
        await gw.client.post("/admin/engines/stop", json={"model": "a"})
        a = await json_of(gw, "/v1/models/a")
        assert a["ram_measured_mib"] is None and a["ram_estimate_source"] == "learned"


async def test_status_has_the_ram_budget_beside_the_gpus(tmp_path: Path) -> None:
    async for gw in on_ram(tmp_path):
        ram = (await json_of(gw, "/admin/status"))["ram_memory_mib"]
        need = FILES_MIB + RAM_MARGIN_MIB
        assert ram == {"total_mib": 64000, "available_mib": 60000, "reserve_mib": 1024,
                       "budget_mib": None, "claimed_mib": need, "held_mib": 3,
                       "pending_mib": 0, "free_for_planning_mib": 60000 - 1024}
    (tmp_path / "no-ram").mkdir()
    async for gw in _gateway(tmp_path / "no-ram", ("a",)):
        assert (await json_of(gw, "/admin/status"))["ram_memory_mib"] is None


async def test_engines_show_ram_its_source_and_the_need(tmp_path: Path) -> None:
    async for gw in on_ram(tmp_path):
        (engine,) = (await json_of(gw, "/admin/engines"))["engines"]
        assert (engine["ram_bytes"], engine["ram_peak_bytes"], engine["ram_source"]) == (
            3 * MIB, 3 * MIB, "cgroup")
        assert (engine["ram_need_mib"], engine["ram_need_source"]) == (
            FILES_MIB + RAM_MARGIN_MIB, "files")
        # no GPU: nothing to need there
        assert engine["vram_need_mib"] is engine["vram_need_source"] is None
        # systemd has no MemoryCurrent (a cgroup-v1 host): the meter's reading stands in
        assert engine["memory_bytes"] == 3 * MIB
        unit = gw.units.layout("a").unit
        gw.units.units[unit] = replace(gw.units.units[unit], memory_bytes=7 * MIB)
        (engine,) = (await json_of(gw, "/admin/engines"))["engines"]
        assert engine["memory_bytes"] == 7 * MIB and engine["ram_bytes"] == 3 * MIB


async def test_engines_with_a_gpu_show_the_vram_need(tmp_path: Path) -> None:
    async for gw in on_ram(tmp_path, gpu=FakeGpu(8000, 6000)):
        (engine,) = (await json_of(gw, "/admin/engines"))["engines"]
        assert (engine["vram_need_mib"], engine["vram_need_source"]) == (
            FILES_MIB + 100, "files")


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def test_metrics_give_each_engines_memory_and_each_budget(tmp_path: Path) -> None:
    async for gw in on_ram(tmp_path, gpu=FakeGpu(8000, 6000)):
        m = samples(await (await gw.client.get("/admin/metrics")).text())

        def engine(memory: str, figure: str, m: Samples = m) -> float | None:
            return m.get(("llm_gateway_memory_engine_bytes", (
                ("figure", figure), ("memory", memory), ("model", "a"))))

        def budget(memory: str, figure: str, m: Samples = m) -> float | None:
            return m.get(("llm_gateway_memory_budget_bytes", (
                ("figure", figure), ("memory", memory))))
        assert engine("ram", "need") == RAM_MARGIN_MIB * MIB   # its weights go to the GPU
        assert engine("ram", "measured") == engine("ram", "peak") == 3 * MIB
        assert engine("vram", "need") == (FILES_MIB + 100) * MIB
        assert engine("vram", "measured") is None       # NVML shows no process of it
        assert [budget("ram", f) for f in ("total", "available", "reserve", "free")] == [
            64000 * MIB, 60000 * MIB, 1024 * MIB, (60000 - 1024) * MIB]
        assert budget("ram", "claimed") == RAM_MARGIN_MIB * MIB
        assert budget("ram", "pending") == 0 and budget("ram", "budget") is None
        assert [budget("gpu", f) for f in ("total", "available", "pending")] == [
            8000 * MIB, 6000 * MIB, 0]
        assert budget("gpu", "free") is not None and budget("gpu", "reserve") is None


async def test_an_answer_for_an_oom_killed_engine_is_recorded_and_the_kill_counted(
        tmp_path: Path) -> None:
    meter = FakeMeter()
    async for gw in on_ram(tmp_path, meter):
        await oom_kill(gw.units, meter, "a")   # cgroup v1: systemd sees only a SIGKILL
        resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "engine_out_of_memory"
        deadline = asyncio.get_running_loop().time() + 5
        while (e := gw.engines.registry.get("a")) is None or e.state is not EngineState.FAILED:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        (row,) = await gw.records(1)
        assert (row["status"], row["outcome"], row["error_code"]) == (
            503, "error", "engine_out_of_memory")
        m = samples(await (await gw.client.get("/admin/metrics")).text())
        assert m[("llm_gateway_engine_failures_total", (("kind", "oom"), ("model", "a")))] == 1
