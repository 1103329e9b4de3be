"""The Hugging Face Hub, through its own client (huggingface_hub): a repository's files
at a commit, and one file's bytes appended to a partial file, resumed where it stopped.

The library's endpoints, token handling, proxies (HTTPS_PROXY), user agent, redirects
to the CDN and its retrying, resuming HTTP download are used as they are. Its cache
(hf_hub_download) is not: the files belong in models_dir, owned by the service, and its
download restarts from byte 0 after an interruption (a partial file is unique to one
process), where a model of several GiB must resume after a gateway restart.

Library errors become core errors here (RepositoryNotFoundError -> HubRepoNotFound, ...);
the service never sees a huggingface_hub or httpx2 exception.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, cast

from gatewayd.core.errors import (
    GatewayError,
    HubFileNotFound,
    HubGatedRepo,
    HubRepoNotFound,
    HubUnreachable,
    ModelSourceInvalid,
    PullError,
    UnsafePath,
)
from gatewayd.core.pull import PullCancelled, RemoteFile, RepoListing
from gatewayd.core.safe_paths import digest

log = logging.getLogger("gatewayd.pull")

TOKEN_CREDENTIAL = "hf-token"   # LoadCredential= name (systemd.exec(5))
# http_get writes (and a cut loses) whole chunks of this size; the library's 10 MiB made a
# pull's progress move in 10 MiB steps and a resume lose up to 10 MiB
CHUNK_BYTES = 1024 * 1024
FRESH_ADDRESSES = 3


def hub_token(environ: dict[str, str] | None = None) -> str | None:
    """The token for gated and private repositories: the service's credential (systemd
    puts it in $CREDENTIALS_DIRECTORY, never in the environment, where /proc and the
    journal's unit dumps would show it), else $HF_TOKEN (a user's own gateway)."""
    env = os.environ if environ is None else environ
    if directory := env.get("CREDENTIALS_DIRECTORY"):
        try:
            token = (Path(directory) / TOKEN_CREDENTIAL).read_text().strip()
            if token:
                return token
        except OSError:
            pass
    return env.get("HF_TOKEN") or None


class HuggingFaceHub:
    def __init__(self, endpoint: str | None = None, token: str | None = None) -> None:
        self.endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
        self._token = token

    def listing(self, repo: str, revision: str | None) -> RepoListing:
        from huggingface_hub import HfApi
        with _translated(repo):
            info = HfApi(endpoint=self.endpoint, token=self._token).model_info(
                repo, revision=revision, files_metadata=True)
        try:
            commit = digest(info.sha, what=f"the commit the hub gave for {repo}")
        except UnsafePath as e:
            raise PullError(e.message) from e
        files = []
        for s in info.siblings or []:
            try:
                files.append(RemoteFile(
                    path=s.rfilename, size=int(s.size or (s.lfs.size if s.lfs else 0)),
                    sha256=s.lfs.sha256 if s.lfs else None, git_sha1=s.blob_id))
            except UnsafePath as e:   # the hub's word, not the caller's: left out, said
                log.warning("%s: a file of the hub's listing is left out: %s", repo,
                            e.message)
        return RepoListing(repo=repo, commit=commit, files=tuple(files))

    def probe(self, repo: str, commit: str, file: RemoteFile) -> None:
        with _translated(repo, file.path):
            self._metadata(repo, commit, file)

    def _metadata(self, repo: str, commit: str, file: RemoteFile) -> Any:
        """The hub's HEAD of the file: its size, hash and (LFS) CDN address."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        return get_hf_file_metadata(
            hf_hub_url(repo, file.path, revision=commit, endpoint=self.endpoint),
            token=self._token, endpoint=self.endpoint, retry_on_errors=True)

    def download(self, repo: str, commit: str, file: RemoteFile, out: BinaryIO,
                 cancel: threading.Event) -> None:
        """Append the rest of the file's bytes to out (its position is what it has);
        raises PullCancelled once cancel is set, OSError when writing fails (a full disk).

        The CDN's address is signed for a while (an hour on the hub): a download that
        outlives it, or a cut after it, is answered 403 there, and the hub is asked for a
        fresh address, from the bytes there are (FRESH_ADDRESSES times at most)."""
        from huggingface_hub import constants, errors, hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers, disable_progress_bars
        disable_progress_bars()   # progress is the gateway's events, not a bar on stderr
        constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, CHUNK_BYTES)
        sink = cast(BinaryIO, _Sink(out, cancel))
        with _translated(repo, file.path):
            # (a file the hub serves itself, not through the CDN: no address to renew)
            url = hf_hub_url(repo, file.path, revision=commit, endpoint=self.endpoint)
            for attempt in range(FRESH_ADDRESSES + 1):
                meta = self._metadata(repo, commit, file)
                try:
                    http_get(meta.location, sink, resume_size=out.tell(),
                             headers=build_hf_headers(token=self._token),
                             expected_size=file.size, displayed_filename=file.name)
                    return
                except errors.HfHubHTTPError as e:
                    status = e.response.status_code if e.response is not None else None
                    if status not in (403, 410) or meta.location == url \
                            or attempt == FRESH_ADDRESSES:
                        raise


class _Sink:
    """The partial file as http_get writes to it: a cancelled pull stops at its next
    chunk (a thread cannot be interrupted otherwise)."""

    def __init__(self, out: BinaryIO, cancel: threading.Event) -> None:
        self._out = out
        self._cancel = cancel

    def write(self, data: bytes) -> int:
        if self._cancel.is_set():
            raise PullCancelled
        return self._out.write(data)

    def __getattr__(self, name: str) -> Any:   # tell, seek, truncate, flush
        return getattr(self._out, name)


@contextmanager
def _translated(repo: str, path: str | None = None) -> Iterator[None]:
    import httpx2
    from huggingface_hub import errors
    what = f"{repo}/{path}" if path else repo
    try:
        yield
    except (PullCancelled, GatewayError):
        raise
    except errors.GatedRepoError as e:
        raise HubGatedRepo(
            f"{repo} is gated: accept its terms on the hub, then give the gateway a token "
            f"(the {TOKEN_CREDENTIAL!r} credential, or HF_TOKEN) ({_first_line(e)})") from e
    except errors.RepositoryNotFoundError as e:
        raise HubRepoNotFound(f"the hub has no repository {repo!r} (or it is private and "
                              "the gateway's token may not read it)") from e
    except errors.RevisionNotFoundError as e:
        raise HubRepoNotFound(f"{repo}: no such revision ({_first_line(e)})") from e
    except errors.RemoteEntryNotFoundError as e:
        raise HubFileNotFound(f"the hub has no file {what}") from e
    except errors.HFValidationError as e:   # what it takes for a repo id or revision
        raise ModelSourceInvalid(f"{what}: {_first_line(e)}", param="source") from e
    except errors.OfflineModeIsEnabled as e:
        raise HubUnreachable("HF_HUB_OFFLINE is set: the gateway may not reach the hub") \
            from e
    except errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        raise PullError(f"the hub answered {status} for {what}: {_first_line(e)}") from e
    except OSError as e:
        if e.errno is not None:
            raise   # writing the partial file (ENOSPC): the service's to answer
        # http_get's "consistency check": the body ended short of the size (the partial
        # file keeps what came; the next try resumes there)
        raise HubUnreachable(f"the download of {what} ended early: {_first_line(e)}") from e
    except httpx2.TransportError as e:   # connect, DNS, TLS, proxy, timeout, cut
        raise HubUnreachable(f"cannot reach the hub for {what}: "
                             f"{type(e).__name__}: {e}") from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
