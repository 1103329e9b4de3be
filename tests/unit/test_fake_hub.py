"""The fake hub (tests/fake_hub.py) driven by the real huggingface_hub client, through the
calls `llm-gateway pull` makes: model_info with the files' metadata, the HEAD of a file's
URL, http_get from the CDN (resumed, cut, corrupted), and hf_hub_download as a whole. What
the client reads here as the hub, the pull's tests can take for the hub."""

from __future__ import annotations

import asyncio
import hashlib
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.hf_api import RepoSibling
from huggingface_hub.utils import build_hf_headers

from tests.fake_hub import FakeHub, in_thread, serve_hub
from tests.harness.plugin import REPO

REPO_ID = "org/tiny-GGUF"
GGUF = "tiny-Q4_K_M.gguf"
WEIGHTS = b"GGUF" + random.Random(1).randbytes(50_000)
README = b"# tiny\nA model for the tests.\n"
# a file of several of the client's chunks (DOWNLOAD_CHUNK_SIZE, made small below): a cut
# connection leaves whole chunks written, which the retry resumes after
BIG = "big-Q8_0.gguf"
BIG_BYTES = b"GGUF" + random.Random(2).randbytes(3_000_000)
CHUNK = 64 * 1024


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    # the client writes 10 MiB at a time: a cut before the first 10 MiB would leave nothing
    # written and the retry would start over without a Range. A small chunk lets a 3 MB
    # file show the resume (a real GGUF is far larger than one chunk)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    with in_thread(FakeHub()) as fake:
        yield fake


@pytest.fixture
def commit(hub: FakeHub) -> str:
    return hub.publish(REPO_ID, {GGUF: WEIGHTS, BIG: BIG_BYTES, "README.md": README})


def siblings(hub: FakeHub, revision: str | None = None, *, token: str | bool = False,
             files_metadata: bool = True) -> dict[str, RepoSibling]:
    info = HfApi(endpoint=hub.url, token=token).model_info(
        REPO_ID, revision=revision, files_metadata=files_metadata)
    assert info.siblings is not None
    return {s.rfilename: s for s in info.siblings}


def location(hub: FakeHub, filename: str, revision: str | None = None,
             token: str | bool = False) -> str:
    url = hf_hub_url(REPO_ID, filename, revision=revision, endpoint=hub.url)
    return get_hf_file_metadata(url, token=token, endpoint=hub.url).location


def fetch(url: str, into: Path, *, resume_size: int = 0, expected_size: int | None = None,
          token: str | bool = False) -> bytes:
    with into.open("ab") as f:
        http_get(url, f, resume_size=resume_size, headers=build_hf_headers(token=token),
                 expected_size=expected_size)
    return into.read_bytes()


def test_model_info_gives_each_file_its_size_and_sha256(hub: FakeHub, commit: str) -> None:
    info = HfApi(endpoint=hub.url, token=False).model_info(REPO_ID, files_metadata=True)
    assert info.sha == commit and info.id == REPO_ID and info.gated is False
    assert info.siblings is not None
    files = {s.rfilename: s for s in info.siblings}
    assert sorted(files) == [".gitattributes", "README.md", BIG, GGUF]
    gguf = files[GGUF]
    assert gguf.size == len(WEIGHTS) and gguf.lfs is not None
    assert gguf.lfs.sha256 == sha256(WEIGHTS) and gguf.lfs.size == len(WEIGHTS)
    pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256(WEIGHTS)}\n"
               f"size {len(WEIGHTS)}\n").encode()
    assert gguf.lfs.pointer_size == len(pointer) and gguf.blob_id == git_blob_id(pointer)
    readme = files["README.md"]     # plain git: no LFS, its id the content's
    assert readme.lfs is None and readme.size == len(README)
    assert readme.blob_id == git_blob_id(README)
    # without files_metadata, names only (as the hub answers a listing)
    assert {s.size for s in siblings(hub, files_metadata=False).values()} == {None}


def test_publishing_again_moves_main_and_the_old_commit_stays(hub: FakeHub,
                                                              commit: str) -> None:
    newer = hub.publish(REPO_ID, {GGUF: b"GGUF v2"})
    assert newer != commit and len(newer) == 40
    assert HfApi(endpoint=hub.url, token=False).model_info(REPO_ID).sha == newer
    assert siblings(hub, "main")[GGUF].size == len(b"GGUF v2")
    assert siblings(hub, commit)[GGUF].size == len(WEIGHTS)
    meta = get_hf_file_metadata(hf_hub_url(REPO_ID, GGUF, revision=commit, endpoint=hub.url),
                                token=False, endpoint=hub.url)
    assert meta.commit_hash == commit and meta.etag == sha256(WEIGHTS)
    with pytest.raises(RevisionNotFoundError):
        siblings(hub, "0" * 40)
    with pytest.raises(RevisionNotFoundError):
        location(hub, GGUF, "0" * 40)
    with pytest.raises(RemoteEntryNotFoundError):
        location(hub, BIG)             # not in the newer commit


def test_an_lfs_file_s_metadata_comes_from_the_redirect_to_the_cdn(hub: FakeHub,
                                                                    commit: str) -> None:
    url = hf_hub_url(REPO_ID, GGUF, revision=commit, endpoint=hub.url)
    assert url == f"{hub.url}/{REPO_ID}/resolve/{commit}/{GGUF}"
    meta = get_hf_file_metadata(url, token=False, endpoint=hub.url)
    assert meta.commit_hash == commit
    assert meta.etag == sha256(WEIGHTS) and meta.size == len(WEIGHTS)
    # another origin than the hub's: the client stops at the 302, as with the real CDN
    assert meta.location.startswith(f"http://127.0.0.1:{hub.cdn_port}/cdn/{sha256(WEIGHTS)}?")
    assert hub.cdn_port != hub.port and hub.downloads == {}
    # by branch too; a plain git file is answered in place, its etag the blob id
    readme = get_hf_file_metadata(hf_hub_url(REPO_ID, "README.md", endpoint=hub.url),
                                  token=False, endpoint=hub.url)
    assert readme.commit_hash == commit and readme.etag == git_blob_id(README)
    assert readme.size == len(README)
    assert readme.location == hf_hub_url(REPO_ID, "README.md", endpoint=hub.url)


def test_http_get_whole_and_resumed_with_a_range(hub: FakeHub, commit: str,
                                                 tmp_path: Path) -> None:
    url = location(hub, GGUF, commit)
    assert sha256(fetch(url, tmp_path / "whole", expected_size=len(WEIGHTS))) == \
        sha256(WEIGHTS)
    assert hub.gets == [(GGUF, None)] and hub.bytes_served == len(WEIGHTS)
    part = tmp_path / "part"
    part.write_bytes(WEIGHTS[:12_345])
    got = fetch(url, part, resume_size=12_345, expected_size=len(WEIGHTS))
    assert sha256(got) == sha256(WEIGHTS)
    # only the rest was asked for and sent
    assert hub.gets[1] == (GGUF, "bytes=12345-")
    assert hub.bytes_served == 2 * len(WEIGHTS) - 12_345
    assert hub.downloads[GGUF] == 2


def test_a_cut_connection_is_resumed_inside_http_get(hub: FakeHub, commit: str,
                                                     tmp_path: Path) -> None:
    cut = 16 * CHUNK
    hub.cut_after[BIG] = cut
    got = fetch(location(hub, BIG, commit), tmp_path / "big", expected_size=len(BIG_BYTES))
    assert sha256(got) == sha256(BIG_BYTES)
    # http_get's own retry: a second GET of the rest, from where the cut left it
    assert hub.downloads[BIG] == 2
    assert hub.gets == [(BIG, None), (BIG, f"bytes={cut}-")]
    assert hub.bytes_served == len(BIG_BYTES)
    assert hub.cut_after == {}                  # once


def test_a_corrupt_file_has_its_length_but_not_its_sha256(hub: FakeHub, commit: str,
                                                          tmp_path: Path) -> None:
    hub.corrupt.add(GGUF)
    lfs = siblings(hub)[GGUF].lfs
    assert lfs is not None and lfs.sha256 == sha256(WEIGHTS)   # the metadata stays true
    got = fetch(location(hub, GGUF, commit), tmp_path / "bad", expected_size=len(WEIGHTS))
    assert len(got) == len(WEIGHTS) and sha256(got) != lfs.sha256


def test_a_gated_repo_wants_the_token(hub: FakeHub, tmp_path: Path) -> None:
    hub.publish(REPO_ID, {GGUF: WEIGHTS}, gated=True)
    # its info is public, as on the hub
    info = HfApi(endpoint=hub.url, token=False).model_info(REPO_ID, files_metadata=True)
    assert info.gated == "manual"
    with pytest.raises(GatedRepoError) as no_token:
        location(hub, GGUF)
    assert no_token.value.response.status_code == 401
    assert "restricted" in str(no_token.value)
    with pytest.raises(GatedRepoError) as other_token:
        location(hub, GGUF, token="hf_someone_else")
    assert other_token.value.response.status_code == 403
    with pytest.raises(GatedRepoError):
        hf_hub_download(REPO_ID, GGUF, local_dir=tmp_path, endpoint=hub.url, token=False)
    assert hub.downloads == {}
    url = location(hub, GGUF, token=hub.token)
    # the CDN URL is signed: the client sends no token there (another origin)
    assert sha256(fetch(url, tmp_path / "got")) == sha256(WEIGHTS)
    path = hf_hub_download(REPO_ID, GGUF, local_dir=tmp_path / "dl", endpoint=hub.url,
                           token=hub.token)
    assert Path(path).read_bytes() == WEIGHTS


def test_unknown_repo_and_unknown_file(hub: FakeHub, commit: str, tmp_path: Path) -> None:
    for token in (False, "hf_anyone"):     # 401 without a token, 404 with: both "not found"
        with pytest.raises(RepositoryNotFoundError) as missing:
            HfApi(endpoint=hub.url, token=token).model_info("org/nothing")
        assert not isinstance(missing.value, GatedRepoError)
    with pytest.raises(RepositoryNotFoundError):
        get_hf_file_metadata(hf_hub_url("org/nothing", GGUF, endpoint=hub.url), token=False)
    with pytest.raises(RemoteEntryNotFoundError) as no_file:
        location(hub, "tiny-Q2_K.gguf")
    assert isinstance(no_file.value, EntryNotFoundError)
    assert no_file.value.response.headers["X-Repo-Commit"] == commit
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO_ID, "tiny-Q2_K.gguf", local_dir=tmp_path, endpoint=hub.url,
                        token=False)


def test_hf_hub_download_into_a_local_dir(hub: FakeHub, commit: str, tmp_path: Path) -> None:
    for name, data in ((GGUF, WEIGHTS), ("README.md", README)):
        path = hf_hub_download(REPO_ID, name, local_dir=tmp_path, endpoint=hub.url,
                               token=False)
        assert Path(path) == tmp_path / name and Path(path).read_bytes() == data
    # the LFS file from the CDN, the plain one from the hub itself; once each
    assert hub.downloads == {GGUF: 1, "README.md": 1}
    # again: the local copy's commit is main's, nothing is fetched
    hf_hub_download(REPO_ID, GGUF, local_dir=tmp_path, endpoint=hub.url, token=False)
    assert hub.downloads[GGUF] == 1


def test_ranges_and_expiry_on_the_cdn(hub: FakeHub, commit: str) -> None:
    url = location(hub, GGUF, commit)
    size = len(WEIGHTS)
    with httpx2.Client() as http:
        part = http.get(url, headers={"Range": "bytes=10-19"})
        assert part.status_code == 206 and part.content == WEIGHTS[10:20]
        assert part.headers["Content-Range"] == f"bytes 10-19/{size}"
        tail = http.get(url, headers={"Range": "bytes=-5"})
        assert tail.status_code == 206 and tail.content == WEIGHTS[-5:]
        past = http.get(url, headers={"Range": f"bytes={size}-"})
        assert past.status_code == 416 and past.headers["Content-Range"] == f"bytes */{size}"
        whole = http.get(url, headers={"Range": "bytes=0-1,5-6"})   # several: ignored
        assert whole.status_code == 200 and whole.content == WEIGHTS
        hub.cdn_ttl_s = -1
        expired = location(hub, GGUF, commit)
        assert http.get(expired).status_code == 403


def test_throttle_paces_the_body(hub: FakeHub, commit: str, tmp_path: Path) -> None:
    hub.throttle_bps = 100_000
    start = time.monotonic()
    fetch(location(hub, GGUF, commit), tmp_path / "slow")
    assert time.monotonic() - start >= len(WEIGHTS) / 100_000 * 0.9


async def test_serve_hub_on_the_test_s_loop() -> None:
    fake = FakeHub()
    commit = fake.publish(REPO_ID, {GGUF: WEIGHTS})
    async with serve_hub(fake) as url:
        assert url == fake.url
        # the client is synchronous: off the loop that serves the hub
        info = await asyncio.to_thread(HfApi(endpoint=url, token=False).model_info, REPO_ID)
    assert info.sha == commit


def test_the_runner_serves_what_it_was_given_until_sigterm(tmp_path: Path) -> None:
    weights = tmp_path / GGUF
    weights.write_bytes(WEIGHTS)
    (tmp_path / "README.md").write_bytes(README)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_hub", "--publish",
         f"{REPO_ID}={weights},{tmp_path / 'README.md'}", "--gated", REPO_ID],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read() if proc.stderr else ""
        info = HfApi(endpoint=url, token=False).model_info(REPO_ID, files_metadata=True)
        assert info.gated == "manual" and info.siblings is not None
        assert {s.rfilename for s in info.siblings} == {".gitattributes", GGUF, "README.md"}
        path = hf_hub_download(REPO_ID, GGUF, local_dir=tmp_path / "dl", endpoint=url,
                               token=FakeHub.token)
        assert Path(path).read_bytes() == WEIGHTS
        with pytest.raises(HfHubHTTPError):
            get_hf_file_metadata(hf_hub_url(REPO_ID, GGUF, endpoint=url), token=False)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
