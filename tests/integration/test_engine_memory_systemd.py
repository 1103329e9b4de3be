"""The memory meter on a real systemd whose memory controller is delegated (the test
container does that on a hybrid host): units are read from their memory cgroup, found
through the ControlGroup systemd gives; an OOM kill inside a unit is counted; the PSS
fallback reads a real engine's processes; a reader without root gets the cgroup figure
but no PSS (another user's smaps_rollup is closed to it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gatewayd.adapters.engine_memory import CgroupMemoryMeter
from gatewayd.adapters.systemd import SERVICE, UNIT, Systemd
from gatewayd.adapters.unit_control import TransientEngineUnits, info_from_properties
from gatewayd.core.catalog import Model
from gatewayd.core.config import GatewayConfig, ModelConfig
from tests.integration.engine_helpers import stop_quietly, wait_for, wait_healthy

pytestmark = pytest.mark.systemd
MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def hog_code(mib: int, ready: Path) -> str:
    """Python that writes to every page of mib MiB, says so in a file, then waits."""
    return (f"b = bytearray({mib} << 20)\n"
            f"for i in range(0, len(b), 4096): b[i] = 1\n"
            f"open({str(ready)!r}, 'w').write('ready\\n')\n"
            "import time; time.sleep(600)\n")


async def control_group(systemd: Systemd, unit: str) -> str:
    info = info_from_properties(unit, await systemd.properties(unit, UNIT),
                                await systemd.properties(unit, SERVICE))
    assert info.control_group, f"{unit} has no ControlGroup"
    return info.control_group


async def file_written(path: Path, what: str, timeout: float = 30) -> str:
    async def written() -> bool:
        return path.exists() and path.read_text().endswith("\n")
    await wait_for(written, timeout, what)
    return path.read_text()


def as_nobody(code: str) -> str:
    """Run Python as an unprivileged user (a gateway that is not root), its stdout."""
    return subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=REPO).stdout


@pytest.fixture
async def hog(systemd: Systemd, tmp_path: Path) -> AsyncIterator[str]:
    """A running unit that holds 100 MiB it wrote to: its name."""
    unit = f"meter-hog-{os.getpid()}.service"
    ready = tmp_path / "ready"
    subprocess.run(["systemd-run", "--quiet", "--collect", f"--unit={unit}",
                    "-p", "MemoryAccounting=yes", sys.executable, "-c", hog_code(100, ready)],
                   check=True)
    try:
        await file_written(ready, f"{unit} to write its memory")
        yield unit
    finally:
        await stop_quietly(systemd, unit)


async def test_a_units_memory_is_read_from_its_cgroup(systemd: Systemd, hog: str) -> None:
    group = await control_group(systemd, hog)
    use = CgroupMemoryMeter().read(group)
    assert use is not None and use.source == "cgroup", use
    assert 100 * MIB < use.current_bytes < 200 * MIB, use
    assert use.peak_bytes is not None and use.current_bytes <= use.peak_bytes < 250 * MIB
    assert use.oom_kills == 0
    # the same figure systemd gives now that it has the controller
    told = int((await systemd.properties(hog, SERVICE))["MemoryCurrent"])
    assert abs(told - use.current_bytes) < 10 * MIB, (told, use)
    # cgroup files are world-readable: a gateway that is not root reads them as well
    code = ("from gatewayd.adapters.engine_memory import CgroupMemoryMeter\n"
            f"print(CgroupMemoryMeter().read({group!r}).source)")
    assert as_nobody(code) == "cgroup\n"


async def test_an_oom_kill_inside_a_unit_is_counted(systemd: Systemd, tmp_path: Path) -> None:
    """A child that outgrows the unit's MemoryMax= is killed by the kernel; the unit (its
    shell) lives on, so its cgroup, with the count, is still there to read."""
    unit = f"meter-oom-{os.getpid()}.service"
    status, child, script = tmp_path / "status", tmp_path / "child.py", tmp_path / "unit.sh"
    child.write_text(hog_code(200, tmp_path / "never"))
    # in files: systemd would expand the $ of a shell command line given on ExecStart=
    script.write_text(f"{sys.executable} {child}\necho $? > {status}\nexec sleep 600\n")
    subprocess.run(["systemd-run", "--quiet", "--collect", f"--unit={unit}",
                    "-p", "MemoryAccounting=yes", "-p", "MemoryMax=50M",
                    "-p", "MemorySwapMax=0",   # (cgroup v2; a v1 host here has no swap)
                    "sh", str(script)], check=True)
    try:
        # 128 + SIGKILL: the OOM killer's
        assert await file_written(status, f"the child in {unit} to end") == "137\n"
        use = CgroupMemoryMeter().read(await control_group(systemd, unit))
        assert use is not None and use.source == "cgroup", use
        assert use.oom_kills is not None and use.oom_kills >= 1, use
        # it reached the limit, never more
        assert use.peak_bytes is not None and 40 * MIB < use.peak_bytes <= 50 * MIB, use
    finally:
        await stop_quietly(systemd, unit)


def pss_view(tmp_path: Path) -> Path | None:
    """A cgroup root that shows systemd's own v1 hierarchy but no memory controller, as a
    gateway sees one where the controller is not delegated (None: no v1 hierarchy here)."""
    if not Path("/sys/fs/cgroup/systemd").is_dir():
        return None
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "systemd").symlink_to("/sys/fs/cgroup/systemd")
    return root


@pytest.mark.engine
async def test_a_real_engine_by_its_cgroup_and_by_pss(
        systemd: Systemd, llama_server: Path, tiny_models: dict[str, Path],
        tmp_path: Path) -> None:
    config = GatewayConfig(llama_server=str(llama_server), state_dir=tmp_path / "state")
    units = TransientEngineUnits(systemd, config, manager="system", run_root="/run")
    path = tiny_models["alpha"]
    model = Model(id="meter-alpha", names=frozenset({"meter-alpha"}),
                  config=ModelConfig(name="meter-alpha", path=path, threads=1, ctx_size=512),
                  size_bytes=path.stat().st_size)
    layout = units.layout(model.id)
    try:
        await units.start_engine(model)
        await wait_healthy(layout.socket)
        info = await units.engine_info(layout.unit)
        assert info is not None and info.control_group is not None
        assert info.control_group.endswith(f"/{layout.unit}")
        by_cgroup = CgroupMemoryMeter().read(info.control_group)
        assert by_cgroup is not None and by_cgroup.source == "cgroup", by_cgroup
        assert info.memory_bytes is not None
        assert abs(by_cgroup.current_bytes - info.memory_bytes) < 10 * MIB
        view = pss_view(tmp_path)
        if view is None:
            pytest.skip("a unified host: no name=systemd hierarchy to list processes from")
        by_pss = CgroupMemoryMeter(view).read(info.control_group)
        assert by_pss is not None and by_pss.source == "pss", by_pss
        assert by_pss.oom_kills is None and by_pss.peak_bytes == by_pss.current_bytes
        # the engine's own mappings: the cgroup also holds page cache and kernel memory
        assert 5 * MIB < by_pss.current_bytes < 2 * by_cgroup.current_bytes + 64 * MIB, (
            by_pss, by_cgroup)
        # the engine runs as its own user: another unprivileged reader gets no PSS at all
        code = ("from pathlib import Path\n"
                "from gatewayd.adapters.engine_memory import CgroupMemoryMeter\n"
                f"print(CgroupMemoryMeter(Path({str(view)!r})).read({info.control_group!r}))")
        assert as_nobody(code) == "None\n"
        print(f"engine {layout.unit}: {by_cgroup} / {by_pss}")
    finally:
        await stop_quietly(systemd, layout.unit)


async def test_a_mapped_file_cached_before_the_unit_is_pss_not_cgroup(
        systemd: Systemd, tmp_path: Path) -> None:
    """The kernel charges a page of cache to the cgroup that read it first: a unit that
    maps a file already cached (an engine's model, read before by an earlier engine) has
    it in its PSS but not in its cgroup figure."""
    model = tmp_path / "model"
    model.write_bytes(os.urandom(64 * MIB))   # cached now, charged to this test's cgroup
    ready, mapper = tmp_path / "ready", tmp_path / "mapper.py"
    mapper.write_text(
        "import mmap, time\n"
        f"f = open({str(model)!r}, 'rb')\n"
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "sum(m[i] for i in range(0, len(m), 4096))\n"
        f"open({str(ready)!r}, 'w').write('ready\\n')\n"
        "time.sleep(600)\n")
    unit = f"meter-mapper-{os.getpid()}.service"
    subprocess.run(["systemd-run", "--quiet", "--collect", f"--unit={unit}",
                    "-p", "MemoryAccounting=yes", sys.executable, str(mapper)], check=True)
    try:
        await file_written(ready, f"{unit} to map the file")
        group = await control_group(systemd, unit)
        by_cgroup = CgroupMemoryMeter().read(group)
        assert by_cgroup is not None and by_cgroup.source == "cgroup"
        assert by_cgroup.current_bytes < 48 * MIB, by_cgroup
        view = pss_view(tmp_path)
        if view is None:
            return
        by_pss = CgroupMemoryMeter(view).read(group)
        assert by_pss is not None and by_pss.source == "pss"
        assert 64 * MIB < by_pss.current_bytes < 128 * MIB, by_pss
    finally:
        await stop_quietly(systemd, unit)
