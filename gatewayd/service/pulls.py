"""Pulls: models downloaded from a hub into models_dir, while the gateway serves.

On disk, under models_dir (the gateway's own; the catalog skips dot-folders), as
service/pull_folder lays it out: a record per pull, its partial bytes, its verified files
gathered, then the model renamed into place in one step.

A file is verified against the hub's SHA-256 (LFS) or git blob id before it leaves
blobs/; a mismatch discards it. A full disk discards the pull's partial bytes (the space
is what was missing); any other failure (the hub unreachable, an error answer) keeps
them and the record, for the next try: a pull again, or the next start (`rm NAME` drops
them). A record whose repository or file is gone is dropped at that start.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gatewayd.core.catalog import Catalog, Model
from gatewayd.core.errors import (
    ChecksumMismatch,
    GatewayError,
    HubFileNotFound,
    HubRepoNotFound,
    InsufficientStorage,
    ModelDownloading,
    ModelExists,
    ModelSourceInvalid,
    PullError,
    PullNotPossible,
)
from gatewayd.core.figures import size_text
from gatewayd.core.ports import HubClient
from gatewayd.core.pull import (
    PullCancelled,
    PullSpec,
    PullState,
    RemoteFile,
    Selection,
    check_space,
    eta_seconds,
    select,
)
from gatewayd.core.safe_paths import inside, is_part
from gatewayd.service.pull_folder import PullFolder

log = logging.getLogger("gatewayd.pull")
# what a pull that could not resume will never get past: its bytes are deleted
GONE = (HubRepoNotFound, HubFileNotFound, ModelSourceInvalid)
PROGRESS_S = 0.5          # how often a running pull's progress is published
KEPT_FINISHED = 20        # finished pulls /admin/pulls still shows
HASH_CHUNK = 4 * 1024 * 1024


class DiskUsage(Protocol):
    @property
    def total(self) -> int: ...

    @property
    def free(self) -> int: ...


@dataclass
class _Pull:
    state: PullState
    selection: Selection
    cancel: threading.Event = field(default_factory=threading.Event)
    task: asyncio.Task[None] | None = None


class Puller:
    def __init__(self, *, hub: HubClient, models_dir: Callable[[], Path | None],
                 catalog: Catalog, rescan: Callable[[], Awaitable[object]],
                 publish: Callable[[dict[str, Any]], None],
                 clock: Callable[[], float] = time.time,
                 disk_usage: Callable[[Path], DiskUsage] = shutil.disk_usage) -> None:
        self._hub = hub
        self._models_dir = models_dir
        self._catalog = catalog
        self._rescan = rescan
        self._publish = publish
        self._clock = clock
        self._disk_usage = disk_usage
        self._active: dict[str, _Pull] = {}
        self._finished: list[PullState] = []
        self._blob_locks: dict[str, asyncio.Lock] = {}
        self._failures: dict[str, GatewayError] = {}   # the last pull of each, if it failed
        self._start_lock = asyncio.Lock()   # one resolution at a time: names are claimed

    # -- what callers see ----------------------------------------------------------------

    def pulls(self) -> list[PullState]:
        return [p.state for p in self._active.values()] + list(reversed(self._finished))

    def active(self, name: str) -> PullState | None:
        pull = self._active.get(name)
        return pull.state if pull else None

    async def pull(self, source: str, *, name: str | None = None,
                   mmproj: bool = False, for_model: bool = False) -> PullState:
        """Start pulling source (or join the pull of the same model already running);
        answers once the files are chosen and known to fit. The download goes on after
        the caller leaves: /admin/events and /admin/pulls follow it. for_model: the file
        of a configured model of that name (its [models.NAME] source), which the name is."""
        spec = PullSpec.parse(source)
        folder = PullFolder(self._writable_models_dir())
        listing = await asyncio.to_thread(self._hub.listing, spec.repo, spec.revision)
        selection = select(spec, listing, mmproj=mmproj, name=name)
        # a gated repository without a token, a file the hub will not serve: said now, to
        # the caller, rather than in a failed pull it may not be following
        await asyncio.to_thread(self._hub.probe, listing.repo, listing.commit,
                                selection.files[0])
        async with self._start_lock:
            if (running := self._active.get(selection.name)) is not None:
                if running.selection.files != selection.files:
                    raise ModelExists(f"{selection.name} is being pulled from "
                                      f"{running.state.source}; wait for it or choose "
                                      "another name (--name)")
                return running.state     # the same files: one download, both follow it
            if (done := folder.already_here(selection, listing.commit, self._clock())
                    ) is not None:
                return done
            if not for_model:
                self._claim_name(folder.models_dir, selection)
            need = sum(max(f.size - folder.partial_size(f), 0) for f in selection.files)
            usage = self._disk_usage(folder.models_dir)
            check_space(str(folder.models_dir), need=need, free=usage.free,
                        filesystem=usage.total)
            state = PullState(name=selection.name, source=str(spec), repo=listing.repo,
                              commit=listing.commit, files=selection.files,
                              started=self._clock(), resumed_bytes=folder.on_disk(
                                  selection.name, selection.files))
            state.done_bytes = state.resumed_bytes
            pull = _Pull(state=state, selection=selection)
            self._failures.pop(selection.name, None)
            folder.record(state, selection.files, mmproj=mmproj, for_model=for_model)
            self._active[selection.name] = pull
        pull.task = asyncio.get_running_loop().create_task(self._run(folder, pull))
        log.info("pulling %s from %s at %s: %s (%s)", selection.name, spec, listing.commit[:12],
                 ", ".join(f.path for f in selection.files), size_text(state.total_bytes))
        self._event(state)
        return state

    async def ensure(self, model: Model, wait_s: float) -> None:
        """A configured model's file pulled from its source (or its pull joined): returns
        once the file is here and the catalog has it, within wait_s; ModelDownloading (503,
        Retry-After: the download's ETA) when it will not be here in time; the pull's own
        error when it fails."""
        if model.config.downloaded or model.config.source is None:
            return
        if self.active(model.id) is None:
            state = await self.pull(model.config.source, name=model.id, for_model=True)
            if state.state == "done":   # pulled meanwhile: the catalog may not know yet
                await self._rescan()
                return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while (pull := self._active.get(model.id)) is not None and pull.task is not None:
            left = deadline - loop.time()
            state = pull.state
            rate = state.meter.rate()
            eta = eta_seconds(state.total_bytes - state.done_bytes, rate)
            if left <= 0 or (eta is not None and eta > left + PROGRESS_S):
                raise ModelDownloading(
                    f"model {model.id!r} is being downloaded from {state.source}: "
                    f"{size_text(state.done_bytes)} of {size_text(state.total_bytes)}"
                    + (f", about {eta:.0f} s left" if eta is not None else "")
                    + "; ask again then", param="model",
                    retry_after=max(1, math.ceil(eta if eta is not None else 10)),
                    done_bytes=state.done_bytes, total_bytes=state.total_bytes)
            await asyncio.wait({pull.task}, timeout=min(left, 1.0))
        if (failure := self._failures.get(model.id)) is not None:
            raise failure

    async def wait(self, name: str) -> PullState | None:
        """The pull of name once it ends (None: there was none)."""
        pull = self._active.get(name)
        if pull is None or pull.task is None:
            return None
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(pull.task)
        return pull.state

    async def cancel(self, name: str) -> PullState | None:
        """Stop the pull of name and discard its bytes (None: there was none)."""
        pull = self._active.get(name)
        if pull is None:
            return None
        pull.cancel.set()
        return await self.wait(name)

    async def pull_sources(self, models: list[Model],
                           then: Callable[[Model], Awaitable[object]]) -> None:
        """At the start: the preload models with a source and no file yet, pulled one at
        a time, each started (then) once it is here."""
        for model in models:
            if model.config.downloaded or not model.config.preload:
                continue
            try:
                await self.ensure(model, wait_s=math.inf)
                if (here := self._catalog.get(model.id)) is not None:
                    await then(here)
            except GatewayError as e:
                log.warning("preload: %s could not be pulled: %s", model.id, e.message)

    async def resume_unfinished(self) -> None:
        """The pulls a previous run did not finish, started again at the bytes they had
        (pinned to the commit they began with)."""
        models_dir = self._models_dir()
        if models_dir is None:
            return
        folder = PullFolder(models_dir)
        for record_path in folder.records():
            try:
                record = json.loads(record_path.read_text())
                spec = PullSpec.parse(record["source"])
                source = str(PullSpec(repo=spec.repo, revision=record["commit"],
                                      file=spec.file, quant=spec.quant))
                await self.pull(source, name=record["name"], mmproj=bool(record["mmproj"]),
                                for_model=bool(record.get("for_model")))
                log.info("resumed the pull of %s", record["name"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("%s: not a pull record (%s); removed", record_path, e)
                record_path.unlink(missing_ok=True)
            except GatewayError as e:
                log.warning("the unfinished pull %s could not resume: %s", record_path.stem,
                            e.message)
                if isinstance(e, GONE):   # it never will: its bytes go
                    folder.discard_record(record_path.stem)

    async def close(self) -> None:
        """The gateway stops: running downloads stop where they are (resumed at the next
        start, their bytes kept)."""
        for pull in list(self._active.values()):
            if pull.task is not None:
                pull.task.cancel()   # first: its bytes are kept (not a user's cancel)
            pull.cancel.set()        # its thread stops at the next chunk
        for pull in list(self._active.values()):
            if pull.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await pull.task

    # -- the download -----------------------------------------------------------------

    async def _run(self, folder: PullFolder, pull: _Pull) -> None:
        state = pull.state
        models_dir = folder.models_dir
        staging = folder.staging(state.name)
        ticker = asyncio.get_running_loop().create_task(self._tick(folder, pull))
        keep_partial = True
        try:
            staging.mkdir(mode=0o700, parents=True, exist_ok=True)
            for file in pull.selection.files:
                await self._fetch(folder, pull, file, staging)
            state.state = "verifying"
            await asyncio.to_thread(folder.land, state, self._clock())
            folder.forget_record(state.name)
            await self._rescan()
            state.state = "done"
            log.info("pulled %s (%s) into %s", state.name, size_text(state.total_bytes),
                     models_dir / state.name)
        except asyncio.CancelledError:
            # the gateway stops: bytes and record stay, the next start resumes
            state.state, state.error = "failed", {"message": "the gateway stopped",
                                                  "code": "shutting_down"}
            raise
        except PullCancelled:
            keep_partial = False
            state.state, state.error = "cancelled", {"message": "cancelled",
                                                     "code": "cancelled"}
        except OSError as e:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            keep_partial = False
            error: GatewayError = (
                InsufficientStorage(f"{models_dir} filled up while pulling {state.name}: the "
                                    "partial download was deleted; free space and pull again")
                if full else PullError(f"pulling {state.name} failed writing under "
                                       f"{models_dir}: {e.strerror or e}"))
            self._fail(state, error)
        except GatewayError as e:
            # what arrived is kept for the next try (pull again, or the next start): it is
            # checked when whole; bytes that failed their check are gone already
            keep_partial = not isinstance(e, ChecksumMismatch)
            self._fail(state, e)
        except Exception as e:
            log.exception("pulling %s failed", state.name)
            self._fail(state, PullError(f"pulling {state.name} failed: {e}"))
        finally:
            ticker.cancel()
            state.finished = self._clock()
            if state.state != "done" and not keep_partial:
                await asyncio.to_thread(folder.discard, state.name, pull.selection.files)
            elif state.state == "done":
                state.done_bytes = state.total_bytes
            self._active.pop(state.name, None)
            self._finished = [*self._finished, state][-KEPT_FINISHED:]
            self._event(state)

    async def _fetch(self, folder: PullFolder, pull: _Pull, file: RemoteFile,
                     staging: Path) -> None:
        if pull.cancel.is_set():
            raise PullCancelled
        target = inside(staging, file.name, what="the hub's file name")
        if target.exists():
            return   # verified in an earlier run that stopped before the model was whole
        part = folder.part_path(file)
        lock = self._blob_locks.setdefault(part.name, asyncio.Lock())
        async with lock:   # two names pulling one file must not append to one part file
            await _in_daemon_thread(self._download, pull, file, part)
            pull.state.state = "verifying"
            await _in_daemon_thread(_verify, part, file)
            os.chmod(part, 0o644)   # the engines (another user) read it; UMask=0077
            os.replace(part, target)
            pull.state.state = "downloading"

    def _download(self, pull: _Pull, file: RemoteFile, part: Path) -> None:
        part.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(part, "ab") as out:
            have = out.tell()
            if have > file.size:   # not this file's bytes: start again
                out.truncate(0)
                have = 0
            if have == file.size:
                return
            self._hub.download(pull.state.repo, pull.state.commit, file, out, pull.cancel)

    async def _tick(self, folder: PullFolder, pull: _Pull) -> None:
        state = pull.state
        while True:
            done = state.done_bytes = folder.on_disk(state.name, pull.selection.files)
            state.meter.add(self._clock(), done)
            self._event(state)
            await asyncio.sleep(PROGRESS_S)

    # -- files ------------------------------------------------------------------------

    def _writable_models_dir(self) -> Path:
        models_dir = self._models_dir()
        if models_dir is None:
            raise PullNotPossible("no models_dir is configured: pulled models go there "
                                  "(set models_dir in the gateway's configuration)")
        if not os.access(models_dir, os.W_OK | os.X_OK):
            raise PullNotPossible(
                f"models_dir {models_dir} is not writable by the gateway (user "
                f"{_user()}): pulled models go there (chown it, or with the system "
                "service add it to ReadWritePaths=)")
        return models_dir

    def _claim_name(self, models_dir: Path, selection: Selection) -> None:
        name = selection.name
        if (models_dir / name).exists() or self._catalog.find_served(name) is not None:
            raise ModelExists(f"a model called {name!r} is already served here; pull it "
                              "under another name (--name)")
        for f in selection.files:
            if (other := self._catalog.find(f.name)) is not None:
                raise ModelExists(f"{f.name} would also name the model {other.id!r}; pull "
                                  "it under another name (--name) or remove that one")

    def discard_unfinished(self, name: str) -> bool:
        """A pull that ended without its model (failed, or the gateway stopped): its
        record and bytes deleted (rm of a name that is not a model yet). A name that
        could not be a pull's (a path, a catalog name with '/') has none."""
        models_dir = self._models_dir()
        if models_dir is None or name in self._active or not is_part(name):
            return False
        folder = PullFolder(models_dir)
        if not folder.record_path(name).exists():
            return False
        folder.discard_record(name)
        return True

    def _fail(self, state: PullState, error: GatewayError) -> None:
        self._failures[state.name] = error
        state.state = "failed"
        state.error = {"message": error.message, "type": error.type, "code": error.code}
        log.warning("pulling %s failed: %s", state.name, error.message)

    def _event(self, state: PullState) -> None:
        self._publish({"type": "pull", **state.describe()})


async def _in_daemon_thread(fn: Callable[..., None], *args: Any) -> None:
    """fn(*args) in a thread of its own that does not hold the process up when the
    gateway stops (asyncio's executor joins its threads at the loop's end: a download
    stalled on the network would hold the stop for its read timeouts and retries, past
    systemd's TimeoutStopSec). A cancelled pull's thread ends at its next chunk."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        try:
            fn(*args)
            outcome: BaseException | None = None
        except BaseException as e:   # handed to the awaiting task, whatever it is
            outcome = e
        with contextlib.suppress(RuntimeError):   # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name="llm-gateway pull", daemon=True).start()
    await done


def _verify(path: Path, file: RemoteFile) -> None:
    """The file's bytes against the hub's hash of them; a mismatch deletes them."""
    if file.sha256:
        digest, want = hashlib.sha256(), file.sha256.lower()
    elif file.git_sha1:
        digest, want = hashlib.sha1(f"blob {file.size}\0".encode()), file.git_sha1.lower()
    else:
        return   # the hub gave nothing to check by; the size was (http_get)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    if (got := digest.hexdigest()) != want:
        path.unlink(missing_ok=True)
        raise ChecksumMismatch(f"{file.path} arrived hashing to {got[:16]}…, the hub says "
                               f"{want[:16]}…: discarded (pull again)")


def _user() -> str:
    try:
        import pwd
        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())
