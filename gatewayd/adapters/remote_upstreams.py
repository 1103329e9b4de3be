"""Remote upstreams, live: one HTTP client session each, health probes, room for requests.

The rules (which upstream, when it counts as down, the backoff) are core/upstreams.py's;
this holds their state and does the I/O:
- a session per upstream (keep-alive TCP, its own TLS context: verified against the
  system's CAs or its ca_file, made off the event loop; connect within
  connect_timeout_s, then up to read_timeout_s between bytes);
- a probe task per upstream: GET <url>/models (with its key), which both checks it
  and, where its models are not listed, discovers them;
- room: take() picks the first upstream serving the name that is not down
  and below its max_concurrency; release() gives the room back;
- a reload swaps the set in place: an unchanged upstream keeps its session and state,
  a changed or removed one is closed once its last request has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gatewayd.core.errors import ConcurrencyLimit, UpstreamUnreachable
from gatewayd.core.upstreams import (
    Health,
    RemoteModel,
    RemoteNames,
    UpstreamConfig,
    UpstreamState,
    discovered_ids,
)

log = logging.getLogger("gatewayd.remotes")
PROBE_READ_S = 10.0      # a probe's answer, after connecting
USER_AGENT = "llm-gateway"


@dataclass(eq=False)
class Remote:
    """One upstream's live state."""

    config: UpstreamConfig
    health: Health
    models: tuple[str, ...] = ()     # listed, or as last discovered
    in_flight: int = 0
    session: aiohttp.ClientSession | None = None
    retired: bool = False            # replaced by a reload: closed once in_flight is 0
    _poke: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def up(self) -> bool:
        return self.health.state is not UpstreamState.DOWN

    def auth_headers(self) -> dict[str, str]:
        key = self.config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def describe(self, now: float) -> dict[str, Any]:
        health = self.health
        return {"name": self.name, "url": self.config.shown_url, "state": health.state.value,
                "models": list(self.models), "discovered": self.config.discovers,
                "in_flight": self.in_flight, "max_concurrency": self.config.max_concurrency,
                "failures": health.failures, "last_error": health.last_error,
                "next_probe_s": round(health.retry_after_s(now), 1)}


class Remotes:
    def __init__(self, configs: Iterable[UpstreamConfig], *, read_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read_timeout_s = read_timeout_s
        self._clock = clock
        self._remotes: dict[str, Remote] = {}
        self._names = RemoteNames()
        self._started = False
        self._closing: set[asyncio.Task[None]] = set()
        for config in configs:
            self._remotes[config.name] = self._new(config)
        self._rename()

    def _new(self, config: UpstreamConfig) -> Remote:
        return Remote(config, Health(config.health_interval_s), models=config.models or ())

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._started = True
        for remote in self._remotes.values():
            await self._open(remote)

    async def _open(self, remote: Remote) -> None:
        config = remote.config
        tls: ssl.SSLContext | bool = False
        if config.url.startswith("https:"):
            # reading the CA bundle is slow: never on the event loop (docs/benchmarks.md,
            # "Figures behind choices in the code")
            tls = await asyncio.to_thread(_tls_context, config) if config.tls_verify else False
        remote.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=tls, limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s,
                                          sock_read=config.read_timeout_s
                                          or self._read_timeout_s),
            # answers pass through as they come: asked for uncompressed (the relay reads
            # streamed events, and a JSON answer's usage)
            auto_decompress=False, skip_auto_headers=("Accept-Encoding",),
            headers={"User-Agent": USER_AGENT})
        remote._task = asyncio.get_running_loop().create_task(self._probe_loop(remote))

    async def close(self) -> None:
        for remote in self._remotes.values():
            await self._shut(remote)
        self._remotes.clear()
        for task in list(self._closing):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _shut(self, remote: Remote) -> None:
        if remote._task is not None:
            remote._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await remote._task
        if remote.session is not None:
            await remote.session.close()

    async def reconfigure(self, configs: Iterable[UpstreamConfig]) -> None:
        """A reload: unchanged upstreams keep running; the others are replaced."""
        wanted = {c.name: c for c in configs}
        for name, remote in list(self._remotes.items()):
            if wanted.get(name) != remote.config:
                del self._remotes[name]
                self._retire(remote)
        for name, config in wanted.items():
            if name not in self._remotes:
                remote = self._remotes[name] = self._new(config)
                if self._started:
                    await self._open(remote)
        self._remotes = {name: self._remotes[name] for name in wanted}   # config order
        self._rename()

    def _retire(self, remote: Remote) -> None:
        remote.retired = True
        if remote._task is not None:
            remote._task.cancel()
        if remote.in_flight == 0:
            self._close_later(remote)

    def _close_later(self, remote: Remote) -> None:
        task = asyncio.get_running_loop().create_task(self._shut(remote))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # -- the request path --------------------------------------------------------------

    def candidates(self, names: Iterable[str]) -> list[RemoteModel]:
        return self._names.candidates(names)

    def take(self, names: Iterable[str], what: str) -> tuple[Remote, RemoteModel]:
        """Room for a request on the first upstream answering one of names that is not down
        and not full; what (the name asked for) goes into the refusals."""
        candidates = self._names.candidates(names)
        full: list[Remote] = []
        down: list[Remote] = []
        for candidate in candidates:
            remote = self._remotes[candidate.upstream]
            if not remote.up or remote.session is None:
                down.append(remote)
            elif (limit := remote.config.max_concurrency) is not None \
                    and remote.in_flight >= limit:
                full.append(remote)
            else:
                remote.in_flight += 1
                return remote, candidate
        now = self._clock()
        if full:
            names_ = ", ".join(f"{r.name!r} ({r.config.max_concurrency})" for r in full)
            raise ConcurrencyLimit(f"upstream {names_} already serves as many requests as its "
                                   f"max_concurrency allows for {what!r}", retry_after=1,
                                   upstreams=[r.name for r in full])
        wait = min((r.health.retry_after_s(now) for r in down), default=1.0)
        told = "; ".join(f"upstream {r.name!r} is unreachable: "
                         f"{r.health.last_error or 'not connected'}" for r in down)
        raise UpstreamUnreachable(f"{what!r} is served remotely and {told}",
                                  retry_after=max(1, round(wait)),
                                  upstreams=[r.name for r in down])

    def release(self, remote: Remote) -> None:
        remote.in_flight -= 1
        if remote.retired and remote.in_flight == 0:
            self._close_later(remote)

    def connect_failed(self, remote: Remote, error: str) -> None:
        """A request could not reach it: down now, and probed again soon."""
        if remote.retired:
            return
        remote.health.failed(self._clock(), error)
        remote._poke.set()
        log.warning("upstream %s is unreachable: %s", remote.name, error)

    # -- state -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._remotes)

    def remotes(self) -> list[Remote]:
        return list(self._remotes.values())

    def serving(self) -> list[tuple[Remote, str]]:
        """(upstream, model id) for every remote model, in configuration order."""
        return [(self._remotes[m.upstream], m.id) for m in self._names]

    def describe(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [r.describe(now) for r in self._remotes.values()]

    def _rename(self) -> None:
        self._names = RemoteNames((r.name, r.models) for r in self._remotes.values())

    # -- probes -----------------------------------------------------------------------

    async def _probe_loop(self, remote: Remote) -> None:
        while True:
            await self.probe(remote)
            # until the next probe is due; a request that found it down pokes this to
            # move that time (closer: the backoff starts again from its first step)
            while (wait := remote.health.retry_after_s(self._clock())) > 0:
                remote._poke.clear()
                try:
                    await asyncio.wait_for(remote._poke.wait(), wait)
                except TimeoutError:
                    break

    async def probe(self, remote: Remote) -> None:
        """GET <url>/models: up or down, and the models where they are discovered."""
        assert remote.session is not None
        config = remote.config
        try:
            async with remote.session.get(
                    config.url + "/models", headers=remote.auth_headers(),
                    timeout=aiohttp.ClientTimeout(total=config.connect_timeout_s
                                                  + PROBE_READ_S,
                                                  sock_connect=config.connect_timeout_s),
                    allow_redirects=False) as resp:
                if resp.status != 200:
                    raise ProbeFailed(f"GET /models answered HTTP {resp.status}"
                                      + (" (our API key was refused: api_key_file)"
                                         if resp.status in (401, 403) else ""))
                ids = discovered_ids(await resp.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, ProbeFailed) as e:
            was_up = remote.health.state is UpstreamState.UP
            remote.health.failed(self._clock(), _why(e, config))
            if was_up or remote.health.failures == 1:
                log.warning("upstream %s is unreachable: %s", remote.name,
                            remote.health.last_error)
            return
        if remote.health.state is not UpstreamState.UP:
            log.info("upstream %s is up (%s)", remote.name, config.shown_url)
        remote.health.succeeded(self._clock())
        if config.discovers and tuple(ids) != remote.models:
            log.info("upstream %s serves %s", remote.name, ", ".join(ids) or "no models")
            remote.models = tuple(ids)
            self._rename()


class ProbeFailed(Exception):
    pass


def _why(e: BaseException, config: UpstreamConfig) -> str:
    if isinstance(e, TimeoutError):
        return f"no answer within {config.connect_timeout_s + PROBE_READ_S:g}s"
    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        return f"its TLS certificate was not accepted: {e.certificate_error}"
    return config.redact(str(e) or type(e).__name__)


def _tls_context(config: UpstreamConfig) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None)
