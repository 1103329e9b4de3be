"""The VRAM budget through a real gateway and the real NVML adapter: nvidia-ml-py loads the
fake libnvidia-ml.so.1 (tests/harness/fake_nvml.c) from LD_LIBRARY_PATH, and the tests
rewrite what it reports while the gateway runs."""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import make_tiny_model  # (scripts/, on the path from tests/conftest.py)
import pytest

from tests.harness.fake_nvml import GPU_IS_LOST, FakeNvml, devices
from tests.integration.conftest import GatewayFactory
from tests.integration.engine_helpers import process_ended
from tests.integration.gateway_helpers import GatewayService, toml_str

pytestmark = [pytest.mark.systemd, pytest.mark.engine]


def test_admission_reads_fresh_nvml_figures_through_the_real_adapter(
        tmp_path: Path, gateway_factory: GatewayFactory, fake_nvml_dir: Path) -> None:
    fake = FakeNvml(tmp_path / "nvml.state", devices=devices(("NVIDIA Fake A16", 4096, 3584)))
    fake.write()
    gw = gateway_factory(env=fake.env(fake_nvml_dir))
    _, status = gw.api("GET", "/admin/status")
    assert status["gpu"] == "NVML, 1 device(s): NVIDIA Fake A16"
    assert status["gpu_memory_mib"]["total"] == 4096 and status["gpu_memory_mib"]["free"] == 512

    code, refused = gw.api("POST", "/admin/engines/start", {"model": "tiny-alpha"})
    assert code == 503 and refused["error"]["code"] == "insufficient_gpu", refused
    need = refused["error"]["required_mib"]
    assert need > 1024 and refused["error"]["free_mib"] == 512   # file + 1024 MiB margin
    assert refused["error"]["total_mib"] == 4096

    fake.devices[0].used_mib = 4096 - need     # exactly enough, read fresh: admitted
    fake.write()
    code, started = gw.api("POST", "/admin/engines/start", {"model": "tiny-alpha"})
    assert code == 200 and started["engine"]["state"] == "ready", started

    # the engine's own process memory, as NVML reports it, is held by that engine
    pid = started["engine"]["pid"]
    fake.processes = [(0, pid, 700)]
    fake.devices[0].used_mib = 700
    fake.write()
    _, status = gw.api("GET", "/admin/status")
    assert status["gpu_memory_mib"]["held_by_engines"] == 700
    assert status["gpu_memory_mib"]["external"] == 0 and status["gpu_memory_mib"]["free"] == 3396
    # ... and learned: the next admission of this engine setup needs 700 + margin
    deadline = time.monotonic() + 15   # the reconciler's pass (every 5 s) records it
    while (listed := gw.api("GET", "/v1/models/tiny-alpha")[1])["vram_measured_mib"] != 700:
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)
    # the need is now what it was seen holding, plus the margin
    assert (listed["vram_estimate_mib"], listed["vram_estimate_source"]) == (
        700 + 1024, "learned")
    assert "tiny-alpha: its engine holds 700 MiB of GPU memory (learned" in gw.journal()

    # the GPU is lost: new engines are refused with the device named, in bounded time;
    # the running engine keeps serving; status says why there are no figures
    fake.errors = {"nvmlDeviceGetMemoryInfo": GPU_IS_LOST}
    fake.write()
    began = time.monotonic()
    code, lost = gw.api("POST", "/v1/chat/completions", {
        "model": "tiny-beta", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    assert code == 503 and lost["error"]["code"] == "gpu_unavailable", lost
    assert "GPU-fake-0" in lost["error"]["message"] and time.monotonic() - began < 10
    code, served = gw.api("POST", "/v1/chat/completions", {
        "model": "tiny-alpha", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    assert code == 200 and served["usage"]["completion_tokens"] == 1
    _, status = gw.api("GET", "/admin/status")
    assert "GPU is lost" in status["gpu_error"] and status["gpu_memory_mib"] is None
    assert "unreadable: NVML cannot read GPU 0" in gw.cli("status").stdout
    with urllib.request.urlopen(gw.url + "/admin/metrics", timeout=30) as scrape:
        assert b"llm_gateway_engine_state" in scrape.read()   # the scrape still works

    fake.errors = {}    # back: admitted again
    fake.write()
    code, started = gw.api("POST", "/admin/engines/start", {"model": "tiny-beta"})
    assert code == 200, started


def test_an_eviction_waits_for_the_memory_nvml_shows_late(
        tmp_path: Path, gateway_factory: GatewayFactory, fake_nvml_dir: Path) -> None:
    """The victim's memory shows as free only a while after its unit is gone (drivers do
    that): the next engine starts once NVML shows it free, not at once on a guess."""
    fake = FakeNvml(tmp_path / "nvml.state", devices=devices(("NVIDIA Fake A2", 2000, 0)))
    fake.write()
    gw = gateway_factory(env=fake.env(fake_nvml_dir))
    code, started = gw.api("POST", "/admin/engines/start", {"model": "tiny-alpha"})
    assert code == 200, started
    held = 1025                      # its files (1 MiB) + the 1024 MiB margin: beta cannot fit
    fake.processes, fake.devices[0].used_mib = [(0, started["engine"]["pid"], held)], held
    fake.write()
    alpha_pid = started["engine"]["pid"]
    freed_at: list[float] = []

    def free_late() -> None:         # 2 s after alpha's process is gone, NVML shows it free
        deadline = time.monotonic() + 60
        while not process_ended(alpha_pid):   # (its unit may be parked again at once)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(2)
        fake.processes, fake.devices[0].used_mib = [], 0
        fake.write()
        freed_at.append(time.monotonic())
    freer = threading.Thread(target=free_late)
    freer.start()
    code, answer = gw.api("POST", "/v1/chat/completions", {
        "model": "tiny-beta", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    freer.join()
    assert code == 200, answer
    beta_unit = gw.engines()["tiny-beta"]["unit"]
    started_us = int(subprocess.run(
        ["systemctl", "show", "-p", "ExecMainStartTimestampMonotonic", "--value", beta_unit],
        capture_output=True, text=True, check=True).stdout)
    assert started_us / 1e6 >= freed_at[0] - 0.05, (started_us / 1e6, freed_at)


def unit_env(unit: str) -> dict[str, str]:
    out = subprocess.run(["systemctl", "show", "-p", "Environment", "--value", unit],
                         capture_output=True, text=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def chat(gw: GatewayService, model: str) -> None:
    code, answer = gw.api("POST", "/v1/chat/completions", {
        "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    assert code == 200, answer


def test_two_gpus_best_fit_and_eviction_on_the_device_that_needs_the_memory(
        tmp_path: Path, gateway_factory: GatewayFactory, fake_nvml_dir: Path) -> None:
    """Each engine goes to the device where it fits best (CUDA_VISIBLE_DEVICES=<UUID> in its
    unit); when none has room, the engine stopped is one on the device that comes closest,
    not the least recently used one elsewhere."""
    fake = FakeNvml(tmp_path / "nvml.state", devices=devices(("NVIDIA Fake Small", 9000, 0),
                                                             ("NVIDIA Fake Large", 9000, 0)))
    fake.write()
    gw = gateway_factory(env=fake.env(fake_nvml_dir))
    need = {m: gw.api("GET", f"/v1/models/{m}")[1]["vram_estimate_mib"]
            for m in ("tiny-alpha", "tiny-beta", "tiny-gamma")}
    # alpha fits best on GPU 0 (less room left over); then beta fits on GPU 1 only; gamma
    # fits nowhere, not even spread over both: GPU 1 comes closest once beta is gone
    fake.devices[0].total_mib = need["tiny-alpha"] + 275
    fake.devices[1].total_mib = max(need["tiny-alpha"] + 276,
                                    need["tiny-beta"] + 475, need["tiny-gamma"])
    fake.write()

    def holds(model: str, device: int) -> tuple[str, int]:
        engine = gw.engines()[model]
        fake.processes.append((device, engine["pid"], need[model]))
        fake.devices[device].used_mib += need[model]
        fake.write()
        return engine["unit"], engine["pid"]

    chat(gw, "tiny-alpha")
    alpha_unit, _ = holds("tiny-alpha", 0)
    assert unit_env(alpha_unit)["CUDA_VISIBLE_DEVICES"] == "GPU-fake-0"
    chat(gw, "tiny-beta")
    beta_unit, beta_pid = holds("tiny-beta", 1)
    assert unit_env(beta_unit)["CUDA_VISIBLE_DEVICES"] == "GPU-fake-1"
    assert gw.engines()["tiny-beta"]["gpus"] == ["GPU-fake-1"]

    def free_when_gone() -> None:     # NVML shows beta's memory free once its process is gone
        deadline = time.monotonic() + 60
        while not process_ended(beta_pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        fake.processes = [p for p in fake.processes if p[1] != beta_pid]
        fake.devices[1].used_mib -= need["tiny-beta"]
        fake.write()
    freer = threading.Thread(target=free_when_gone)
    freer.start()
    chat(gw, "tiny-gamma")            # alpha is the least recently used, yet beta goes
    freer.join()
    holds("tiny-gamma", 1)
    engines = gw.engines()
    assert "tiny-beta" not in engines or engines["tiny-beta"]["state"] == "stopped"
    assert engines["tiny-alpha"]["state"] == "ready"
    assert unit_env(engines["tiny-gamma"]["unit"])["CUDA_VISIBLE_DEVICES"] == "GPU-fake-1"

    _, status = gw.api("GET", "/admin/status")
    assert [(d["uuid"], d["engines"]) for d in status["gpu_devices"]] == [
        ("GPU-fake-0", ["tiny-alpha"]), ("GPU-fake-1", ["tiny-gamma"])]
    assert "GPU 1 (NVIDIA Fake Large):" in gw.cli("status").stdout

    # an operator's start does not evict: refused, with every device's free memory
    code, refused = gw.api("POST", "/admin/engines/start", {"model": "tiny-beta"})
    assert code == 503 and refused["error"]["code"] == "insufficient_gpu", refused
    assert [d["uuid"] for d in refused["error"]["devices"]] == ["GPU-fake-0", "GPU-fake-1"]
    assert "GPU 0 (NVIDIA Fake Small): 275 of" in refused["error"]["message"]


def test_a_partly_offloaded_model_needs_both_the_gpu_and_ram(
        tmp_path: Path, gateway_factory: GatewayFactory, fake_nvml_dir: Path) -> None:
    """-ngl 4 of 8 layers: its estimate puts the last blocks and the output layer on the
    GPU and the rest in RAM; admission holds it to both, through the real NVML adapter."""
    paths = {}
    for seed, name in enumerate(("half", "cpu")):
        paths[name] = tmp_path / f"{name}.gguf"
        make_tiny_model.write_model(str(paths[name]), name=name, seed=20 + seed, n_embd=256,
                                    n_layer=8, n_ff=1024, n_head=4, n_head_kv=4)
    fake = FakeNvml(tmp_path / "nvml.state", devices=devices(("NVIDIA Fake A16", 65536, 0)))
    fake.write()
    tables = (f'[models.half]\npath = {toml_str(str(paths["half"]))}\nargs = ["-ngl", "4"]\n'
              f'[models.cpu]\npath = {toml_str(str(paths["cpu"]))}\nargs = ["-ngl", "0"]\n')
    gw = gateway_factory(env=fake.env(fake_nvml_dir), extra=tables)
    rows = {m["id"]: m for m in gw.api("GET", "/v1/models")[1]["data"]}
    half, cpu = rows["half"], rows["cpu"]
    assert half["vram_estimate_source"] == half["ram_estimate_source"] == "estimate", half
    # RAM: what stays on the CPU; VRAM: what goes to the GPU (+ the 1024 MiB margin)
    assert half["ram_estimate_mib"] < cpu["ram_estimate_mib"]
    assert cpu["vram_estimate_mib"] == 1024 < half["vram_estimate_mib"]

    # the GPU short by 1 MiB (RAM plenty): refused, naming the GPU
    fake.devices[0].used_mib = 65536 - half["vram_estimate_mib"] + 1
    fake.write()
    code, refused = gw.api("POST", "/admin/engines/start", {"model": "half"})
    assert code == 503 and refused["error"]["code"] == "insufficient_gpu", refused
    assert refused["error"]["memory"] == "gpu"
    # the GPU has room, RAM is short (a budget below its RAM need): refused, naming RAM
    fake.devices[0].used_mib = 0
    fake.write()
    gw.stop()
    gw = gateway_factory(env=fake.env(fake_nvml_dir), extra=tables + (
        f"[memory]\nram_reserve_mib = 0\nram_budget_mib = {half['ram_estimate_mib'] - 1}\n"))
    code, refused = gw.api("POST", "/admin/engines/start", {"model": "half"})
    assert code == 503 and refused["error"]["code"] == "insufficient_memory", refused
    assert refused["error"]["memory"] == "ram"
    # both have room: admitted, and the RAM ledger holds its claim
    gw.stop()
    gw = gateway_factory(env=fake.env(fake_nvml_dir), extra=tables + (
        f"[memory]\nram_reserve_mib = 0\nram_budget_mib = {half['ram_estimate_mib']}\n"))
    code, started = gw.api("POST", "/admin/engines/start", {"model": "half"})
    assert code == 200, started
    ram = gw.api("GET", "/admin/status")[1]["ram_memory_mib"]
    assert ram["claimed_mib"] >= half["ram_estimate_mib"] and ram["free_for_planning_mib"] == 0
