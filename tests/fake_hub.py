"""A stand-in for the Hugging Face Hub, for the tests of `llm-gateway pull`: the real
huggingface_hub client is pointed at it (HF_ENDPOINT or endpoint=) and downloads from it as
it would from huggingface.co, while the test publishes the repos and makes the transfer
misbehave on cue (a connection cut mid-file, bytes that do not match their sha256, a slow
line, a gated repo).

What it answers, as the hub does (the headers huggingface_hub reads, in file_download.py,
hf_api.py and utils/_http.py):
- GET /api/models/{repo}[/revision/{rev}][?blobs=true]: the model info; with blobs each
  sibling has size, blobId (the git blob id: of the LFS pointer for an LFS file) and, for
  LFS files, lfs {sha256, size, pointerSize}. A gated repo's info is public ("gated":
  "manual"), as on the hub.
- HEAD and GET /{repo}/resolve/{rev}/{path}, rev a branch ("main") or a commit's 40 hex:
  a small git file is answered in place (ETag: its blob id, X-Repo-Commit); an LFS file is
  a 302 to the CDN with X-Repo-Commit, X-Linked-Etag (its sha256), X-Linked-Size and
  ETag (the pointer's blob id), the metadata the client takes from the redirect itself.
- GET /cdn/{sha256}?...: the CDN, with single byte ranges (206, Content-Range; 416 past
  the end) and a URL that expires (403 after cdn_ttl_s, as a signed CloudFront URL does).
  It listens on a port of its own: the client follows a redirect that stays on the hub's
  origin (a renamed repo), so a CDN on the hub's origin would be followed by the HEAD and
  the metadata lost; on another origin the HEAD stops at the 302 and the token is not sent
  on, as with the real CDN.
- Errors with X-Error-Code / X-Error-Message and a JSON {"error"}: RepoNotFound (401 to a
  caller without a token, 404 with one: the hub's answer for a missing or private repo),
  GatedRepo (401 without a token, 403 with another than `token`), RevisionNotFound,
  EntryNotFound (with X-Repo-Commit, which the client caches as "no such file").

Not imitated: Xet storage (no X-Xet-Hash, so the client takes plain HTTP), tags and other
branches than main, private repos, datasets and spaces, the tree and paths-info APIs,
compressed answers, signed URLs' signatures, rate limits, the model info's GGUF summary.
Every repo gets a .gitattributes, as a new hub repo does; a file is in LFS by its suffix
(.gguf, .safetensors, ...) or when over 10 MiB, as the hub's default .gitattributes and
its size limit for plain git make it.

Serve it with `serve_hub` (async tests), `in_thread` (synchronous ones: the client is
synchronous) or as a process: python -m tests.fake_hub --port N --publish org/repo=PATH
[,PATH...] [--gated org/repo] [--throttle BPS], which prints its URL once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import json
import re
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from aiohttp import web

# the hub's default .gitattributes, in short: what it keeps in LFS by name
LFS_PATTERNS = ("*.gguf", "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.onnx",
                "*.h5", "*.msgpack", "*.npy", "*.zip", "*.tar.gz")
# and by size: the hub refuses a plain git file over 10 MiB, so anything larger is LFS
LFS_THRESHOLD = 10 * 1024 * 1024
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n"
                        for p in LFS_PATTERNS).encode()
CHUNK = 64 * 1024            # a CDN body is written in pieces this size (cut and pace)
DEFAULT_TTL_S = 3600.0       # how long a CDN URL is good for (the hub's are ~1 h)

_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass(frozen=True)
class _Blob:
    data: bytes
    sha256: str
    blob_id: str          # git's id: of the content, or of the LFS pointer that stands for it
    lfs: bool
    pointer_size: int     # 0 when not in LFS

    @classmethod
    def of(cls, path: str, data: bytes) -> _Blob:
        sha256 = hashlib.sha256(data).hexdigest()
        lfs = len(data) > LFS_THRESHOLD or any(
            path.endswith(p.removeprefix("*")) for p in LFS_PATTERNS)
        if not lfs:
            return cls(data, sha256, _git_blob_id(data), False, 0)
        pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
                   f"size {len(data)}\n").encode()
        return cls(data, sha256, _git_blob_id(pointer), True, len(pointer))


@dataclass
class _Commit:
    sha: str
    files: dict[str, _Blob]
    at: datetime


@dataclass
class _Repo:
    id: str
    gated: bool
    created: datetime
    commits: dict[str, _Commit] = field(default_factory=dict)
    main: str = ""        # the commit main points at


class _Unsatisfiable(Exception):
    """A Range that starts past the end: 416."""


@dataclass
class FakeHub:
    # filename (its path in the repo) -> cut the connection after this many body bytes of
    # the next GET of it (then the entry is gone: the retry goes through)
    cut_after: dict[str, int] = field(default_factory=dict)
    # filenames served with one byte changed (same length), their metadata still true
    corrupt: set[str] = field(default_factory=set)
    # a hostile (or impersonated) hub: filename -> fields of its listing entry replaced
    # ({"rfilename": "../x.gguf"}, {"lfs": {"sha256": "/etc/x", ...}}), the bytes as before
    lies: dict[str, dict[str, Any]] = field(default_factory=dict)
    lie_commit: str | None = None     # the listing's "sha" replaced
    token: str = "hf_test"            # the token a gated repo wants (Authorization: Bearer)
    throttle_bps: int | None = None   # bodies paced to this many bytes a second
    cdn_ttl_s: float = DEFAULT_TTL_S  # a CDN URL's life (negative: handed out expired)
    host: str = "127.0.0.1"
    port: int = 0                     # the hub's (0: any free one, known once started)
    cdn_port: int = 0                 # the CDN's, likewise
    downloads: collections.Counter[str] = field(default_factory=collections.Counter)
    gets: list[tuple[str, str | None]] = field(default_factory=list)   # (file, its Range)
    bytes_served: int = 0             # body bytes written, over every GET
    # (kept out of the repr: a failed assertion on the hub would print every file)
    _repos: dict[str, _Repo] = field(default_factory=dict, repr=False)
    _runner: web.AppRunner | None = field(default=None, repr=False)
    # its own, when served by in_thread
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def publish(self, repo: str, files: dict[str, bytes], *, gated: bool = False) -> str:
        """A new commit on repo's main holding exactly files (and a .gitattributes), the
        repo made if new; its sha. Earlier commits stay resolvable by their sha; gated is
        the repo's gate from now on (for its every commit, as on the hub)."""
        now = datetime.now(UTC)
        entry = self._repos.setdefault(repo, _Repo(repo, gated, now))
        entry.gated = gated
        blobs = {path: _Blob.of(path, data)
                 for path, data in sorted({".gitattributes": GITATTRIBUTES, **files}.items())}
        # git-like: the content and the parent, so publishing the same files again is
        # still a new commit
        sha = hashlib.sha1(json.dumps(
            [repo, entry.main, len(entry.commits), [(p, b.blob_id) for p, b in blobs.items()]]
        ).encode()).hexdigest()
        entry.commits[sha] = _Commit(sha, blobs, now)
        entry.main = sha
        return sha

    def app(self) -> web.Application:
        app = web.Application()
        repo = r"{org:[^/]+}/{name:[^/]+}"
        app.router.add_get(f"/api/models/{repo}", self.model_info)
        app.router.add_get(f"/api/models/{repo}/revision/{{rev}}", self.model_info)
        app.router.add_get(f"/{repo}/resolve/{{rev}}/{{path:.+}}", self.resolve)  # + HEAD
        app.router.add_get("/cdn/{sha256}", self.cdn)
        app.on_response_prepare.append(_request_id)
        return app

    async def model_info(self, request: web.Request) -> web.Response:
        repo, commit = self._find(request)
        blobs = request.query.get("blobs", "").lower() in ("true", "1")
        siblings: list[dict[str, Any]] = []
        for path, blob in commit.files.items():
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling |= {"blobId": blob.blob_id, "size": len(blob.data)}
                if blob.lfs:
                    sibling["lfs"] = {"sha256": blob.sha256, "size": len(blob.data),
                                      "pointerSize": blob.pointer_size}
            siblings.append(sibling | self.lies.get(path, {}))
        return web.json_response({
            "_id": hashlib.sha1(repo.id.encode()).hexdigest()[:24],
            "id": repo.id, "modelId": repo.id, "author": repo.id.split("/")[0],
            "sha": self.lie_commit or commit.sha, "lastModified": _hub_time(commit.at),
            "createdAt": _hub_time(repo.created), "private": False, "disabled": False,
            "gated": "manual" if repo.gated else False, "downloads": 0, "likes": 0,
            "tags": ["gguf"] if any(p.endswith(".gguf") for p in commit.files) else [],
            "siblings": siblings, "spaces": [],
            "usedStorage": sum(len(b.data) for b in commit.files.values()),
        })

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        _, commit = self._find(request, gate=True)
        path = request.match_info["path"]
        blob = commit.files.get(path)
        if blob is None:
            raise _error(404, "EntryNotFound", f"{path} does not exist on \"{commit.sha}\"",
                         {"X-Repo-Commit": commit.sha})
        disposition = _disposition(path)
        if not blob.lfs:
            return await self._body(request, path, blob, {
                "X-Repo-Commit": commit.sha, "ETag": f'"{blob.blob_id}"',
                "Content-Disposition": disposition})
        expires = int(time.time() + self.cdn_ttl_s)
        query = (f"response-content-disposition={quote(disposition, safe='')}"
                 f"&Expires={expires}&X-Repo-File={quote(path, safe='')}")
        location = f"http://{request.url.host}:{self.cdn_port}/cdn/{blob.sha256}?{query}"
        return web.Response(status=302, text=f"Found. Redirecting to {location}", headers={
            "Location": location, "X-Repo-Commit": commit.sha,
            "X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(len(blob.data)),
            "ETag": f'"{blob.blob_id}"', "Accept-Ranges": "bytes"})

    async def cdn(self, request: web.Request) -> web.StreamResponse:
        """A signed CDN URL's answer: the bytes, whoever asks, until it expires."""
        path = request.query.get("X-Repo-File", "")
        blob = self._lfs_blob(request.match_info["sha256"], path)
        try:
            expires = int(request.query["Expires"])
        except (KeyError, ValueError):
            expires = 0
        if blob is None:
            return web.Response(status=404, text="<Error><Code>NoSuchKey</Code></Error>",
                                content_type="application/xml")
        if time.time() > expires:
            return web.Response(status=403, content_type="application/xml", text=(
                "<Error><Code>AccessDenied</Code><Message>Request has expired</Message>"
                "</Error>"))
        return await self._body(request, path, blob, {
            "ETag": f'"{blob.sha256}"',
            "Content-Disposition": request.query.get("response-content-disposition",
                                                     _disposition(path))})

    def _lfs_blob(self, sha256: str, path: str) -> _Blob | None:
        for repo in self._repos.values():
            for commit in repo.commits.values():
                blob = commit.files.get(path)
                if blob is not None and blob.lfs and blob.sha256 == sha256:
                    return blob
        return None

    def _find(self, request: web.Request, *, gate: bool = False) -> tuple[_Repo, _Commit]:
        """The repo and commit a request names, or the hub's error for the first thing
        wrong, in the hub's order: the repo, its gate, the revision."""
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        repo = self._repos.get(repo_id)
        auth = request.headers.get("Authorization")
        if repo is None:
            raise _error(401 if auth is None else 404, "RepoNotFound",
                         "Repository not found")
        if gate and repo.gated and auth != f"Bearer {self.token}":
            if auth is None:
                raise _error(401, "GatedRepo", f"Access to model {repo_id} is restricted. "
                             "You must have access to it and be authenticated to access it. "
                             "Please log in.")
            raise _error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you "
                         f"are not in the authorized list. Visit {self.url}/{repo_id} to ask "
                         "for access.")
        rev = request.match_info.get("rev", "main")
        sha = repo.main if rev == "main" else rev if _COMMIT_SHA.fullmatch(rev) else None
        commit = repo.commits.get(sha) if sha is not None else None
        if commit is None:
            raise _error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo, commit

    async def _body(self, request: web.Request, path: str, blob: _Blob,
                    headers: dict[str, str]) -> web.StreamResponse:
        """A file's bytes, or the Range of them asked for, paced and cut as the test set."""
        data = blob.data
        if path in self.corrupt and data:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
        headers = {**headers, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        try:
            span = _byte_range(request.headers.get("Range"), len(data))
        except _Unsatisfiable:
            return web.Response(status=416, headers={
                **headers, "Content-Range": f"bytes */{len(data)}"})
        start, end = span or (0, len(data))
        if span is not None:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        response = web.StreamResponse(status=206 if span else 200, headers=headers)
        response.content_length = end - start
        await response.prepare(request)
        if request.method == "HEAD":
            return response
        self.downloads[path] += 1
        self.gets.append((path, request.headers.get("Range")))
        cut = self.cut_after.pop(path, None)
        step = CHUNK if self.throttle_bps is None else max(1, min(CHUNK, self.throttle_bps // 10))
        sent = 0
        while start + sent < end:
            n = min(step, end - start - sent)
            if cut is not None:
                n = min(n, cut - sent)
            await response.write(data[start + sent:start + sent + n])
            sent += n
            self.bytes_served += n
            if cut is not None and sent >= cut:
                # close, not abort: what was written reaches the client, then the end of
                # the connection, short of Content-Length (the client's "peer closed")
                assert request.transport is not None
                request.transport.close()
                return response
            if self.throttle_bps is not None:
                await asyncio.sleep(n / self.throttle_bps)
        await response.write_eof()
        return response

    async def start(self) -> None:
        """The hub and its CDN listening, each on its port (see the module's docstring)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        for attr in ("port", "cdn_port"):
            site = web.TCPSite(self._runner, self.host, getattr(self, attr),
                               reuse_address=True)
            await site.start()
            server = site._server
            assert server is not None and server.sockets   # type: ignore[attr-defined]
            setattr(self, attr, server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def call(self, step: Awaitable[None]) -> None:
        """From another thread: run step (start(), stop()) on in_thread's loop."""
        assert self._loop is not None, "not served by in_thread"
        asyncio.run_coroutine_threadsafe(_awaited(step), self._loop).result(10)


@contextlib.asynccontextmanager
async def serve_hub(hub: FakeHub) -> AsyncIterator[str]:
    """hub served on this loop; its base URL (what HF_ENDPOINT or endpoint= is set to).
    The client is synchronous: call it off the loop (asyncio.to_thread), or use in_thread."""
    await hub.start()
    try:
        yield hub.url
    finally:
        await hub.stop()


@contextlib.contextmanager
def in_thread(hub: FakeHub) -> Iterator[FakeHub]:
    """hub served by an event loop of its own in a thread, for synchronous tests (its
    settings may be changed, and repos published, from the test's thread between
    requests)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-hub", daemon=True)
    thread.start()
    try:
        hub._loop = loop
        hub.call(hub.start())
        yield hub
    finally:
        hub.call(hub.stop())
        hub._loop = None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a single `bytes=` range; None for none, or for one this server
    ignores (several ranges, malformed), as RFC 9110 lets it: the whole file, 200."""
    found = _RANGE.fullmatch(header.strip()) if header is not None else None
    if found is None or found.group(1) == found.group(2) == "":
        return None
    first, last = found.groups()
    if first == "":                          # bytes=-N: the last N
        if int(last) == 0:
            raise _Unsatisfiable
        return max(size - int(last), 0), size
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        raise _Unsatisfiable
    return start, size if last == "" else min(int(last) + 1, size)


def _error(status: int, code: str, message: str,
           headers: dict[str, str] | None = None) -> web.HTTPException:
    """The hub's error: the code and message in headers (HEAD has no body) and in JSON."""
    kind = {401: web.HTTPUnauthorized, 403: web.HTTPForbidden, 404: web.HTTPNotFound}[status]
    return kind(text=json.dumps({"error": message}), content_type="application/json",
                headers={"X-Error-Code": code, "X-Error-Message": message, **(headers or {})})


async def _request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer has an id, as the hub's do (the client quotes it in its errors)."""
    response.headers["X-Request-Id"] = f"Root=1-{int(time.time()):08x}-{id(request):024x}"


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hub_time(at: datetime) -> str:
    """The one date format huggingface_hub parses: milliseconds and a Z."""
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def _disposition(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return f"inline; filename*=UTF-8''{quote(name)}; filename=\"{name}\";"


async def _awaited(step: Awaitable[None]) -> None:
    await step


async def _main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fake_hub")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--cdn-port", type=int, default=0)
    parser.add_argument("--publish", action="append", default=[], metavar="ORG/REPO=PATH,...",
                        help="a repo of these files, each under its own name (repeatable)")
    parser.add_argument("--gated", action="append", default=[], metavar="ORG/REPO")
    parser.add_argument("--token", default=FakeHub.token)
    parser.add_argument("--throttle", type=int, default=None, metavar="BPS")
    args = parser.parse_args(argv)
    hub = FakeHub(token=args.token, throttle_bps=args.throttle, host=args.host,
                  port=args.port, cdn_port=args.cdn_port)
    for spec in args.publish:
        repo, _, paths = spec.partition("=")
        files = {Path(p).name: Path(p).read_bytes() for p in paths.split(",") if p}
        sha = hub.publish(repo, files, gated=repo in args.gated)
        print(f"published {repo} at {sha}: {', '.join(files)}", file=sys.stderr)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    async with serve_hub(hub) as url:
        print(url, flush=True)
        await stopped.wait()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1:]))
