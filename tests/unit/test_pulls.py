"""Pulls (service/pulls.py) with the real huggingface_hub client (adapters/hub.py) against
the local stand-in for the hub (tests/fake_hub.py): what lands, what is left when it
fails, resuming, sharing, cancelling."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from gatewayd.adapters.hub import HuggingFaceHub, hub_token
from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.config import ModelConfig
from gatewayd.core.errors import (
    ChecksumMismatch,
    HubFileNotFound,
    HubGatedRepo,
    HubRepoNotFound,
    HubUnreachable,
    InsufficientStorage,
    ModelDownloading,
    ModelExists,
    PullError,
)
from gatewayd.core.pull import PullState, RemoteFile
from gatewayd.service.pull_folder import PULL_DIR, SOURCE_FILE
from gatewayd.service.pulls import Puller
from tests.fake_hub import FakeHub, serve_hub

REPO = "org/Tiny-GGUF"
MIB = 1024 * 1024
DEADLINE_S = 30.0


def data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


FILES = {"Tiny-Q8_0.gguf": data(3 * MIB, 1), "Tiny-Q4_K_M.gguf": data(MIB, 2),
         "README.md": b"# Tiny\n"}


@dataclass
class Rig:
    hub: FakeHub
    url: str
    models: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    rescans: list[int] = field(default_factory=list)
    pullers: list[Puller] = field(default_factory=list)

    def puller(self, *, token: str | None = None, catalog: Catalog | None = None,
               client: HuggingFaceHub | None = None, **kw: Any) -> Puller:
        async def rescan() -> None:
            self.rescans.append(1)
        puller = Puller(hub=client or HuggingFaceHub(endpoint=self.url, token=token),
                        models_dir=lambda: self.models, catalog=catalog or Catalog([], {}),
                        rescan=rescan, publish=self.events.append, **kw)
        self.pullers.append(puller)
        return puller

    def leftovers(self) -> list[str]:
        """Everything under .pull/ (partial bytes, records, gathered files)."""
        root = self.models / PULL_DIR
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) \
            if root.exists() else []


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client writes (and a cut loses) whole chunks: 64 KiB ones let a 3 MiB file show
    a resume (the gateway's own 1 MiB would lose a third of it to a cut)."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    hub = FakeHub()
    async with serve_hub(hub) as url:
        models = tmp_path / "models"
        models.mkdir()
        rig = Rig(hub=hub, url=url, models=models)
        yield rig
        for puller in rig.pullers:
            await puller.close()


async def finished(puller: Puller, state: PullState) -> PullState:
    ended = await asyncio.wait_for(puller.wait(state.name), DEADLINE_S)
    return ended or state


async def until(check: Any, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_pull_lands_whole_verified_readable_and_says_where_from(rig: Rig) -> None:
    commit = rig.hub.publish(REPO, FILES)
    puller = rig.puller()
    state = await puller.pull(f"{REPO}:Q8_0")
    assert state.name == "Tiny-Q8_0" and state.commit == commit
    assert state.total_bytes == 3 * MIB
    assert (await finished(puller, state)).state == "done"
    folder = rig.models / "Tiny-Q8_0"
    weights = folder / "Tiny-Q8_0.gguf"
    assert weights.read_bytes() == FILES["Tiny-Q8_0.gguf"]
    assert weights.stat().st_mode & 0o777 == 0o644      # the engines' user reads it
    assert folder.stat().st_mode & 0o777 == 0o755
    source = json.loads((folder / SOURCE_FILE).read_text())
    assert source["commit"] == commit and source["repo"] == REPO
    assert source["files"][0]["sha256"] == hashlib.sha256(FILES["Tiny-Q8_0.gguf"]).hexdigest()
    assert rig.rescans == [1]               # the catalog read models_dir again
    assert rig.leftovers() == []
    assert rig.hub.downloads["Tiny-Q8_0.gguf"] == 1
    pulls = [e for e in rig.events if e["type"] == "pull"]
    assert pulls[0]["state"] == "downloading" and pulls[-1]["state"] == "done"
    assert pulls[-1]["done_bytes"] == pulls[-1]["total_bytes"] == 3 * MIB
    assert puller.pulls()[0].state == "done"


async def test_pulling_it_again_has_nothing_to_do(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    puller = rig.puller()
    await finished(puller, await puller.pull(f"{REPO}:Q8_0"))
    again = await puller.pull(f"{REPO}:Q8_0")
    assert again.state == "done" and rig.hub.downloads["Tiny-Q8_0.gguf"] == 1
    rig.hub.publish(REPO, {**FILES, "Tiny-Q8_0.gguf": data(3 * MIB, 9)})   # a new commit
    with pytest.raises(ModelExists, match="rm Tiny-Q8_0"):
        await puller.pull(f"{REPO}:Q8_0")


async def test_two_pulls_of_one_model_share_one_download(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    rig.hub.throttle_bps = 8 * MIB
    puller = rig.puller()
    first, second = await asyncio.gather(puller.pull(f"{REPO}:Q8_0"),
                                         puller.pull(f"{REPO}:Tiny-Q8_0.gguf"))
    assert first is second
    assert (await finished(puller, first)).state == "done"
    assert rig.hub.downloads["Tiny-Q8_0.gguf"] == 1


async def test_a_cut_connection_resumes_where_it_broke(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    rig.hub.cut_after["Tiny-Q8_0.gguf"] = MIB
    puller = rig.puller()
    state = await finished(puller, await puller.pull(f"{REPO}:Q8_0"))
    assert state.state == "done", state.error
    assert (rig.models / "Tiny-Q8_0" / "Tiny-Q8_0.gguf").read_bytes() == FILES["Tiny-Q8_0.gguf"]
    assert rig.hub.downloads["Tiny-Q8_0.gguf"] == 2
    assert rig.hub.gets[1] == ("Tiny-Q8_0.gguf", f"bytes={MIB}-")   # resumed at the cut


async def test_a_corrupt_file_is_refused_and_nothing_is_left(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    rig.hub.corrupt.add("Tiny-Q8_0.gguf")
    puller = rig.puller()
    state = await finished(puller, await puller.pull(f"{REPO}:Q8_0"))
    assert state.state == "failed" and state.error is not None
    assert state.error["code"] == "checksum_mismatch"
    assert not (rig.models / "Tiny-Q8_0").exists()
    assert rig.leftovers() == []
    assert rig.rescans == []


async def test_a_gated_repository_needs_the_token_and_says_so_at_once(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES, gated=True)
    with pytest.raises(HubGatedRepo, match="token"):
        await rig.puller().pull(f"{REPO}:Q4_K_M")
    assert rig.leftovers() == []
    with_token = rig.puller(token=rig.hub.token)
    state = await finished(with_token, await with_token.pull(f"{REPO}:Q4_K_M"))
    assert state.state == "done", state.error


async def test_unknown_repositories_files_and_hubs_are_clear_errors(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    puller = rig.puller()
    with pytest.raises(HubRepoNotFound):
        await puller.pull("org/nothing-here")
    with pytest.raises(HubFileNotFound, match="Q8_0"):   # it lists what there is
        await puller.pull(f"{REPO}:Q2_K")
    offline = Puller(hub=HuggingFaceHub(endpoint="http://127.0.0.1:9", token=None),
                     models_dir=lambda: rig.models, catalog=Catalog([], {}),
                     rescan=lambda: asyncio.sleep(0), publish=lambda e: None)
    with pytest.raises(HubUnreachable):
        await offline.pull(REPO)
    assert rig.leftovers() == []


async def test_space_is_checked_before_a_byte_is_fetched(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)

    @dataclass
    class Usage:
        total: int = 100 * MIB
        free: int = 3 * MIB   # the file is 3 MiB; the reserve is 5 MiB of 100
    puller = rig.puller(disk_usage=lambda path: Usage())
    with pytest.raises(InsufficientStorage) as e:
        await puller.pull(f"{REPO}:Q8_0")
    assert str(rig.models) in e.value.message and e.value.status == 507
    assert rig.hub.downloads["Tiny-Q8_0.gguf"] == 0 and rig.leftovers() == []


class _BreaksAfter:
    """A partial file that takes `room` bytes (of a chunk, what fits, as a full disk
    does), then raises what the test gives (a full disk, a failing hub)."""

    def __init__(self, out: BinaryIO, room: int, error: Exception) -> None:
        self._out, self._room, self._error = out, room, error

    def write(self, chunk: bytes) -> int:
        if len(chunk) > self._room:
            self._out.write(chunk[: self._room])
            self._room = 0
            raise self._error
        self._room -= len(chunk)
        return self._out.write(chunk)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


class BreakingHub(HuggingFaceHub):
    """The real client, its download breaking with `error` after 1 MiB."""

    def __init__(self, error: Exception, **kw: Any) -> None:
        super().__init__(**kw)
        self._error = error

    def download(self, repo: str, commit: str, file: RemoteFile, out: BinaryIO,
                 cancel: threading.Event) -> None:
        super().download(repo, commit, file, _BreaksAfter(out, MIB, self._error),  # type: ignore[arg-type]
                         cancel)


async def test_a_disk_that_fills_mid_download_leaves_nothing_and_says_so(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    puller = rig.puller(client=BreakingHub(
        OSError(errno.ENOSPC, "No space left on device"), endpoint=rig.url))
    state = await finished(puller, await puller.pull(f"{REPO}:Q8_0"))
    assert state.state == "failed" and state.error is not None
    assert state.error["code"] == "insufficient_storage"
    assert "filled up" in state.error["message"]
    assert rig.leftovers() == [] and not (rig.models / "Tiny-Q8_0").exists()


async def test_a_pull_the_gateway_stopped_resumes_at_its_bytes(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    rig.hub.throttle_bps = 2 * MIB
    first = rig.puller()
    state = await first.pull(f"{REPO}:Q8_0")
    await until(lambda: state.done_bytes >= MIB, "a first MiB on disk")
    await first.close()      # the gateway stops mid-download
    assert "Tiny-Q8_0.json" in rig.leftovers()
    rig.hub.throttle_bps = None
    second = rig.puller()    # the next start
    await second.resume_unfinished()
    resumed = second.active("Tiny-Q8_0")
    assert resumed is not None and resumed.resumed_bytes >= MIB
    assert (await finished(second, resumed)).state == "done", resumed.error
    assert (rig.models / "Tiny-Q8_0" / "Tiny-Q8_0.gguf").read_bytes() == FILES["Tiny-Q8_0.gguf"]
    # the next start asked for the rest only (the hub's count of bytes sent cannot say it:
    # it went on writing the first answer into the socket after its reader stopped)
    assert rig.hub.gets[-1] == ("Tiny-Q8_0.gguf", f"bytes={resumed.resumed_bytes}-")
    assert rig.leftovers() == []


async def test_a_cancelled_pull_leaves_nothing(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    rig.hub.throttle_bps = MIB
    puller = rig.puller()
    state = await puller.pull(f"{REPO}:Q8_0")
    await until(lambda: state.done_bytes > 0, "bytes arriving")
    ended = await asyncio.wait_for(puller.cancel("Tiny-Q8_0"), DEADLINE_S)
    assert ended is not None and ended.state == "cancelled"
    assert rig.leftovers() == [] and not (rig.models / "Tiny-Q8_0").exists()


async def test_a_name_in_use_is_refused_unless_another_is_given(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    other = rig.models.parent / "elsewhere.gguf"
    taken = Catalog([Model(id="Tiny-Q8_0", config=ModelConfig(name="Tiny-Q8_0", path=other),
                           names=frozenset({"tiny-q8_0"}))], {})
    puller = rig.puller(catalog=taken)
    with pytest.raises(ModelExists):
        await puller.pull(f"{REPO}:Q8_0")
    state = await finished(puller, await puller.pull(f"{REPO}:Q8_0", name="mine"))
    assert state.state == "done" and (rig.models / "mine" / "Tiny-Q8_0.gguf").exists()


async def test_split_parts_and_the_projector_come_together(rig: Rig) -> None:
    parts = {f"Q8_0/Big-Q8_0-0000{i}-of-00003.gguf": data(MIB, 10 + i) for i in (1, 2, 3)}
    rig.hub.publish("org/Big-GGUF", {**parts, "mmproj-Big-f16.gguf": data(MIB, 20),
                                     "mmproj-Big-Q8_0.gguf": data(MIB, 21)})
    puller = rig.puller()
    state = await finished(puller, await puller.pull("org/Big-GGUF:Q8_0", mmproj=True))
    assert state.state == "done", state.error
    landed = sorted(p.name for p in (rig.models / "Big-Q8_0").glob("*.gguf"))
    assert landed == ["Big-Q8_0-00001-of-00003.gguf", "Big-Q8_0-00002-of-00003.gguf",
                      "Big-Q8_0-00003-of-00003.gguf", "mmproj-Big-f16.gguf"]


async def test_a_lora_adapter_is_pulled_like_a_model_and_listed_as_none(
        rig: Rig, tmp_path: Path) -> None:
    """docs/variants.md: `pull ORG/REPO:FILE --name NAME` fetches an adapter; the catalog
    lists no model for it, and a model's adapters may name it."""
    import make_tiny_model

    from gatewayd.adapters.model_files import load_catalog
    from gatewayd.core.config import parse_config

    make_tiny_model.write_lora(str(tmp_path / "sql.gguf"), "tiny-sql")
    make_tiny_model.write_model(str(rig.models / "tiny.gguf"), "tiny")
    rig.hub.publish("org/Tiny-LoRA", {"tiny-sql-lora.gguf": (tmp_path / "sql.gguf").read_bytes()})
    puller = rig.puller()
    state = await finished(puller, await puller.pull("org/Tiny-LoRA:tiny-sql-lora.gguf",
                                                     name="sql-lora"))
    assert state.state == "done", state.error
    landed = rig.models / "sql-lora" / "tiny-sql-lora.gguf"
    assert landed.read_bytes() == (tmp_path / "sql.gguf").read_bytes()
    assert load_catalog(parse_config({"models_dir": str(rig.models)})).served_ids() == ["tiny"]
    config = parse_config({"models_dir": str(rig.models), "models": {"tiny": {
        "path": str(rig.models / "tiny.gguf"), "adapters": {"sql": str(landed)}}}})
    assert load_catalog(config).served_ids() == ["tiny", "tiny:sql"]


def sourced(name: str, source: str, models: Path) -> Model:
    """A configured model whose file is not here yet, as the catalog holds it."""
    return Model(id=name, config=ModelConfig(name=name, path=None, source=source),
                 names=frozenset({name.casefold()}))


async def test_a_configured_source_is_pulled_under_the_models_own_name(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    model = sourced("tiny", f"{REPO}:Q4_K_M", rig.models)
    puller = rig.puller(catalog=Catalog([model], {}))   # the name is its own, not taken
    await asyncio.wait_for(puller.ensure(model, wait_s=DEADLINE_S), DEADLINE_S)
    assert (rig.models / "tiny" / "Tiny-Q4_K_M.gguf").read_bytes() == FILES["Tiny-Q4_K_M.gguf"]
    assert rig.rescans == [1]      # the catalog has its file when ensure returns


async def test_a_download_longer_than_the_wait_is_a_503_with_its_eta(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    rig.hub.throttle_bps = MIB // 2          # the 3 MiB file: ~6 s
    model = sourced("tiny", f"{REPO}:Q8_0", rig.models)
    puller = rig.puller(catalog=Catalog([model], {}))
    with pytest.raises(ModelDownloading) as e:
        await asyncio.wait_for(puller.ensure(model, wait_s=1.0), DEADLINE_S)
    assert e.value.status == 503 and e.value.retry_after is not None
    assert 1 <= e.value.retry_after <= 30 and e.value.extra["total_bytes"] == 3 * MIB
    assert "being downloaded" in e.value.message
    second = puller.active("tiny")     # the download goes on for the next request
    assert second is not None and second.state == "downloading"
    rig.hub.throttle_bps = None
    await asyncio.wait_for(puller.ensure(model, wait_s=DEADLINE_S), DEADLINE_S)
    assert rig.hub.downloads["Tiny-Q8_0.gguf"] == 1


async def test_a_failed_source_pull_answers_with_its_error(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    rig.hub.corrupt.add("Tiny-Q4_K_M.gguf")
    model = sourced("tiny", f"{REPO}:Q4_K_M", rig.models)
    puller = rig.puller(catalog=Catalog([model], {}))
    with pytest.raises(ChecksumMismatch):
        await asyncio.wait_for(puller.ensure(model, wait_s=DEADLINE_S), DEADLINE_S)


async def test_an_expired_cdn_address_is_asked_for_again(rig: Rig) -> None:
    """The hub's CDN addresses are signed for a while: a cut after that (here about a
    second: the stand-in's expiry is in whole seconds) is answered 403 at the same address,
    and the pull asks the hub for a fresh one."""
    rig.hub.publish(REPO, FILES)
    rig.hub.cdn_ttl_s = 1.2
    rig.hub.throttle_bps = MIB
    rig.hub.cut_after["Tiny-Q8_0.gguf"] = 2 * MIB     # 2 s in: the address has expired
    puller = rig.puller()
    state = await finished(puller, await puller.pull(f"{REPO}:Q8_0"))
    assert state.state == "done", state.error
    assert (rig.models / "Tiny-Q8_0" / "Tiny-Q8_0.gguf").read_bytes() == FILES["Tiny-Q8_0.gguf"]
    assert rig.hub.gets[-1] == ("Tiny-Q8_0.gguf", f"bytes={2 * MIB}-")


async def test_a_hub_failure_keeps_the_bytes_for_the_next_try_or_rm(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    failing = rig.puller(client=BreakingHub(
        PullError("the hub answered 500 for org/Tiny-GGUF/Tiny-Q8_0.gguf"), endpoint=rig.url))
    state = await finished(failing, await failing.pull(f"{REPO}:Q8_0"))
    assert state.state == "failed" and state.error is not None
    assert state.error["code"] == "pull_failed"
    assert "Tiny-Q8_0.json" in rig.leftovers()        # kept: the next try resumes
    again = rig.puller()
    resumed = await again.pull(f"{REPO}:Q8_0")
    assert resumed.resumed_bytes == MIB
    assert (await finished(again, resumed)).state == "done"
    assert rig.hub.gets[-1] == ("Tiny-Q8_0.gguf", f"bytes={MIB}-")
    # and a failed pull that nobody tries again: rm of its name takes its bytes away
    rig.hub.publish("org/Other-GGUF", {"Other-Q8_0.gguf": data(3 * MIB, 5)})
    state = await finished(failing, await failing.pull("org/Other-GGUF"))
    assert state.state == "failed" and rig.leftovers()
    assert failing.discard_unfinished("Other-Q8_0") and rig.leftovers() == []


async def test_a_stalled_download_does_not_hold_the_gateways_stop(rig: Rig) -> None:
    """The download's thread is blocked reading a stalled hub (a chunk a minute): the
    gateway's loop still ends at once after its pulls are closed (asyncio's executor would
    join such a thread, holding the stop past systemd's TimeoutStopSec)."""
    rig.hub.publish(REPO, FILES)
    rig.hub.throttle_bps = 1024
    started = threading.Event()

    async def gateway_run() -> None:
        puller = Puller(hub=HuggingFaceHub(endpoint=rig.url), models_dir=lambda: rig.models,
                        catalog=Catalog([], {}), rescan=lambda: asyncio.sleep(0),
                        publish=lambda e: None)
        state = await puller.pull(f"{REPO}:Q8_0")
        while not rig.hub.downloads["Tiny-Q8_0.gguf"]:
            await asyncio.sleep(0.01)
        started.set()
        assert state.state == "downloading"
        await puller.close()

    loop_thread = threading.Thread(target=asyncio.run, args=(gateway_run(),), daemon=True)
    loop_thread.start()
    await until(started.is_set, "the download under way")
    ended = asyncio.get_running_loop().time() + 5.0
    await until(lambda: not loop_thread.is_alive(), "the gateway's loop ended")
    assert asyncio.get_running_loop().time() < ended, "the stop waited for the download"
    assert "Tiny-Q8_0.json" in rig.leftovers()      # its bytes kept for the next start
    rig.hub.throttle_bps = None   # the orphaned thread reads on, sees its cancel, and ends


async def test_a_configured_sources_pull_resumes_after_a_restart_too(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    rig.hub.throttle_bps = 2 * MIB
    model = sourced("tiny", f"{REPO}:Q8_0", rig.models)
    first = rig.puller(catalog=Catalog([model], {}))
    with pytest.raises(ModelDownloading):
        await first.ensure(model, wait_s=0.5)
    await first.close()                   # the gateway stops mid-download
    rig.hub.throttle_bps = None
    second = rig.puller(catalog=Catalog([model], {}))   # its name is its own model's
    await second.resume_unfinished()
    resumed = second.active("tiny")
    assert resumed is not None and resumed.resumed_bytes > 0
    assert (await finished(second, resumed)).state == "done", resumed.error
    assert (rig.models / "tiny" / "Tiny-Q8_0.gguf").read_bytes() == FILES["Tiny-Q8_0.gguf"]


def test_the_token_comes_from_the_services_credential_else_hf_token(tmp_path: Path) -> None:
    (tmp_path / "hf-token").write_text("hf_from_credential\n")
    assert hub_token({"CREDENTIALS_DIRECTORY": str(tmp_path), "HF_TOKEN": "hf_env"}) \
        == "hf_from_credential"
    assert hub_token({"CREDENTIALS_DIRECTORY": str(tmp_path / "none"),
                      "HF_TOKEN": "hf_env"}) == "hf_env"
    assert hub_token({}) is None


@pytest.mark.parametrize("lie", [
    {"lfs": {"sha256": "../../../victim", "size": MIB, "pointerSize": 130}},
    {"lfs": {"sha256": "/tmp/victim", "size": MIB, "pointerSize": 130}},
    {"rfilename": "../Tiny-Q4_K_M.gguf"},
    {"rfilename": "/abs/Tiny-Q4_K_M.gguf"},
])
async def test_a_hostile_hub_cannot_choose_a_path(rig: Rig, lie: dict[str, Any]) -> None:
    """Issue 50: the listing's lfs.sha256 named the partial file unchecked, so a hub could
    append its bytes to (and, when the check failed, delete) any *.part its user reaches.
    A listing entry whose name or hash is not safe is left out: the file is not there."""
    victim = rig.models.parent / "victim.part"
    victim.write_bytes(b"keep")
    rig.hub.publish(REPO, FILES)
    rig.hub.lies["Tiny-Q4_K_M.gguf"] = lie
    with pytest.raises(HubFileNotFound):
        await rig.puller().pull(f"{REPO}:Q4_K_M")
    assert victim.read_bytes() == b"keep"
    assert rig.leftovers() == [] and not (rig.models / "Tiny-Q4_K_M").exists()


async def test_a_hub_that_names_no_commit_is_refused(rig: Rig) -> None:
    rig.hub.publish(REPO, FILES)
    rig.hub.lie_commit = "../../main"
    with pytest.raises(PullError, match="is not a hash"):
        await rig.puller().pull(f"{REPO}:Q4_K_M")
