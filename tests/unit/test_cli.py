from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gatewayd import cli


def test_models_names_each_model_whose_header_could_not_be_read(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    row = {"backend": "llama", "kind": "chat", "quantization": None, "context_length": None,
           "size_bytes": 64}
    models = [{**row, "id": "good", "path": "/m/good.gguf", "header_error": None},
              {**row, "id": "broken", "path": "/m/broken.gguf",
               "header_error": "not a GGUF file (bad magic)"}]

    def call(url: str, method: str, path: str, body: Any = None) -> Any:
        assert (method, path) == ("GET", "/admin/models")
        return {"models": models}

    monkeypatch.setattr(cli, "call", call)
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
    assert cli.main(["--url", "http://gateway", "models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "KIND", "BACKEND", "QUANTIZATION", "CONTEXT_LENGTH",
                                "SIZE", "PATH"]
    assert lines[1].split()[:6] == ["good", "chat", "llama", "-", "-", "64"]
    assert [line.split()[0] for line in lines[1:3]] == ["good", "broken"]
    assert lines[3:] == ["broken: cannot read the GGUF header: not a GGUF file (bad magic)"]


def test_sizes_and_durations_read_as_people_write_them() -> None:
    assert [cli.size(v) for v in (None, 0, 1023, 1024, 631 * 1024, 5 << 30, 3 << 40)] == [
        None, "0 B", "1023 B", "1.0 KiB", "631.0 KiB", "5.0 GiB", "3.0 TiB"]
    assert [cli.duration(v) for v in (None, 0.4, 59, 192, 3600, 7500)] == [
        None, "0s", "59s", "3m12s", "1h00m", "2h05m"]


def test_status_is_human_and_json_stays_exact(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    status: dict[str, Any] = {
        "unit_mode": "transient", "systemd_manager": "system", "gpu": "NVML, 1 device",
        "max_engines": 4, "engines": {"loading": 1, "ready": 2}, "models": 3,
        "desired": ["a", "b"], "config": None, "records_dropped": 0,
        "gpu_memory_mib": {"total": 81920, "free": 40960, "held_by_engines": 30720,
                           "pending_loads": 2048, "external": 8192,
                           "free_for_planning": 38912},
        "ram_memory_mib": {"total_mib": 65536, "available_mib": 40960,
                           "reserve_mib": 1024, "budget_mib": None,
                           "claimed_mib": 8192, "held_mib": 7168, "pending_mib": 2048,
                           "free_for_planning_mib": 37888}}
    monkeypatch.setattr(cli, "call", lambda *a, **k: status)
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
    assert cli.main(["--url", "http://gateway", "status"]) == 0
    out = capsys.readouterr().out
    assert "engines: 1 loading, 2 ready (at most 4)" in out
    assert ("GPU memory: 40.0 GiB free of 80.0 GiB (engines 30.0 GiB, loading 2.0 GiB, "
            "other processes 8.0 GiB)") in out
    lines = out.splitlines()   # the RAM budget, under the GPU's
    assert lines[lines.index(next(x for x in lines if x.startswith("GPU memory:"))) + 1] == (
        "RAM: 37.0 GiB free of 64.0 GiB (engines 8.0 GiB, loading 2.0 GiB, reserve 1.0 GiB)")
    assert "{" not in out and "None" not in out          # no Python reprs
    assert cli.main(["--url", "http://gateway", "--json", "status"]) == 0
    assert json.loads(capsys.readouterr().out) == status
    status["ram_memory_mib"]["budget_mib"] = 16384
    assert cli.main(["--url", "http://gateway", "status"]) == 0
    assert "reserve 1.0 GiB, budget 16.0 GiB)" in capsys.readouterr().out
    status["gpu_memory_mib"] = status["ram_memory_mib"] = None   # no GPU; RAM not checked
    assert cli.main(["--url", "http://gateway", "status"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory: -" in out and "RAM: -" in out


def engine_row(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "state": "ready", "unit": f"llm-engine-{model}.service",
            "pid": 123456, "restarts": 0, "uptime_s": 7500, "memory_bytes": None,
            "failure": None, "in_flight": 2, "queued": 0, "ram_bytes": None,
            "ram_peak_bytes": None, "ram_source": None, "ram_need_mib": 4608,
            "vram_need_mib": None, **kw}


def test_engines_show_ram_with_its_source_and_the_need_within_100_columns(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    engines = [engine_row("qwen2.5-7b", ram_bytes=412 * 2**20, ram_source="cgroup",
                          vram_need_mib=5325),
               engine_row("whisper", state="stopping", memory_bytes=300 * 2**20,
                          ram_need_mib=300, vram_need_mib=700),
               engine_row("llama-3b", state="failed", pid=None, uptime_s=None,
                          ram_need_mib=None, vram_need_mib=None,
                          failure={"reason": "killed for want of memory by the kernel's "
                                             "OOM killer"})]
    status = {"gpu_memory_mib": None, "ram_memory_mib": None}
    monkeypatch.setattr(cli, "call", lambda url, method, path, *a, **k: (
        {"engines": engines} if path == "/admin/engines" else status))
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
    assert cli.main(["--url", "http://gateway", "engines"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", "STATE", "PID", "UPTIME", "RESTARTS", "RAM", "NEED",
                                "RAM/VRAM", "IN_FLIGHT", "QUEUED"]
    cells = [re.split(r"\s{2,}", line) for line in lines]
    assert cells[1][5:7] == ["412 MiB (cgroup)", "4.5/5.2 GiB"]
    assert cells[2][5:7] == ["300 MiB (systemd)", "300/700 MiB"]   # systemd's figure, said so
    assert lines[3].split()[:3] == ["llama-3b", "failed", "-"]
    assert lines[4] == ("  killed for want of memory by the kernel's OOM killer "
                        "(journalctl -u 'llm-engine-llama-3b.service')")
    assert lines[5:] == ["", "GPU memory: -", "RAM: -"]
    assert max(len(line) for line in lines[:3]) <= 100
    # no GPU: the need is RAM's alone
    engines[:] = [engine_row("qwen2.5-7b")]
    assert cli.main(["--url", "http://gateway", "engines"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[5:8] == ["RAM", "NEED", "RAM"] and "4.5 GiB" in lines[1]


def test_the_cli_goes_where_the_admin_api_is(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.delenv("LLM_GATEWAY_ADMIN_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "llm-gateway").mkdir()
    own = tmp_path / "llm-gateway" / "admin.sock"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(own))
        config = tmp_path / "g.toml"

        def where(text: str, *argv: str) -> str:
            config.write_text(text)
            return cli.gateway_address(cli.build_parser().parse_args(
                ["--config", str(config), *argv, "status"]))
        # the admin API is on the socket only (the default): where that gateway binds it
        assert where("[listen]\nport = 8111\n") == f"unix:{own}"
        # public: its own port, never another gateway's socket
        assert where("[listen]\nport = 8111\n[admin]\npublic = true\n") == \
            "http://127.0.0.1:8111"
        assert where('[admin]\nsocket = "/nowhere/a.sock"\npublic = true\n'
                     "[listen]\nport = 8112\n") == "http://127.0.0.1:8112"
        assert where("", "--url", "http://h:1") == "http://h:1"


def test_serve_starts_with_the_collector_off(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    """The imports and the start run without the garbage collector (~100 collections over
    the imports' objects, ~25 ms of a socket-activated start); the app turns it back on
    once it serves (tests/http/test_front_door.py)."""
    import gc

    import gatewayd.app
    seen: list[bool] = []
    monkeypatch.setattr(gatewayd.app, "serve", lambda config: seen.append(gc.isenabled()))
    config = tmp_path / "gateway.toml"
    config.write_text(f'models_dir = "{tmp_path}"\nstate_dir = "{tmp_path / "state"}"\n')
    try:
        assert cli.main(["--config", str(config), "serve"]) == 0
    finally:
        gc.enable()
    assert seen == [False]
