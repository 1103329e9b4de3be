"""The gateway's configuration: typed, frozen, validated with messages that name the key.

Parsed from TOML (`/etc/llm-gateway/gateway.toml`, or `--config`; reading the
file is gatewayd.adapters.config_file's job). Every key is optional. Unknown
keys are errors, so a typo never silently does nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from gatewayd.core.auth import KeyRing
from gatewayd.core.errors import ConfigError, ModelSourceInvalid
from gatewayd.core.priority import CLASSES, NORMAL, parse_class
from gatewayd.core.progress import MODES as PROGRESS_MODES
from gatewayd.core.pull import PullSpec, valid_name
from gatewayd.core.upstreams import UpstreamConfig, parse_upstreams

DEFAULT_CONFIG_PATH = Path("/etc/llm-gateway/gateway.toml")
DEFAULT_STATE_DIR = Path("/var/lib/llm-gateway")
MAX_ENGINES_RANGE = range(1, 17)
PARKED_ENGINES_RANGE = range(0, 33)


class Backend(StrEnum):
    LLAMA = "llama"        # llama-server
    WHISPER = "whisper"    # whisper-server
    OPENAI = "openai"      # any server of OpenAI's API, run from the model's `command`


class ModelKind(StrEnum):
    """What a model is for, and so which requests its engine answers."""

    CHAT = "chat"              # generation: chat, completions, responses, messages
    EMBEDDING = "embedding"    # llama-server --embeddings: /v1/embeddings only
    RERANK = "rerank"          # llama-server --rerank: /v1/rerank only
    AUDIO = "audio"            # whisper-server: transcriptions and translations
    IMAGE = "image"            # /v1/images/generations, edits, variations (openai backend)
    SPEECH = "speech"          # /v1/audio/speech (openai backend)


# which kinds each backend's engines can be
BACKEND_KINDS: Mapping[Backend, tuple[ModelKind, ...]] = {
    Backend.LLAMA: (ModelKind.CHAT, ModelKind.EMBEDDING, ModelKind.RERANK),
    Backend.WHISPER: (ModelKind.AUDIO,),
    Backend.OPENAI: tuple(ModelKind),
}
# the placeholders of an openai model's `command` (and `env` values), filled when its
# engine starts (core/engine_units.expand): what each stands for
PLACEHOLDERS: Mapping[str, str] = {
    "socket": "the unix socket the server listens on (under the unit's runtime directory)",
    "port": "the TCP port the server listens on, on 127.0.0.1 inside the unit's own "
            "network namespace",
    "model": "the model's id (what clients send as \"model\")",
    "model_path": "the model's `path`",
    "ctx_size": "the model's `ctx_size`",
    "threads": "the model's `threads`",
}
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
# llama-server flags that decide what its engine answers
EMBEDDING_FLAGS = frozenset({"--embedding", "--embeddings"})
RERANK_FLAGS = frozenset({"--rerank", "--reranking"})


class UnitMode(StrEnum):
    """How engine units are created (see docs/design.md, "Privilege model")."""

    AUTO = "auto"            # transient when safe (user manager, or root), else template
    TRANSIENT = "transient"  # StartTransientUnit
    TEMPLATE = "template"    # llm-engine@<id>.service + a settings file per instance


@dataclass(frozen=True)
class ModelConfig:
    """One `[models.NAME]` table (or a model found in `models_dir`)."""

    name: str
    path: Path | None             # None: an openai model whose command names what it serves
    backend: Backend = Backend.LLAMA
    args: tuple[str, ...] = ()
    mmproj: Path | None = None
    aliases: tuple[str, ...] = ()
    ctx_size: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    memory_max: int | None = None       # bytes (MemoryMax=)
    memory_high: int | None = None      # bytes (MemoryHigh=)
    cpu_quota: float | None = None      # percent of one CPU (CPUQuota=)
    cuda_visible_devices: str | None = None
    vram_margin_mib: int | None = None
    threads: int | None = None
    pin: bool = False                    # never evicted
    preload: bool = False                # started when the gateway starts
    idle_ttl_s: float | None = None      # stopped after this long without requests
    kind: ModelKind | None = None        # None: from the GGUF header (whisper: audio)
    also: tuple[ModelKind, ...] = ()     # an openai server's further kinds (kind = [...])
    max_concurrency: int | None = None   # requests served at once; above: 429
    queue_limit: int | None = None       # requests waiting for it; above: 503
    max_wait_s: float | None = None      # its requests' turn bound (None: the global one)
    priority: int = NORMAL               # its requests' class (core/priority), unless a
                                         # key's says otherwise
    kv_cache_save: bool = True           # llama chat engines: KV cache saved at a stop,
                                         # restored at the next start (adapters/kv_cache)
    spill_over: bool = False             # when it cannot take a request within its wait,
                                         # an upstream serving one of its names does
    # backend = "openai": the server's command line with placeholders (PLACEHOLDERS), how
    # to tell it is ready (the first `ready_status` answer to GET `ready_path` over its
    # socket) and the memory it declares it takes (learned after its first run)
    command: tuple[str, ...] = ()
    ready_path: str = "/v1/models"
    ready_status: int = 200
    vram_mib: int | None = None
    ram_mib: int | None = None
    # where the file comes from when it is not here yet (`llm-gateway pull`'s source:
    # ORG/REPO[:QUANT|:FILE] or hf://ORG/REPO/FILE): pulled into models_dir/NAME/ at first use
    source: str | None = None

    @property
    def downloaded(self) -> bool:
        """Whether its file is here (a model with a source and no path is not yet)."""
        return self.source is None or self.path is not None

    @property
    def listens_on_port(self) -> bool:
        """An openai server told a TCP port ({port}), not a unix socket ({socket}): in
        its command or its env (llama-server's LLAMA_ARG_PORT={port}), as the check of
        the configuration counts it (_command) and the launcher fills it."""
        return any(match.group(1) == "port" for text in (*self.command, *self.env.values())
                   for match in _PLACEHOLDER.finditer(text))


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's whole configuration, as read from its TOML file and checked."""
    models_dir: Path | None = None
    models: tuple[ModelConfig, ...] = ()
    max_engines: int = 4
    # stopped llama engines whose unit is kept parked (a shell waiting to exec the
    # engine), so that their next start skips creating a unit; 0: none
    parked_engines: int = 4
    vram_margin_mib: int = 1024
    # [memory]: RAM as a budget (core/ram_budget.py). The reserve stays for the rest of
    # the machine; the budget (None: none) caps what all engines together may hold;
    # ram_margin_mib is added to every estimated RAM need (the process, its libraries, the
    # CUDA runtime; a whisper model without a header: its files + the margin).
    # auto_memory_high: each engine's unit gets MemoryHigh= at its learned need plus
    # memory_high_headroom_pct (off: see docs/memory.md)
    ram_reserve_mib: int = 1024
    ram_budget_mib: int | None = None
    ram_margin_mib: int = 256
    auto_memory_high: bool = False
    memory_high_headroom_pct: int = 25
    llama_server: str = "llama-server"
    whisper_server: str = "whisper-server"
    state_dir: Path = DEFAULT_STATE_DIR
    bus: str = "auto"            # "system", "user", "auto" or a D-Bus address
    unit_mode: UnitMode = UnitMode.AUTO
    load_timeout_s: float = 300.0
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    # [listen] allowed_hosts: Host names (besides loopback names, the address a client
    # connected to and this machine's hostname) that name this gateway; "*": any.
    # allowed_origins: web origins ("https://app.example") whose pages may call it
    # (besides its own, the status page); "*": any page (then keys are the only guard)
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    default_model: str | None = None
    autoload: bool = True                # a request for a stopped model starts it
    eviction_wait_s: float = 30.0        # how long a start waits for room to free up
    # the order in which waiting models get room (core/scheduler): "grouped" serves a
    # model's queue while it holds a place, and passes a waiting model over for at most
    # max_wait_s; "fifo" gives room in the order models asked for it
    schedule: str = "grouped"
    max_wait_s: float = 20.0
    priority_aging_s: float = 120.0      # a waiting request counts a class higher per this
    # a waiting stream's SSE comment lines (core/progress): "off", "opt-in" (the client's
    # LLM-Gateway-Progress: 1) or "on" (unless it says 0)
    stream_progress: str = "opt-in"
    kv_cache_max_mb: int = 4096          # saved KV cache per model, oldest files removed first
    queue_limit: int = 100               # default per-model queue limit
    max_body_bytes: int = 256 * 1024 * 1024
    # an answer read whole (not streamed) past this: 502 answer_too_large; one streamed
    # event past this without its end: the stream ends with an event_too_large error event
    max_answer_bytes: int = 256 * 1024 * 1024
    max_event_bytes: int = 4 * 1024 * 1024
    read_timeout_s: float = 600.0
    shutdown_timeout_s: float = 30.0
    records_enabled: bool = True
    records_path: Path | None = None          # default: <state_dir>/records.db
    records_store_text: bool = False
    records_text_max_bytes: int = 4096
    # records older than this, and the oldest beyond this size, are deleted by the
    # writer thread (0: no such bound)
    records_max_age_days: float = 30.0
    records_max_bytes: int = 1024 * 1024 * 1024
    # a ready engine's /health is asked every interval; `misses` answers in a row missing
    # (none within timeout) mean it hangs: it is killed and systemd restarts it (0: never)
    health_interval_s: float = 5.0
    health_timeout_s: float = 5.0
    health_misses: int = 3
    auth_keys_file: Path | None = None   # [auth] keys_file: API keys on (core/auth.py)
    # [admin]: the admin API on its own unix socket (None: <runtime dir>/llm-gateway/
    # admin.sock), for root, the gateway's user and admin_group; on the public port too
    # only while admin_public (then behind an admin-scope key when keys are on), or just
    # /admin/metrics, read-only and keyless, while admin_public_metrics
    admin_socket: Path | None = None
    admin_group: str | None = None
    admin_public: bool = False
    admin_public_metrics: bool = False
    api_keys: KeyRing | None = None      # read from it by the adapter (config_file)
    upstreams: tuple[UpstreamConfig, ...] = ()   # [upstreams.NAME] (core/upstreams.py)
    source: Path | None = None

    @property
    def records_file(self) -> Path:
        return self.records_path or self.state_dir / "records.db"

    def max_wait_for(self, model: ModelConfig | None) -> float:
        """The bound on a model's turn (grouped): its own max_wait_s, else the global."""
        if model is not None and model.max_wait_s is not None:
            return model.max_wait_s
        return self.max_wait_s


SCHEDULES = ("grouped", "fifo")
_MODEL_KEYS = {"path", "backend", "args", "mmproj", "aliases", "ctx_size", "env",
               "memory_max", "memory_high", "cpu_quota", "cuda_visible_devices",
               "vram_margin_mib", "threads",
               "pin", "preload", "idle_ttl_s", "max_concurrency", "queue_limit", "kind",
               "max_wait_s", "priority",
               "kv_cache_save", "spill_over", "command", "ready_path", "ready_status",
               "vram_mib", "ram_mib", "source"}
_OPENAI_ONLY = ("command", "ready_path", "ready_status")
_TOP_KEYS = {"models_dir", "models", "max_engines", "vram_margin_mib", "llama_server",
             "whisper_server", "state_dir", "bus", "unit_mode", "load_timeout_s",
             "listen", "default_model", "max_body_mb", "read_timeout_s", "shutdown_timeout_s",
             "records", "autoload", "eviction_wait_s", "queue_limit", "health",
             "schedule", "max_wait_s", "priority_aging_s", "stream_progress",
             "kv_cache_max_mb", "auth", "admin", "upstreams", "parked_engines",
             "max_answer_mb", "max_event_mb", "memory"}


def parse_config(data: Mapping[str, Any], source: Path | None = None, *,
                 base: Path | None = None, state_dir: Path = DEFAULT_STATE_DIR
                 ) -> GatewayConfig:
    """Settings from parsed TOML. Relative paths are taken from base (default: the
    file's directory); state_dir is the default where the file names none."""
    where = str(source) if source else "config"
    _no_unknown(data, _TOP_KEYS, where)
    base = base or (source.parent if source else Path("."))
    listen = data.get("listen", {})
    _expect(listen, dict, where, "listen")
    _no_unknown(listen, {"host", "port", "allowed_hosts", "allowed_origins"},
                f"{where} [listen]")

    max_engines = _expect(data.get("max_engines", 4), int, where, "max_engines")
    if max_engines not in MAX_ENGINES_RANGE:
        raise ConfigError(f"{where}: max_engines = {max_engines} is out of range: allowed "
                          f"{MAX_ENGINES_RANGE.start}..{MAX_ENGINES_RANGE.stop - 1}")
    parked_engines = _expect(data.get("parked_engines", 4), int, where, "parked_engines")
    if parked_engines not in PARKED_ENGINES_RANGE:
        raise ConfigError(f"{where}: parked_engines = {parked_engines} is out of range: "
                          f"allowed {PARKED_ENGINES_RANGE.start}..{PARKED_ENGINES_RANGE.stop - 1}")
    models_table = _expect(data.get("models", {}), dict, where, "models")
    models = tuple(_parse_model(name, table, base, where)
                   for name, table in models_table.items())
    try:
        unit_mode = UnitMode(data.get("unit_mode", "auto"))
    except ValueError:
        raise ConfigError(f"{where}: unit_mode must be one of "
                          f"{', '.join(m.value for m in UnitMode)}") from None
    records = data.get("records", {})
    _expect(records, dict, where, "records")
    _no_unknown(records, {"enabled", "path", "store_text", "text_max_bytes", "max_age_days",
                          "max_mb"}, f"{where} [records]")
    max_body_mb = _at_least_1(data.get("max_body_mb", 256), where, "max_body_mb")
    max_answer_mb = _at_least_1(data.get("max_answer_mb", 256), where, "max_answer_mb")
    max_event_mb = _at_least_1(data.get("max_event_mb", 4), where, "max_event_mb")
    health = data.get("health", {})
    _expect(health, dict, where, "health")
    _no_unknown(health, {"interval_s", "timeout_s", "misses"}, f"{where} [health]")
    auth = data.get("auth", {})
    _expect(auth, dict, where, "auth")
    _no_unknown(auth, {"keys_file"}, f"{where} [auth]")
    admin = data.get("admin", {})
    _expect(admin, dict, where, "admin")
    _no_unknown(admin, {"socket", "group", "public", "public_metrics"}, f"{where} [admin]")
    memory = data.get("memory", {})
    _expect(memory, dict, where, "memory")
    _no_unknown(memory, {"ram_reserve_mib", "ram_budget_mib", "ram_margin_mib",
                         "auto_memory_high", "memory_high_headroom_pct"}, f"{where} [memory]")
    upstreams = parse_upstreams(data.get("upstreams", {}), base, where)
    spilling = [m.name for m in models if m.spill_over]
    if spilling and not upstreams:
        raise ConfigError(f"{where}: spill_over is set for {', '.join(spilling)} but there is "
                          "no [upstreams.NAME] table to spill over to")
    sourced = [m.name for m in models if m.source]
    if sourced and data.get("models_dir") is None:
        raise ConfigError(f"{where}: {', '.join(sourced)} name a source to pull from, but "
                          "there is no models_dir to pull into")
    port = _expect(listen.get("port", 8080), int, where, "listen.port")
    if not 0 < port < 65536:
        raise ConfigError(f"{where}: listen.port = {port} is not a TCP port")
    return GatewayConfig(
        models_dir=_path(data.get("models_dir"), base, where, "models_dir"),
        models=models,
        max_engines=max_engines,
        parked_engines=parked_engines,
        vram_margin_mib=_non_negative(data.get("vram_margin_mib", 1024), where, "vram_margin_mib"),
        ram_reserve_mib=_non_negative(memory.get("ram_reserve_mib", 1024), where,
                                      "memory.ram_reserve_mib"),
        ram_budget_mib=None if memory.get("ram_budget_mib") is None else int(_positive(
            _expect(memory["ram_budget_mib"], int, where, "memory.ram_budget_mib"), where,
            "memory.ram_budget_mib")),
        ram_margin_mib=_non_negative(memory.get("ram_margin_mib", 256), where,
                                     "memory.ram_margin_mib"),
        auto_memory_high=_expect(memory.get("auto_memory_high", False), bool, where,
                                 "memory.auto_memory_high"),
        memory_high_headroom_pct=_non_negative(memory.get("memory_high_headroom_pct", 25),
                                               where, "memory.memory_high_headroom_pct"),
        llama_server=_binary(data.get("llama_server", "llama-server"), base, where,
                             "llama_server"),
        whisper_server=_binary(data.get("whisper_server", "whisper-server"), base, where,
                               "whisper_server"),
        state_dir=_path(data.get("state_dir"), base, where, "state_dir") or state_dir,
        bus=_expect(data.get("bus", "auto"), str, where, "bus"),
        unit_mode=unit_mode,
        load_timeout_s=float(_positive(data.get("load_timeout_s", 300), where,
                                       "load_timeout_s")),
        listen_host=_expect(listen.get("host", "127.0.0.1"), str, where, "listen.host"),
        listen_port=port,
        allowed_hosts=_hosts(listen.get("allowed_hosts", []), where),
        allowed_origins=_origins(listen.get("allowed_origins", []), where),
        default_model=_optional(data.get("default_model"), str, where, "default_model"),
        max_body_bytes=max_body_mb * 1024 * 1024,
        max_answer_bytes=max_answer_mb * 1024 * 1024,
        max_event_bytes=max_event_mb * 1024 * 1024,
        read_timeout_s=float(_positive(data.get("read_timeout_s", 600), where,
                                       "read_timeout_s")),
        shutdown_timeout_s=float(_positive(data.get("shutdown_timeout_s", 30), where,
                                           "shutdown_timeout_s")),
        autoload=_expect(data.get("autoload", True), bool, where, "autoload"),
        eviction_wait_s=float(_positive(data.get("eviction_wait_s", 30), where,
                                        "eviction_wait_s")),
        schedule=_one_of(data.get("schedule", "grouped"), SCHEDULES, where, "schedule"),
        max_wait_s=float(_positive(data.get("max_wait_s", 20), where, "max_wait_s")),
        priority_aging_s=float(_positive(data.get("priority_aging_s", 120), where,
                                         "priority_aging_s")),
        stream_progress=_one_of(data.get("stream_progress", "opt-in"), PROGRESS_MODES, where,
                                "stream_progress"),
        queue_limit=_non_negative(data.get("queue_limit", 100), where, "queue_limit"),
        kv_cache_max_mb=_non_negative(data.get("kv_cache_max_mb", 4096), where,
                                      "kv_cache_max_mb"),
        records_enabled=_expect(records.get("enabled", True), bool, where, "records.enabled"),
        records_path=_path(records.get("path"), base, where, "records.path"),
        records_store_text=_expect(records.get("store_text", False), bool, where,
                                   "records.store_text"),
        records_text_max_bytes=_non_negative(records.get("text_max_bytes", 4096), where,
                                             "records.text_max_bytes"),
        records_max_age_days=float(_finite(records.get("max_age_days", 30), where,
                                           "records.max_age_days")),
        records_max_bytes=_non_negative(records.get("max_mb", 1024), where,
                                        "records.max_mb") * 1024 * 1024,
        health_interval_s=float(_positive(health.get("interval_s", 5), where,
                                          "health.interval_s")),
        health_timeout_s=float(_positive(health.get("timeout_s", 5), where,
                                         "health.timeout_s")),
        health_misses=_non_negative(health.get("misses", 3), where, "health.misses"),
        auth_keys_file=_path(auth.get("keys_file"), base, where, "auth.keys_file"),
        admin_socket=_path(admin.get("socket"), base, where, "admin.socket"),
        admin_group=_optional(admin.get("group"), str, where, "admin.group"),
        admin_public=_expect(admin.get("public", False), bool, where, "admin.public"),
        admin_public_metrics=_expect(admin.get("public_metrics", False), bool, where,
                                     "admin.public_metrics"),
        upstreams=upstreams,
        source=source,
    )


def _names(value: Any, where: str, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ConfigError(f"{where}: {key} must be a list of non-empty strings")
    return [v.strip().lower() for v in value]


def _hosts(value: Any, where: str) -> tuple[str, ...]:
    """Host names as a Host header carries them, without the port: "gpu-box",
    "gpu-box.lan", "192.168.1.5", "[fe80::1]" (or "*")."""
    hosts = _names(value, where, "listen.allowed_hosts")
    for host in hosts:
        if host != "*" and ((":" in host.strip("[]") and not host.startswith("["))
                            or "/" in host or " " in host):
            raise ConfigError(f"{where}: listen.allowed_hosts: {host!r} is not a host name "
                              "(no scheme, port or path; an IPv6 address in brackets)")
    return tuple(h.rstrip(".") for h in hosts)


def _origins(value: Any, where: str) -> tuple[str, ...]:
    """Web origins as a browser's Origin header carries them: scheme://host[:port]."""
    origins = _names(value, where, "listen.allowed_origins")
    for origin in origins:
        scheme, sep, rest = origin.partition("://")
        if origin != "*" and (not sep or scheme not in ("http", "https") or not rest
                              or "/" in rest):
            raise ConfigError(f"{where}: listen.allowed_origins: {origin!r} is not an "
                              "origin (scheme://host[:port], no path; or \"*\")")
    return tuple(origins)


def _kinds(value: Any, backend: Backend, args: list[str], where: str,
           key: str) -> tuple[ModelKind, ...]:
    """The configured kinds (an openai server may have several: kind = ["chat",
    "embedding"]), checked against the backend and, for llama, against the flags in `args`
    that decide what llama-server answers: `--embeddings` or `--rerank` without a kind
    make the model that kind; with a kind they contradict, the configuration is refused
    (its every request would be refused or answered by the wrong engine)."""
    names = value if isinstance(value, list) and backend is Backend.OPENAI else \
        ([] if value is None else [value])
    kinds: list[ModelKind] = []
    for name in names:
        try:
            kinds.append(ModelKind(name))
        except ValueError:
            raise ConfigError(f"{where}: {key} must be one of "
                              f"{', '.join(repr(k.value) for k in ModelKind)}"
                              f"{' (or a list of them)' if backend is Backend.OPENAI else ''}"
                              f", not {name!r}") from None
    if isinstance(value, list) and not kinds:
        raise ConfigError(f"{where}: {key} is an empty list")
    allowed = BACKEND_KINDS[backend]
    for kind in kinds:
        if kind not in allowed:
            raise ConfigError(f"{where}: {key} = {kind.value!r} does not fit backend "
                              f"{backend.value!r} (whisper models are 'audio'; llama models "
                              "are 'chat', 'embedding' or 'rerank'; an openai server may be "
                              "any kind)")
    if backend is not Backend.LLAMA:
        return tuple(dict.fromkeys(kinds))
    flagged = (ModelKind.RERANK if RERANK_FLAGS & set(args) else
               ModelKind.EMBEDDING if EMBEDDING_FLAGS & set(args) else None)
    if flagged is None:
        return tuple(kinds)
    if not kinds:
        return (flagged,)
    if kinds[0] is ModelKind.CHAT or (kinds[0] is ModelKind.EMBEDDING
                                      and flagged is ModelKind.RERANK):
        flag = sorted((RERANK_FLAGS if flagged is ModelKind.RERANK else EMBEDDING_FLAGS)
                      & set(args))[0]
        engine = "an embedding" if flagged is ModelKind.EMBEDDING else "a rerank"
        raise ConfigError(f"{where}: {key} = {kinds[0].value!r} contradicts {flag} in its "
                          f"args, which makes llama-server {engine} engine that "
                          f"answers no {kinds[0].value} request; drop the flag, or say "
                          f"kind = {flagged.value!r}")
    return tuple(kinds)


def _command(table: Mapping[str, Any], backend: Backend, base: Path, where: str,
             key: str) -> tuple[str, ...]:
    """An openai model's command line: a list of strings, the server first, with the
    placeholders of PLACEHOLDERS; it must listen on {socket} or {port}, one of them."""
    if backend is not Backend.OPENAI:
        given = [k for k in _OPENAI_ONLY if k in table]
        if given:
            raise ConfigError(f"{where}: {key}.{given[0]} is only for backend = \"openai\" "
                              f"(a {backend.value} model's engine is "
                              f"{backend.value}-server, run by the gateway)")
        return ()
    command = _expect(table.get("command"), list, where, f"{key}.command")
    if not command or not all(isinstance(a, str) for a in command) or not command[0].strip():
        raise ConfigError(f"{where}: {key}.command must be a non-empty list of strings, the "
                          "server's program first")
    used = {name for arg in command for name in placeholders(arg, where, f"{key}.command")}
    for value in table.get("env", {}).values():
        if isinstance(value, str):
            used |= set(placeholders(value, where, f"{key}.env"))
    listens = used & {"socket", "port"}
    if len(listens) != 1:
        raise ConfigError(
            f"{where}: {key}.command must tell the server where to listen with exactly one "
            "of {socket} (a unix socket: e.g. uvicorn's --uds {socket}, vLLM's --uds "
            "{socket}) or {port} (TCP on 127.0.0.1, inside the engine's own network "
            f"namespace: e.g. --port {{port}}); it has {' and '.join(sorted(listens)) or 'neither'}"
            ". The gateway never gives an engine a port of the host's")
    for name, needs in (("model_path", "path"), ("ctx_size", "ctx_size"),
                        ("threads", "threads")):
        if name in used and table.get(needs) is None:
            raise ConfigError(f"{where}: {key}.command uses {{{name}}} but [{key}] has no "
                              f"{needs}")
    return (_binary(command[0], base, where, f"{key}.command"), *command[1:])


def placeholders(text: str, where: str, key: str) -> list[str]:
    """The placeholders in one argument ({name}; {{ and }} are literal braces); an unknown
    name or a stray brace is a ConfigError that lists the known ones."""
    found = []
    for match in _PLACEHOLDER.finditer(text):
        token, name = match.group(0), match.group(1)
        if token in ("{{", "}}"):
            continue
        if name is None or name not in PLACEHOLDERS:
            known = ", ".join(f"{{{n}}}" for n in PLACEHOLDERS)
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise ConfigError(f"{where}: {key}: {token!r} in {shown!r} is not a placeholder "
                              f"(known: {known}; write {{{{ and }}}} for literal braces)")
        found.append(name)
    return found


def fill(text: str, values: Mapping[str, str]) -> str:
    """text with its placeholders replaced by values (a name not in values is kept as
    {name}: the whisper launcher's {port}, chosen where the engine runs)."""
    def one(match: re.Match[str]) -> str:
        token, name = match.group(0), match.group(1)
        if token in ("{{", "}}"):
            return token[0]
        return values.get(name, token) if name is not None else token
    return _PLACEHOLDER.sub(one, text)


def _parse_model(name: str, table: Any, base: Path, where: str) -> ModelConfig:
    key = f"models.{name}"
    _expect(table, dict, where, key)
    _no_unknown(table, _MODEL_KEYS, f"{where} [{key}]")
    if not name.strip():
        raise ConfigError(f"{where}: a model name cannot be empty")
    try:
        backend = Backend(table.get("backend", "llama"))
    except ValueError:
        raise ConfigError(f"{where}: {key}.backend must be one of "
                          f"{', '.join(repr(b.value) for b in Backend)}") from None
    path = _path(table.get("path"), base, where, f"{key}.path")
    source = _source(table.get("source"), path, backend, where, key, name)
    if path is None and source is None and backend is not Backend.OPENAI:
        raise ConfigError(f"{where}: [{key}] needs a path (the model file) or a source "
                          "(where to pull it from)")
    args = _expect(table.get("args", []), list, where, f"{key}.args")
    if args and backend is Backend.OPENAI:
        raise ConfigError(f"{where}: {key}.args is for llama and whisper models; an openai "
                          "model's whole command line is its `command`")
    aliases = _expect(table.get("aliases", []), list, where, f"{key}.aliases")
    env = _expect(table.get("env", {}), dict, where, f"{key}.env")
    for item in (*args, *aliases, *env.values()):
        _expect(item, str, where, f"{key} (args, aliases and env values)")
    ctx = _optional(table.get("ctx_size"), int, where, f"{key}.ctx_size")
    kinds = _kinds(table.get("kind"), backend, args, where, f"{key}.kind")
    command = _command(table, backend, base, where, key)
    ready_path = _expect(table.get("ready_path", "/v1/models"), str, where, f"{key}.ready_path")
    if not ready_path.startswith("/") or any(c in ready_path for c in " \r\n#"):
        raise ConfigError(f"{where}: {key}.ready_path = {ready_path!r} is not a path (it "
                          "starts with /, e.g. \"/health\" or \"/v1/models\")")
    ready_status = _expect(table.get("ready_status", 200), int, where, f"{key}.ready_status")
    if not 200 <= ready_status < 400:
        raise ConfigError(f"{where}: {key}.ready_status = {ready_status} is not a success "
                          "status (200-399)")
    margin = table.get("vram_margin_mib")
    return ModelConfig(
        name=name, path=path, backend=backend, args=tuple(args),
        mmproj=_path(table.get("mmproj"), base, where, f"{key}.mmproj"),
        aliases=tuple(aliases), ctx_size=ctx, env=dict(env),
        memory_max=_bytes(table.get("memory_max"), where, f"{key}.memory_max"),
        memory_high=_bytes(table.get("memory_high"), where, f"{key}.memory_high"),
        cpu_quota=_percent(table.get("cpu_quota"), where, f"{key}.cpu_quota"),
        cuda_visible_devices=_optional(table.get("cuda_visible_devices"), str, where,
                                       f"{key}.cuda_visible_devices"),
        vram_margin_mib=None if margin is None else _non_negative(margin, where,
                                                                  f"{key}.vram_margin_mib"),
        threads=_optional(table.get("threads"), int, where, f"{key}.threads"),
        pin=_expect(table.get("pin", False), bool, where, f"{key}.pin"),
        kind=kinds[0] if kinds else None,
        also=kinds[1:],
        preload=_expect(table.get("preload", False), bool, where, f"{key}.preload"),
        idle_ttl_s=None if table.get("idle_ttl_s") is None else float(
            _positive(table["idle_ttl_s"], where, f"{key}.idle_ttl_s")),
        max_concurrency=None if table.get("max_concurrency") is None else int(
            _positive(_expect(table["max_concurrency"], int, where, f"{key}.max_concurrency"),
                      where, f"{key}.max_concurrency")),
        queue_limit=None if table.get("queue_limit") is None else _non_negative(
            table["queue_limit"], where, f"{key}.queue_limit"),
        max_wait_s=None if table.get("max_wait_s") is None else float(
            _positive(table["max_wait_s"], where, f"{key}.max_wait_s")),
        priority=priority_class(table.get("priority", "normal"), where, f"{key}.priority"),
        kv_cache_save=_expect(table.get("kv_cache_save", True), bool, where,
                              f"{key}.kv_cache_save"),
        spill_over=_expect(table.get("spill_over", False), bool, where, f"{key}.spill_over"),
        command=command, ready_path=ready_path, ready_status=ready_status,
        vram_mib=_mib(table.get("vram_mib"), where, f"{key}.vram_mib"),
        ram_mib=_mib(table.get("ram_mib"), where, f"{key}.ram_mib"),
        source=source,
    )


def _source(value: Any, path: Path | None, backend: Backend, where: str,
            key: str, name: str) -> str | None:
    """A model's hub source, as `llm-gateway pull` takes it (normalised)."""
    if value is None:
        return None
    text = _expect(value, str, where, f"{key}.source")
    if path is not None:
        raise ConfigError(f"{where}: [{key}] has a path and a source: the source is where "
                          "the file is pulled from when it is not here; give one of them")
    if backend is not Backend.LLAMA:
        raise ConfigError(f"{where}: {key}.source is for llama models (GGUF files)")
    try:
        valid_name(name)   # pulled into models_dir/NAME/
        return str(PullSpec.parse(text))
    except ModelSourceInvalid as e:
        raise ConfigError(f"{where}: {key}.source: {e.message}") from None


def _one_of(value: Any, words: tuple[str, ...], where: str, key: str) -> str:
    text: str = _expect(value, str, where, key)
    if text not in words:
        raise ConfigError(f"{where}: {key} must be one of {', '.join(words)}, not {text!r}")
    return text


def priority_class(value: Any, where: str, key: str) -> int:
    """A priority class by name (core/priority): low, normal or high."""
    found = parse_class(value)
    if found is None:
        raise ConfigError(f"{where}: {key} must be one of {', '.join(CLASSES)}, not "
                          f"{value!r}")
    return found


def _mib(value: Any, where: str, key: str) -> int | None:
    """A declared memory need in MiB (a positive integer)."""
    if value is None:
        return None
    number: int = _expect(value, int, where, key)
    if number < 1:
        raise ConfigError(f"{where}: {key} must be a positive number of MiB")
    return number


def _no_unknown(table: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")


def _expect(value: Any, kind: type | tuple[type, ...], where: str, key: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: {key} must be a {names}, not {value!r}")
    return value


def _optional(value: Any, kind: type, where: str, key: str) -> Any:
    return None if value is None else _expect(value, kind, where, key)


def _non_negative(value: Any, where: str, key: str) -> int:
    number: int = _expect(value, int, where, key)
    if number < 0:
        raise ConfigError(f"{where}: {key} cannot be negative")
    return number


def _finite(value: Any, where: str, key: str) -> float:
    """A number of seconds, days...: not negative, and finite (TOML has inf and nan; an
    infinite timeout is no timeout, and relay.c's wait would overflow on it)."""
    number: float = _expect(value, (int, float), where, key)
    if not math.isfinite(number):
        raise ConfigError(f"{where}: {key} = {number} is not a finite number")
    if number < 0:
        raise ConfigError(f"{where}: {key} cannot be negative")
    return number


def _positive(value: Any, where: str, key: str) -> float:
    number = _finite(value, where, key)
    if number <= 0:
        raise ConfigError(f"{where}: {key} must be positive")
    return number


def _at_least_1(value: Any, where: str, key: str) -> int:
    number: int = _expect(value, int, where, key)
    if number < 1:
        raise ConfigError(f"{where}: {key} must be at least 1")
    return number


def _bytes(value: Any, where: str, key: str) -> int | None:
    """512M, 8G, or a plain number of bytes (systemd's base-1024 suffixes)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = str(value).strip().upper()
    try:
        number = float(text[:-1]) * units[text[-1]] if text[-1:] in units else float(text)
    except (ValueError, IndexError):
        number = -1
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{where}: {key} = {value!r} is not a size (use e.g. \"512M\" or "
                          "\"8G\")")
    return int(number)


def _percent(value: Any, where: str, key: str) -> float | None:
    """"150%" (of one CPU) -> 150.0."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        number = float(text.removesuffix("%")) if text.endswith("%") else -1.0
    except ValueError:
        number = -1.0
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{where}: {key} = {value!r} is not a CPU quota (use e.g. \"200%\")")
    return number


def _binary(value: Any, base: Path, where: str, key: str) -> str:
    """An engine server: a bare name is looked up in PATH when an engine starts; a path
    with a slash is taken from base (the configuration file's directory) if relative."""
    name = _expect(value, str, where, key).strip()
    if not name:
        raise ConfigError(f"{where}: {key} is empty: give the engine server's name or path")
    return str(base / name) if "/" in name and not name.startswith("/") else name


def _path(value: Any, base: Path, where: str, key: str) -> Path | None:
    if value is None:
        return None
    path = Path(_expect(value, str, where, key)).expanduser()
    return path if path.is_absolute() else base / path
