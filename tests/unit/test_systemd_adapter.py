"""The D-Bus adapter without a bus: object paths, transient-unit properties, signals."""

from __future__ import annotations

import pytest
from dbus_fast import Message

from gatewayd.adapters.systemd import (
    FINISHED_JOBS_KEPT,
    MANAGER,
    Systemd,
    unit_name_from_path,
    unit_object_path,
)
from gatewayd.core.unit_spec import UnitSpec


@pytest.mark.parametrize("unit,path", [
    ("llm-engine-alpha.service", "llm_2dengine_2dalpha_2eservice"),
    ("llm-engine@a\\x2db.service", "llm_2dengine_40a_5cx2db_2eservice"),
    ("é.service", "_c3_a9_2eservice"),
])
def test_unit_object_path_escapes_like_systemd(unit: str, path: str) -> None:
    assert unit_object_path(unit) == "/org/freedesktop/systemd1/unit/" + path
    assert unit_name_from_path(unit_object_path(unit)) == unit


def test_unit_name_from_foreign_path_is_none() -> None:
    assert unit_name_from_path("/org/freedesktop/systemd1/job/12") is None


def test_properties_carry_times_in_microseconds_and_argv_as_exec_start() -> None:
    spec = UnitSpec(name="llm-engine-x.service", argv=["/usr/bin/llama-server", "-m", "m.gguf"],
                    runtime_directory="llm-engine-x", restart_sec=0.5, timeout_stop_sec=7,
                    environment={"A": "b c"})
    props = {name: (sig, value) for name, sig, value in spec.properties()}
    assert props["ExecStart"] == ("a(sasb)", [["/usr/bin/llama-server",
                                               ["/usr/bin/llama-server", "-m", "m.gguf"], False]])
    assert props["RestartUSec"] == ("t", 500_000)
    assert props["TimeoutStopUSec"] == ("t", 7_000_000)
    assert props["RuntimeDirectory"] == ("as", ["llm-engine-x"])
    assert props["RuntimeDirectoryMode"] == ("u", 0o700)
    assert props["UMask"] == ("u", 0o077)
    assert props["KillMode"] == ("s", "control-group")
    assert props["CollectMode"] == ("s", "inactive-or-failed")
    assert props["Environment"] == ("as", ["A=b c"])


def test_relative_executable_is_refused() -> None:
    with pytest.raises(ValueError, match="absolute"):
        UnitSpec(name="x.service", argv=["llama-server"]).properties()


async def test_jobs_we_did_not_ask_for_are_not_kept_forever() -> None:
    """After Subscribe every job on the host signals JobRemoved: a busy host must not grow
    the gateway's memory; a job of ours that finished before its reply is still found."""
    sd = Systemd(bus=None)  # type: ignore[arg-type]

    def job_removed(n: int) -> Message:
        return Message.new_signal("/org/freedesktop/systemd1", MANAGER, "JobRemoved",
                                  "uoss", [n, f"/org/freedesktop/systemd1/job/{n}",
                                           f"other-{n}.service", "done"])
    sd._on_message(job_removed(7))                       # ours, before the reply came
    assert await sd._job_result("/org/freedesktop/systemd1/job/7", "x.service", "start") \
        == "done"
    for n in range(10_000):
        sd._on_message(job_removed(100 + n))
    assert len(sd._finished_jobs) == FINISHED_JOBS_KEPT
