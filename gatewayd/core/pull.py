"""Pulling a model from a hub, the decisions: what `REPO[:QUANT]` means, which of the
repository's files that is, what the model is called here, whether it fits on the disk,
and how a download's progress reads. No I/O: the hub client is adapters/hub.py, the
downloads and the files service/pulls.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gatewayd.core.errors import (
    HubFileAmbiguous,
    HubFileNotFound,
    InsufficientStorage,
    ModelSourceInvalid,
)
from gatewayd.core.figures import size_text
from gatewayd.core.safe_paths import digest, is_part, relative_parts

GIB = 1024 ** 3
# what a pull leaves free on models_dir's filesystem: records, journals and KV files
# share it; a twentieth of a small filesystem (a test's tmpfs, a Pi's card), else 1 GiB
RESERVE_MAX = GIB
RESERVE_SHARE = 20
# the quantisation llama.cpp's -hf and Ollama pick when a repository holds several
DEFAULT_QUANT = "Q4_K_M"

# matched whole (fullmatch: a pattern's "$" takes a trailing newline too)
_REPO = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_REVISION = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_./-]{0,199}")
_FILE = re.compile(r"(?!/)(?!.*\.\.)[A-Za-z0-9_./+-]{1,255}\.gguf", re.IGNORECASE)
_QUANT = re.compile(r"[A-Za-z0-9_]{1,32}")
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# quantisation tags as GGUF publishers write them in file names (for the error that lists
# a repository's choices)
_QUANT_TAG = re.compile(r"(?:^|[-._/])((?:I?Q|TQ)\d+(?:_[A-Z0-9]+)*|BF16|F16|F32|MXFP4)"
                        r"(?=[-._/]|$)", re.IGNORECASE)
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_NAME = 200


class PullCancelled(Exception):
    """A pull was cancelled (rm, the gateway stopping) while its bytes were arriving."""


@dataclass(frozen=True)
class PullSpec:
    """`REPO[@REVISION][:FILE or :QUANT]`, or `hf://REPO/PATH.gguf` (a config's source)."""
    repo: str
    revision: str | None = None
    file: str | None = None      # a path in the repository, ending in .gguf
    quant: str | None = None     # a quantisation tag, e.g. Q4_K_M

    @classmethod
    def parse(cls, text: str) -> PullSpec:
        text = text.strip()
        if text.startswith("hf://"):   # hf://ORG/REPO/PATH
            owner, _, rest = text.removeprefix("hf://").partition("/")
            name, _, path = rest.partition("/")
            text = f"{owner}/{name}" + (f":{path}" if path else "")
        head, _, choice = text.partition(":")
        repo, at, revision = head.partition("@")
        if not _REPO.fullmatch(repo):
            raise ModelSourceInvalid(
                f"{text!r} is not a model source: write ORG/REPO, ORG/REPO:QUANT or "
                "ORG/REPO:FILE.gguf (e.g. bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M)",
                param="source")
        if at and not _REVISION.fullmatch(revision):
            raise ModelSourceInvalid(f"{revision!r} is not a revision (a branch, tag or "
                                     "commit)", param="source")
        spec = cls(repo=repo, revision=revision or None)
        if not choice:
            return spec
        if choice.casefold().endswith(".gguf"):
            if not _FILE.fullmatch(choice):
                raise ModelSourceInvalid(f"{choice!r} is not a file path in a repository",
                                         param="source")
            return cls(repo=repo, revision=spec.revision, file=choice)
        if not _QUANT.fullmatch(choice):
            raise ModelSourceInvalid(f"{choice!r} is neither a quantisation (Q4_K_M, Q8_0, "
                                     "...) nor a .gguf file", param="source")
        return cls(repo=repo, revision=spec.revision, quant=choice)

    def __str__(self) -> str:
        choice = self.file or self.quant
        return (self.repo + (f"@{self.revision}" if self.revision else "")
                + (f":{choice}" if choice else ""))


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repository at a commit, as the hub lists it."""
    path: str
    size: int
    sha256: str | None = None    # Git LFS files (every GGUF on the hub): the content's hash
    git_sha1: str | None = None  # the git blob id: what a small, non-LFS file is checked by

    def __post_init__(self) -> None:
        # a listing is the hub's word, and its names and hashes become file names here
        # (models_dir/NAME/<file name>, .pull/blobs/<hash>.part): refused unless safe
        relative_parts(self.path, what="the hub's file path")
        for key in ("sha256", "git_sha1"):
            if (value := getattr(self, key)) is not None:
                object.__setattr__(self, key, digest(value, what=f"the hub's {key} of "
                                                     f"{self.path}"))

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class RepoListing:
    repo: str
    commit: str
    files: tuple[RemoteFile, ...]


@dataclass(frozen=True)
class Selection:
    """What one pull downloads: the model's file(s) (a split model's parts, in order) and
    its projector where one was asked for."""
    name: str
    weights: tuple[RemoteFile, ...]
    mmproj: RemoteFile | None = None

    @property
    def files(self) -> tuple[RemoteFile, ...]:
        return (*self.weights, *([self.mmproj] if self.mmproj else []))

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def is_mmproj(path: str) -> bool:
    return path.rsplit("/", 1)[-1].casefold().startswith("mmproj")


def split_of(file_name: str) -> tuple[str, int, int] | None:
    """A split GGUF's stem, part and count: Big-Q8_0-00002-of-00003.gguf is
    ("Big-Q8_0", 2, 3); None for a file in one piece."""
    m = _SPLIT.match(file_name)
    return None if m is None else (m["stem"], int(m["part"]), int(m["count"]))


def _groups(files: Iterable[RemoteFile]) -> dict[str, tuple[RemoteFile, ...]]:
    """The repository's models: each single .gguf, and each split model's parts together
    (keyed by its first part's path), its projectors left out."""
    groups: dict[str, tuple[RemoteFile, ...]] = {}
    splits: dict[tuple[str, int], dict[int, RemoteFile]] = {}
    for f in files:
        if not f.path.casefold().endswith(".gguf") or is_mmproj(f.path):
            continue
        if m := _SPLIT.match(f.path):
            key = (m["stem"], int(m["count"]))
            splits.setdefault(key, {})[int(m["part"])] = f
        else:
            groups[f.path] = (f,)
    for (_stem, count), parts in splits.items():
        if sorted(parts) == list(range(1, count + 1)):   # an incomplete split is no model
            ordered = tuple(parts[i] for i in range(1, count + 1))
            groups[ordered[0].path] = ordered
    return dict(sorted(groups.items()))


def _has_quant(path: str, quant: str) -> bool:
    # bounded so that Q4_K is not Q4_K_M and Q4_XS is not IQ4_XS
    return re.search(rf"(?<![a-z0-9_]){re.escape(quant.casefold())}(?![a-z0-9_])",
                     path.casefold().removesuffix(".gguf")) is not None


def quant_tags(paths: Iterable[str]) -> list[str]:
    """The quantisation tags the file names carry, for an error that offers the choices."""
    tags: dict[str, None] = {}
    for path in paths:
        for m in _QUANT_TAG.finditer(path.removesuffix(".gguf")):
            tags[m.group(1).upper()] = None
    return list(tags)


def _choices(repo: str, groups: dict[str, tuple[RemoteFile, ...]]) -> str:
    tags = quant_tags(groups)
    if tags and len(tags) >= len(groups):
        return ", ".join(f"{repo}:{t}" for t in tags)
    return ", ".join(f"{repo}:{p}" for p in groups)


def model_name(first_file: str) -> str:
    """The model's name here: its file's, without the folder, .gguf and a split's
    -00001-of-0000N; what a models_dir name may hold."""
    base = first_file.rsplit("/", 1)[-1]
    if m := _SPLIT.match(base):
        base = m["stem"]
    base = base.removesuffix(".gguf").removesuffix(".GGUF")
    name = _NAME_UNSAFE.sub("-", base)[:MAX_NAME].strip(".-")
    return name or "model"


def valid_name(name: str) -> str:
    """A name the caller chose: one folder name in models_dir, nothing that escapes it."""
    if not is_part(name) or _NAME_UNSAFE.search(name) or len(name) > MAX_NAME:
        raise ModelSourceInvalid(f"{name!r} cannot name a model here: use letters, digits, "
                                 "'.', '_' and '-', not starting with '.'", param="name")
    return name


def select(spec: PullSpec, listing: RepoListing, *, mmproj: bool = False,
           name: str | None = None) -> Selection:
    """Which files `spec` means in `listing`: the file named, else the model whose name
    carries the quantisation, else the repository's one model, else its Q4_K_M."""
    groups = _groups(listing.files)
    if not groups:
        raise HubFileNotFound(f"{listing.repo} holds no GGUF model file", param="source")
    if spec.file is not None:
        wanted = spec.file.casefold()
        found = [g for path, g in groups.items()
                 if any(f.path.casefold() == wanted for f in g)]
        if not found:
            raise HubFileNotFound(f"{listing.repo} has no file {spec.file!r}; its models: "
                                  f"{_choices(listing.repo, groups)}", param="source")
        chosen = found[0]
    else:
        quant = spec.quant
        matching = ({p: g for p, g in groups.items() if _has_quant(p, quant)} if quant
                    else groups)
        if quant and not matching:
            raise HubFileNotFound(f"{listing.repo} has no {quant} file; its models: "
                                  f"{_choices(listing.repo, groups)}", param="source")
        if len(matching) > 1 and not quant:
            matching = {p: g for p, g in groups.items() if _has_quant(p, DEFAULT_QUANT)} \
                or matching
        if len(matching) > 1:
            raise HubFileAmbiguous(
                f"{listing.repo} holds several models"
                + (f" matching {quant}" if quant else "") + "; name one: "
                + _choices(listing.repo, matching), param="source")
        chosen = next(iter(matching.values()))
    projector = _projector(listing) if mmproj else None
    return Selection(name=valid_name(name or model_name(chosen[0].path)),
                     weights=chosen, mmproj=projector)


def _projector(listing: RepoListing) -> RemoteFile:
    """The repository's projector: its only one, else the full-precision one (f16, then
    bf16, then f32: what llama.cpp's own -hf prefers), else the first."""
    found = sorted((f for f in listing.files
                    if is_mmproj(f.path) and f.path.casefold().endswith(".gguf")),
                   key=lambda f: f.path)
    if not found:
        raise HubFileNotFound(f"{listing.repo} has no projector (mmproj*.gguf) file",
                              param="mmproj")
    for tag in ("f16", "bf16", "f32"):
        for f in found:
            if _has_quant(f.path, tag):
                return f
    return found[0]


def reserve_bytes(filesystem_bytes: int) -> int:
    return min(RESERVE_MAX, filesystem_bytes // RESERVE_SHARE)


def check_space(where: str, *, need: int, free: int, filesystem: int) -> None:
    """Refuse before downloading what would not fit beside the reserve."""
    reserve = reserve_bytes(filesystem)
    if need + reserve > free:
        raise InsufficientStorage(
            f"{where} has {size_text(free)} free; the download needs {size_text(need)} "
            f"and leaves {size_text(reserve)} spare: free "
            f"{size_text(need + reserve - free)} or point models_dir elsewhere",
            need_bytes=need, free_bytes=free, reserve_bytes=reserve)


@dataclass
class RateMeter:
    """Bytes per second over the last `window` seconds of samples (a download's rate and
    what its ETA is computed from, steady where a single interval would jump)."""
    window: float = 5.0
    _samples: list[tuple[float, int]] = field(default_factory=list)

    def add(self, now: float, done: int) -> None:
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.pop(0)

    def rate(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else None


def eta_seconds(remaining: int, rate: float | None) -> float | None:
    return None if not rate or rate <= 0 else remaining / rate


@dataclass
class PullState:
    """One pull as /admin/status, /admin/pulls and the `pull` events show it."""
    name: str
    source: str
    repo: str
    commit: str
    files: Sequence[RemoteFile]
    state: str = "downloading"
    done_bytes: int = 0
    resumed_bytes: int = 0          # already on disk when it (re)started
    started: float = 0.0
    finished: float | None = None
    error: dict[str, Any] | None = None
    meter: RateMeter = field(default_factory=RateMeter)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def describe(self) -> dict[str, Any]:
        rate = self.meter.rate() if self.state == "downloading" else None
        return {"model": self.name, "source": self.source, "repo": self.repo,
                "commit": self.commit, "state": self.state,
                "files": [{"path": f.path, "size": f.size, "sha256": f.sha256}
                          for f in self.files],
                "total_bytes": self.total_bytes, "done_bytes": self.done_bytes,
                "resumed_bytes": self.resumed_bytes,
                "rate_bps": None if rate is None else round(rate),
                "eta_s": (None if rate is None else
                          round(eta_seconds(self.total_bytes - self.done_bytes, rate) or 0, 1)),
                "started": self.started, "finished": self.finished, "error": self.error}
