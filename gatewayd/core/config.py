"""The gateway's configuration: typed, frozen, validated with messages that name the key.

Parsed from TOML (`/etc/llm-gateway/gateway.toml`, or `--config`; reading the
file is gatewayd.adapters.config_file's job). Every key is optional. Unknown
keys are errors, so a typo never silently does nothing. The keys, their types,
defaults and bounds are declared once, in core/config_schema; this module reads
them into GatewayConfig and adds the rules that span keys. (Backend, ModelKind and
UnitMode, the words of three keys, are declared there too; the rest of the code
imports them from here.)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatewayd.core.auth import KeyRing
from gatewayd.core.config_schema import (
    TABLES,
    expect,
    known,
    no_unknown,
    program,
    read_table,
)
from gatewayd.core.config_schema import Backend as Backend
from gatewayd.core.config_schema import ModelKind as ModelKind
from gatewayd.core.config_schema import UnitMode as UnitMode
from gatewayd.core.errors import ConfigError, ModelSourceInvalid
from gatewayd.core.priority import NORMAL
from gatewayd.core.pull import PullSpec, valid_name
from gatewayd.core.upstreams import UpstreamConfig, parse_upstreams
from gatewayd.core.variants import Adapter, VariantConfig, parse_adapters, parse_variant

DEFAULT_CONFIG_PATH = Path("/etc/llm-gateway/gateway.toml")
DEFAULT_STATE_DIR = Path("/var/lib/llm-gateway")
# the tables of one kind each ([listen], [records]...), as opposed to [models.NAME]
_SECTIONS = tuple(table for table in TABLES if table and "." not in table)
# the keys of a server the gateway does not know (backend = "openai"), refused for the others
_OPENAI_ONLY = ("command", "ready_path", "ready_status")


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
    # llama: LoRA adapters loaded (unapplied) at its engine's start; each is a model name
    # BASE:ADAPTER, applied per request (core/variants)
    adapters: tuple[Adapter, ...] = ()

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
    # [models.NAME] tables with variant_of: more names for a model's engine, with request
    # defaults and limits (core/variants); resolved against the models in core/catalog
    variants: tuple[VariantConfig, ...] = ()
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
    # [listen] drain_notice_s: on a stop, /ready answers 503 this long (everything else
    # still served) before the listener closes: a balancer's checks take the gateway out
    drain_notice_s: float = 0.0
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
    # [batches]: OpenAI's Batch API (core/batch, service/batches), files and batches kept
    # under state_dir; bounded: a file's size and lines, the files kept, the disk left
    batch_max_file_bytes: int = 100 * 1024 * 1024
    batch_max_lines: int = 50_000
    batch_max_files: int = 500
    batch_disk_reserve_bytes: int = 1024 * 1024 * 1024
    batch_idle_s: float = 30.0
    batch_concurrency: int = 4
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


def parse_config(data: Mapping[str, Any], source: Path | None = None, *,
                 base: Path | None = None, state_dir: Path = DEFAULT_STATE_DIR
                 ) -> GatewayConfig:
    """Settings from parsed TOML. Relative paths are taken from base (default: the
    file's directory); state_dir is the default where the file names none."""
    where = str(source) if source else "config"
    base = base or (source.parent if source else Path("."))
    no_unknown(data, "", where)
    sections = {"": data}
    for table in _SECTIONS:
        sections[table] = expect(data.get(table, {}), dict, where, table)
        no_unknown(sections[table], table, f"{where} [{table}]")
    values: dict[str, Any] = {}
    for table, section in sections.items():
        values |= read_table(section, table, where, f"{table}." if table else "", base)
    values["state_dir"] = values["state_dir"] or state_dir   # the caller's: systemd's, or ours
    tables = expect(data.get("models", {}), dict, where, "models")
    variants = tuple(parse_variant(name, table, where) for name, table in tables.items()
                     if isinstance(table, dict) and "variant_of" in table)
    models = tuple(_parse_model(name, table, base, where) for name, table in tables.items()
                   if not (isinstance(table, dict) and "variant_of" in table))
    upstreams = parse_upstreams(data.get("upstreams", {}), base, where)
    spilling = [m.name for m in models if m.spill_over]
    if spilling and not upstreams:
        raise ConfigError(f"{where}: spill_over is set for {', '.join(spilling)} but there is "
                          "no [upstreams.NAME] table to spill over to")
    sourced = [m.name for m in models if m.source]
    if sourced and data.get("models_dir") is None:
        raise ConfigError(f"{where}: {', '.join(sourced)} name a source to pull from, but "
                          "there is no models_dir to pull into")
    listen = sections["listen"]
    return GatewayConfig(
        **values, models=models, variants=variants, upstreams=upstreams, source=source,
        allowed_hosts=_hosts(listen.get("allowed_hosts", []), where),
        allowed_origins=_origins(listen.get("allowed_origins", []), where))


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
        return ()
    command = expect(table.get("command"), list, where, f"{key}.command")
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
    return (program(command[0], base, where, f"{key}.command"), *command[1:])


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
    expect(table, dict, where, key)
    if variant_only := sorted(set(table) & (known("models.VARIANT") - known("models.NAME"))):
        raise ConfigError(f"{where}: [{key}]: {', '.join(variant_only)} belong to a variant "
                          "(a table with variant_of = \"BASE\": another name for BASE's "
                          "engine); a model of its own takes none of them")
    no_unknown(table, "models.NAME", f"{where} [{key}]")
    if not name.strip():
        raise ConfigError(f"{where}: a model name cannot be empty")
    try:
        backend = Backend(table.get("backend", "llama"))
    except ValueError:
        raise ConfigError(f"{where}: {key}.backend must be one of "
                          f"{', '.join(repr(b.value) for b in Backend)}") from None
    if backend is not Backend.OPENAI and (given := [k for k in _OPENAI_ONLY if k in table]):
        raise ConfigError(f"{where}: {key}.{given[0]} is only for backend = \"openai\" "
                          f"(a {backend.value} model's engine is "
                          f"{backend.value}-server, run by the gateway)")
    values = read_table(table, "models.NAME", where, f"{key}.", base)
    source = _source(table.get("source"), values["path"], backend, where, key, name)
    if values["path"] is None and source is None and backend is not Backend.OPENAI:
        raise ConfigError(f"{where}: [{key}] needs a path (the model file) or a source "
                          "(where to pull it from)")
    if values["args"] and backend is Backend.OPENAI:
        raise ConfigError(f"{where}: {key}.args is for llama and whisper models; an openai "
                          "model's whole command line is its `command`")
    kinds = _kinds(table.get("kind"), backend, values["args"], where, f"{key}.kind")
    ready_path = values["ready_path"]
    if not ready_path.startswith("/") or any(c in ready_path for c in " \r\n#"):
        raise ConfigError(f"{where}: {key}.ready_path = {ready_path!r} is not a path (it "
                          "starts with /, e.g. \"/health\" or \"/v1/models\")")
    adapters = parse_adapters(table.get("adapters", {}), where, f"{key}.adapters", base)
    if adapters and backend is not Backend.LLAMA:
        raise ConfigError(f"{where}: {key}.adapters: LoRA adapters are loaded by "
                          f"llama-server; a {backend.value} model has none")
    return ModelConfig(name=name, backend=backend, kind=kinds[0] if kinds else None,
                       also=kinds[1:], command=_command(table, backend, base, where, key),
                       source=source, adapters=adapters, **values)


def _source(value: Any, path: Path | None, backend: Backend, where: str,
            key: str, name: str) -> str | None:
    """A model's hub source, as `llm-gateway pull` takes it (normalised)."""
    if value is None:
        return None
    text = expect(value, str, where, f"{key}.source")
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
