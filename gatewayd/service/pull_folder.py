"""A pull's files on disk, under one models_dir: where its bytes, record and verified files
live, and how they are landed or discarded. Synchronous file work only; the puller
(pulls.py) decides and awaits. The layout:

    .pull/<name>.json           what is being pulled (source, commit, files): a pull the
                                gateway did not finish is resumed when it starts again
    .pull/blobs/<hash>.part     a file's bytes so far, appended to (resumable)
    .pull/<name>/               the verified files, gathered until the model is whole
    <name>/                     the model, renamed into place in one step: the catalog sees
                                all of it or none of it; <name>/.source.json says where
                                it came from (a second pull of it has nothing to do)

Every name from outside (a model's name, the hub's file name or hash) is joined through
core/safe_paths.inside, and a record read back is checked again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gatewayd.core.errors import ModelExists
from gatewayd.core.pull import PullState, RemoteFile, Selection
from gatewayd.core.safe_paths import inside, is_part

PULL_DIR = ".pull"
SOURCE_FILE = ".source.json"


class PullFolder:
    def __init__(self, models_dir: Path) -> None:
        self.models_dir = models_dir
        self._pulls = models_dir / PULL_DIR

    def records(self) -> Iterator[Path]:
        """The records of the pulls a previous run did not finish."""
        if self._pulls.is_dir():
            yield from sorted(self._pulls.glob("*.json"))

    def staging(self, name: str) -> Path:
        """Where name's verified files gather until the model is whole."""
        return inside(self._pulls, name, what="a model's name")

    def part_path(self, file: RemoteFile) -> Path:
        """Where the file's bytes so far are appended to, named by its hash."""
        key = file.sha256 or file.git_sha1 or hashlib.sha256(file.path.encode()).hexdigest()
        return inside(self._pulls / "blobs", f"{key}.part", what="a file's hash")

    def partial_size(self, file: RemoteFile) -> int:
        """The bytes of file already here (0: none)."""
        try:
            return min(self.part_path(file).stat().st_size, file.size)
        except OSError:
            return 0

    def on_disk(self, name: str, files: Sequence[RemoteFile]) -> int:
        """The pull's bytes so far: files verified in full, the rest's partial bytes."""
        return sum(f.size if (self._pulls / name / f.name).exists()
                   else self.partial_size(f) for f in files)

    def already_here(self, selection: Selection, commit: str,
                     now: float) -> PullState | None:
        """The same files of the same commit already pulled under this name: done (None:
        not here); ModelExists where the name holds another pull's files."""
        try:
            source = json.loads((self.models_dir / selection.name / SOURCE_FILE).read_text())
        except (OSError, ValueError):
            return None
        paths = [f.path for f in selection.files]
        if source.get("commit") != commit or [f.get("path") for f in source.get("files", [])
                                              ] != paths:
            raise ModelExists(
                f"{selection.name} is already here from {source.get('repo')} at "
                f"{str(source.get('commit'))[:12]}; `llm-gateway rm {selection.name}` "
                "first to replace it, or pull it under another name (--name)")
        return PullState(name=selection.name, source=source.get("source", ""),
                         repo=source.get("repo", ""), commit=commit, files=selection.files,
                         state="done", done_bytes=selection.total_bytes, started=now,
                         finished=now)

    def record(self, state: PullState, files: Sequence[RemoteFile], *, mmproj: bool,
               for_model: bool) -> None:
        """What is being pulled, kept for the next start to resume."""
        self._pulls.mkdir(mode=0o700, exist_ok=True)
        self.record_path(state.name).write_text(json.dumps({
            "name": state.name, "source": state.source, "commit": state.commit,
            "mmproj": mmproj, "for_model": for_model,
            "parts": [self.part_path(f).name for f in files]}) + "\n")

    def record_path(self, name: str) -> Path:
        return inside(self._pulls, f"{name}.json", what="a pull's name")

    def land(self, state: PullState, when: float) -> None:
        """The verified files renamed into place as the model <name>/ in one step, with
        where they came from; ModelExists where that name appeared meanwhile."""
        staging = self.staging(state.name)
        source: dict[str, Any] = {
            "source": state.source, "repo": state.repo, "commit": state.commit,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256}
                      for f in state.files], "pulled_at": round(when)}
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
        os.chmod(staging / SOURCE_FILE, 0o644)
        os.chmod(staging, 0o755)
        dest = self.models_dir / state.name
        try:   # rename(2) onto an existing empty folder would succeed: refuse any
            os.mkdir(dest, 0o700)
        except FileExistsError:
            raise ModelExists(f"{dest} appeared while {state.name} was pulled; the pulled "
                              f"files are kept in {staging}") from None
        os.rename(staging, dest)   # replaces the empty folder just made: one step

    def discard_record(self, name: str) -> None:
        """name's record and the bytes it names deleted (a record read back is checked
        again: its parts are joined only where they are one safe part)."""
        if not is_part(name):
            return   # no pull record names it: nothing of it to delete
        with contextlib.suppress(OSError, ValueError, TypeError):
            for part in json.loads(self.record_path(name).read_text()).get("parts", []):
                if is_part(part) and part.endswith(".part"):
                    inside(self._pulls / "blobs", part, what="a partial file").unlink(
                        missing_ok=True)
        shutil.rmtree(inside(self._pulls, name, what="a pull's name"), ignore_errors=True)
        self.forget_record(name)

    def forget_record(self, name: str) -> None:
        self.record_path(name).unlink(missing_ok=True)

    def discard(self, name: str, files: Sequence[RemoteFile]) -> None:
        """A pull's partial bytes, verified files and record deleted."""
        for f in files:
            self.part_path(f).unlink(missing_ok=True)
        shutil.rmtree(self.staging(name), ignore_errors=True)
        self.forget_record(name)
