"""The configuration's keys, declared once. Pure.

Every key of gateway.toml (and of the keys file) is one `Key` in KEYS: its table,
name, type, default, bound and one line on what it does. From that table come the
checks of every value a table can describe (`read`, whose messages name the key as
`llm-gateway check` prints them), the unknown-key lists (`known`), and the reference
in docs/configuration.md (`markdown`, printed by `python -m gatewayd.core.config_schema
--markdown`; tests/unit/test_config_schema.py fails when the page says otherwise).

What a table cannot say stays code in core/config.py, on keys declared here: the
backend decides which model keys apply, `command` has placeholders, `kind` must agree
with `args`, a `source` excludes a `path`. `[upstreams.NAME]` and the keys file are
read by core/upstreams and core/auth; their keys are declared here for the reference.

A table and a small reader, not a validation library: the configuration is read on
the socket-activated start's path, and a library's import would cost more than this
module, while its error messages would still need translating into ours (the
figures: docs/design.md, the core's `config`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from gatewayd.core.auth import ALL_MODELS, INFERENCE, SCOPES
from gatewayd.core.errors import ConfigError
from gatewayd.core.priority import CLASSES
from gatewayd.core.progress import MODES as PROGRESS_MODES
from gatewayd.core.upstreams import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_HEALTH_INTERVAL_S


# the words of `backend`, `kind` and `unit_mode` (core/config re-exports them: the rest of
# the code knows them as its own)
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


class UnitMode(StrEnum):
    """How engine units are created (see docs/design.md, "Privilege model")."""

    AUTO = "auto"            # transient when safe (user manager, or root), else template
    TRANSIENT = "transient"  # StartTransientUnit
    TEMPLATE = "template"    # llm-engine@<id>.service + a settings file per instance


class Kind(StrEnum):
    """How a key's value is read; the value is the type the reference shows."""

    INTEGER = "integer"
    NUMBER = "number"               # an integer or a float, finite (TOML has inf and nan)
    BOOLEAN = "boolean"
    STRING = "string"
    WORD = "word"                   # one of the key's words
    PATH = "path"                   # relative: to the configuration file's directory
    PROGRAM = "program"             # a name looked up in PATH, or a path
    SIZE = "size"                   # "512M", "8G" or a number of bytes (systemd's units)
    CPU_QUOTA = "CPU quota"         # "150%": of one CPU
    STRINGS = "list of strings"
    STRING_TABLE = "table of strings"
    TABLE = "table"                 # read by core code (a custom key)


class Bound(NamedTuple):
    """Where a number must lie (low and high included; above: low excluded), and what
    the error says when it does not: a template of {key}, {value}, {low} and {high}.
    (Bound and Key are named tuples, not dataclasses: they are made on the socket-activated
    start's path, where a dataclass's class costs several times as much to make.)"""

    low: int
    high: float = math.inf
    says: str = "{key} = {value} is out of range: allowed {low}..{high}"
    above: bool = False

    def holds(self, number: float) -> bool:
        return (number > self.low if self.above else number >= self.low) \
            and number <= self.high

    @property
    def shown(self) -> str:
        if self.high == math.inf:
            return f"> {self.low}" if self.above else f"≥ {self.low}"
        return f"{self.low}..{self.high}"


# each tuple is checked in order: a timeout of -1 "cannot be negative", of 0 "must be positive"
NOT_NEGATIVE = (Bound(0, says="{key} cannot be negative"),)
POSITIVE = (*NOT_NEGATIVE, Bound(0, says="{key} must be positive", above=True))
AT_LEAST_1 = (Bound(1, says="{key} must be at least 1"),)
MIB = (Bound(1, says="{key} must be a positive number of MiB"),)
TCP_PORT = (Bound(1, 65535, says="{key} = {value} is not a TCP port"),)
SUCCESS = (Bound(200, 399, says="{key} = {value} is not a success status (200-399)"),)
MB = 1024 * 1024


def _words(values: Iterable[str]) -> dict[str, Any]:
    """Words that read as themselves (a StrEnum's: as its members)."""
    return {str(value): value for value in values}


class Key(NamedTuple):
    """One key: where it is, what it takes, what it does."""

    table: str                  # "" (the top level), "listen", "models.NAME", "keys.NAME"...
    name: str
    kind: Kind
    default: Any                # None: unset (what that means, doc says)
    doc: str                    # one line, for the reference
    bounds: tuple[Bound, ...] = ()
    words: Mapping[str, Any] = MappingProxyType({})   # WORD: each, and what it reads as
    into: str = ""              # the GatewayConfig or ModelConfig field it fills (its name)
    scale: int = 1              # that field holds the value times this (MB -> bytes)
    custom: bool = False        # read by core/config.py's code: a rule a table cannot say

    @property
    def fills(self) -> str:
        return self.into or self.name

    @property
    def allowed(self) -> str:
        """The bound or the words, as the reference shows them."""
        if self.words:
            return ", ".join(f"`{word}`" for word in self.words)
        return self.bounds[-1].shown if self.bounds else ""


# each table, and what it is for (the reference's headings, in this order)
TABLES: Mapping[str, str] = {
    "": "keys outside any table (above the first `[table]` line)",
    "memory": "RAM as a budget beside the GPU's (see [memory.md](memory.md))",
    "listen": "where the gateway listens when not socket-activated, and who may call it",
    "health": "a ready engine that stops answering `/health` is hung: killed, and "
              "systemd restarts it",
    "records": "one row per call in `<state_dir>/records.db` (SQLite, WAL)",
    "batches": "batch jobs, OpenAI's Batch API, run when the machine is idle (see "
               "[batches.md](batches.md))",
    "auth": "API keys (see [security.md](security.md))",
    "admin": "the admin API (see [security.md](security.md))",
    "models.NAME": "one model; explicit entries win over files found in `models_dir`",
    "models.VARIANT": "a variant: a `[models.NAME]` table with `variant_of`, another name "
                      "for that model's engine with request defaults and limits (see "
                      "[variants.md](variants.md)); it takes only "
                      "these keys",
    "upstreams.NAME": "an OpenAI-compatible server elsewhere that answers some models",
    "keys.NAME": "one API key, in the keys file (`[auth] keys_file`), not in gateway.toml",
}
KEYS_FILE_TABLES = ("keys.NAME",)

KEYS: tuple[Key, ...] = (
    Key("", "models_dir", Kind.PATH, None,
        "`*.gguf` files, and subdirectories (one model each, `mmproj*.gguf` attached)"),
    Key("", "max_engines", Kind.INTEGER, 4, "engines running at once", (Bound(1, 16),)),
    Key("", "parked_engines", Kind.INTEGER, 4, "stopped llama engines whose unit waits, "
        "parked, so that their next start skips creating a unit; 0: none", (Bound(0, 32),)),
    Key("", "vram_margin_mib", Kind.INTEGER, 1024, "MiB added to every VRAM need (estimated "
        "or learned): CUDA context, slack", NOT_NEGATIVE),
    Key("", "llama_server", Kind.PROGRAM, "llama-server",
        "the llama-server engines run (bring your CUDA build)"),
    Key("", "whisper_server", Kind.PROGRAM, "whisper-server",
        "the whisper-server audio engines run"),
    Key("", "state_dir", Kind.PATH, None, "records, saved KV caches, learned needs (unset: "
        "systemd's `$STATE_DIRECTORY`, else `/var/lib/llm-gateway`)"),
    Key("", "bus", Kind.STRING, "auto", "the systemd manager engines run under: `auto` "
        "(root: the system's, else the user's), `system`, `user` or a D-Bus address"),
    Key("", "unit_mode", Kind.WORD, "auto", "how engine units are made: transient when "
        "safe (`auto`), always transient, or `llm-engine@` template instances",
        words=_words(UnitMode)),
    Key("", "load_timeout_s", Kind.NUMBER, 300, "an engine not ready by then has failed, "
        "and is stopped", POSITIVE),
    Key("", "default_model", Kind.STRING, None,
        "the model of `/props`, `/metrics` and other paths without one"),
    Key("", "autoload", Kind.BOOLEAN, True,
        "a request for a stopped model starts it (`?autoload=false`: 503)"),
    Key("", "eviction_wait_s", Kind.NUMBER, 30,
        "how long a start waits for room to free up", POSITIVE),
    Key("", "schedule", Kind.WORD, "grouped", "which waiting model gets room: `grouped` "
        "(its turn, bounded by `max_wait_s`) or `fifo` (the order models asked)",
        words=_words(("grouped", "fifo"))),
    Key("", "max_wait_s", Kind.NUMBER, 20,
        "grouped: the longest a model is passed over for busy engines of its class "
        "(a lower class: until aged to theirs)", POSITIVE),
    Key("", "priority_aging_s", Kind.NUMBER, 120,
        "a waiting request counts one priority class higher per this", POSITIVE),
    Key("", "stream_progress", Kind.WORD, "opt-in", "`: waiting for ...` comment lines to a "
        "waiting stream: `opt-in` (`LLM-Gateway-Progress: 1`), `on` (unless it sends 0), "
        "`off`", words=_words(PROGRESS_MODES)),
    Key("", "queue_limit", Kind.INTEGER, 100, "requests waiting for one model's engine; "
        "above: 503 `queue_full` + Retry-After", NOT_NEGATIVE),
    Key("", "kv_cache_max_mb", Kind.INTEGER, 4096, "saved KV cache per model "
        "(`<state_dir>/kv-cache`), oldest files removed first", NOT_NEGATIVE),
    Key("", "max_body_mb", Kind.INTEGER, 256, "larger request bodies get a 413", AT_LEAST_1,
        into="max_body_bytes", scale=MB),
    Key("", "max_answer_mb", Kind.INTEGER, 256, "an answer read whole (not streamed) past "
        "this: 502 `answer_too_large`", AT_LEAST_1, into="max_answer_bytes", scale=MB),
    Key("", "max_event_mb", Kind.INTEGER, 4, "one streamed event past this without its end: "
        "the stream ends with an `event_too_large` error event", AT_LEAST_1,
        into="max_event_bytes", scale=MB),
    Key("", "read_timeout_s", Kind.NUMBER, 600, "longest silence from an engine mid-answer, "
        "wait for a turn at a busy engine, and stall of a stream's client", POSITIVE),
    Key("", "shutdown_timeout_s", Kind.NUMBER, 30,
        "on stop, open requests get this long to finish", POSITIVE),

    Key("memory", "ram_reserve_mib", Kind.INTEGER, 1024,
        "kept for the rest of the machine: never planned for engines", NOT_NEGATIVE),
    Key("memory", "ram_budget_mib", Kind.INTEGER, None,
        "at most this much RAM for all engines together (unset: no budget)", POSITIVE),
    Key("memory", "ram_margin_mib", Kind.INTEGER, 256, "added to every estimated RAM need: "
        "the process, its libraries, a CUDA runtime", NOT_NEGATIVE),
    Key("memory", "auto_memory_high", Kind.BOOLEAN, False,
        "each engine's unit gets MemoryHigh= at its learned RAM peak plus the headroom"),
    Key("memory", "memory_high_headroom_pct", Kind.INTEGER, 25,
        "that headroom, in percent of the peak", NOT_NEGATIVE),

    Key("listen", "host", Kind.STRING, "127.0.0.1", "the address to listen on",
        into="listen_host"),
    Key("listen", "port", Kind.INTEGER, 8080, "the TCP port to listen on", TCP_PORT,
        into="listen_port"),
    Key("listen", "allowed_hosts", Kind.STRINGS, [], "Host names besides loopback, the "
        "connected address and this machine's name (else 421); `\"*\"`: any", custom=True),
    Key("listen", "drain_notice_s", Kind.NUMBER, 0, "on a stop, `GET /ready` answers 503 "
        "this long while everything is still served, before the socket closes: a balancer's "
        "health checks take the gateway out first (see [fleet.md](fleet.md))",
        (*NOT_NEGATIVE, Bound(0, 30, says="{key} = {value}: at most {high} s (a stop has "
                              "TimeoutStopSec=45 for it and the drain)"))),
    Key("listen", "allowed_origins", Kind.STRINGS, [], "web origins (`scheme://host[:port]`) "
        "besides the gateway's own whose pages may call it (else 403); `\"*\"`: any",
        custom=True),

    Key("health", "interval_s", Kind.NUMBER, 5, "a ready engine's `/health` is asked this "
        "often", POSITIVE, into="health_interval_s"),
    Key("health", "timeout_s", Kind.NUMBER, 5, "any answer within this long is alive",
        POSITIVE, into="health_timeout_s"),
    Key("health", "misses", Kind.INTEGER, 3, "this many misses in a row: killed, systemd "
        "restarts it (0: never)", NOT_NEGATIVE, into="health_misses"),

    Key("records", "enabled", Kind.BOOLEAN, True, "keep a record of each call",
        into="records_enabled"),
    Key("records", "path", Kind.PATH, None, "the records' file (unset: "
        "`<state_dir>/records.db`)", into="records_path"),
    Key("records", "store_text", Kind.BOOLEAN, False,
        "also keep request and response text (never audio)", into="records_store_text"),
    Key("records", "text_max_bytes", Kind.INTEGER, 4096, "... capped at this many bytes "
        "each", NOT_NEGATIVE, into="records_text_max_bytes"),
    Key("records", "max_age_days", Kind.NUMBER, 30, "older records are deleted (0: kept)",
        NOT_NEGATIVE, into="records_max_age_days"),
    Key("records", "max_mb", Kind.INTEGER, 1024, "beyond this much data the oldest are "
        "deleted (0: no bound)", NOT_NEGATIVE, into="records_max_bytes", scale=MB),

    Key("batches", "max_file_mb", Kind.INTEGER, 100, "the largest batch input file taken",
        MIB, into="batch_max_file_bytes", scale=MB),
    Key("batches", "max_lines", Kind.INTEGER, 50_000, "the most requests in one input "
        "file", AT_LEAST_1, into="batch_max_lines"),
    Key("batches", "max_files", Kind.INTEGER, 500, "the most files kept (inputs and "
        "outputs); above: 507 until some are deleted", AT_LEAST_1, into="batch_max_files"),
    Key("batches", "disk_reserve_mb", Kind.INTEGER, 1024, "an upload that would leave less "
        "free on the state directory's disk is refused (507)", NOT_NEGATIVE,
        into="batch_disk_reserve_bytes", scale=MB),
    Key("batches", "idle_s", Kind.NUMBER, 30, "quiet this long (no interactive request), "
        "batch lines may load models and fill an engine's slots; before: one line per "
        "ready engine, in a gap of its users, nothing loaded", NOT_NEGATIVE,
        into="batch_idle_s"),
    Key("batches", "concurrency", Kind.INTEGER, 4, "batch lines in flight per model at "
        "most, once quiet", (Bound(1, 64),), into="batch_concurrency"),

    Key("auth", "keys_file", Kind.PATH, None, "the API keys (unset: no keys required)",
        into="auth_keys_file"),

    Key("admin", "socket", Kind.PATH, None, "the admin socket (unset: systemd's, else "
        "`<runtime dir>/llm-gateway/admin.sock`)", into="admin_socket"),
    Key("admin", "group", Kind.STRING, None, "a group that may use the admin socket too "
        "(besides root and the gateway's user)", into="admin_group"),
    Key("admin", "public", Kind.BOOLEAN, False, "`/admin/*` and the status page on the "
        "public port too (behind an admin key when keys are on)", into="admin_public"),
    Key("admin", "public_metrics", Kind.BOOLEAN, False,
        "`/admin/metrics` on the public port, read-only and keyless",
        into="admin_public_metrics"),

    Key("models.NAME", "path", Kind.PATH, None, "the model file (`.gguf`; whisper: its "
        "`.bin`); an openai model may have none"),
    Key("models.NAME", "backend", Kind.WORD, "llama", "what runs it: llama-server, "
        "whisper-server, or any OpenAI-compatible server (`command`)",
        words=_words(Backend), custom=True),
    Key("models.NAME", "args", Kind.STRINGS, [],
        "passed to llama-server or whisper-server as they are"),
    Key("models.NAME", "mmproj", Kind.PATH, None, "the multimodal projector file"),
    Key("models.NAME", "aliases", Kind.STRINGS, [], "more names for it (names are "
        "case-insensitive; file name, stem and GGUF name work too)"),
    Key("models.NAME", "ctx_size", Kind.INTEGER, None, "its context size (`--ctx-size`)"),
    Key("models.NAME", "env", Kind.STRING_TABLE, {}, "its engine's environment"),
    Key("models.NAME", "memory_max", Kind.SIZE, None,
        "MemoryMax= of its engine's unit (above: killed, `out_of_memory`)"),
    Key("models.NAME", "memory_high", Kind.SIZE, None,
        "MemoryHigh= (above: the kernel reclaims its memory, slowly)"),
    Key("models.NAME", "cpu_quota", Kind.CPU_QUOTA, None, "CPUQuota= of its engine's unit"),
    Key("models.NAME", "cuda_visible_devices", Kind.STRING, None,
        "pins its engine to these GPUs (unset: placed where it fits)"),
    Key("models.NAME", "vram_margin_mib", Kind.INTEGER, None,
        "its own VRAM margin (unset: the global one)", NOT_NEGATIVE),
    Key("models.NAME", "threads", Kind.INTEGER, None, "CPU threads (`--threads`)"),
    Key("models.NAME", "pin", Kind.BOOLEAN, False, "never evicted"),
    Key("models.NAME", "preload", Kind.BOOLEAN, False, "started when the gateway starts"),
    Key("models.NAME", "idle_ttl_s", Kind.NUMBER, None,
        "stopped after this long without requests (unset: kept)", POSITIVE),
    Key("models.NAME", "kind", Kind.WORD, None, "which requests it answers (an openai "
        "server: a list of them; unset: from `--embeddings`/`--rerank` in args, else the "
        "GGUF header)", words=_words(ModelKind), custom=True),
    Key("models.NAME", "max_concurrency", Kind.INTEGER, None,
        "requests at once; above: 429 + Retry-After", POSITIVE),
    Key("models.NAME", "queue_limit", Kind.INTEGER, None,
        "requests waiting for it (unset: the global one)", NOT_NEGATIVE),
    Key("models.NAME", "max_wait_s", Kind.NUMBER, None,
        "its own turn bound (unset: the global one)", POSITIVE),
    Key("models.NAME", "priority", Kind.WORD, "normal",
        "its requests' class (a key's wins)", words=CLASSES),
    Key("models.NAME", "kv_cache_save", Kind.BOOLEAN, True, "llama chat engines: the KV "
        "cache is saved at a stop and restored at the next start"),
    Key("models.NAME", "spill_over", Kind.BOOLEAN, False, "when it cannot take a request "
        "within its wait, an upstream serving one of its names does"),
    Key("models.NAME", "command", Kind.STRINGS, [], "openai: the server's command line, "
        "with placeholders (see [engines.md](engines.md))", custom=True),
    Key("models.NAME", "ready_path", Kind.STRING, "/v1/models",
        "openai: ready at the first `ready_status` answer to GET this path"),
    Key("models.NAME", "ready_status", Kind.INTEGER, 200, "openai: the status that says "
        "ready", SUCCESS),
    Key("models.NAME", "vram_mib", Kind.INTEGER, None,
        "openai: the VRAM it declares it takes (until learned)", MIB),
    Key("models.NAME", "ram_mib", Kind.INTEGER, None,
        "openai: the RAM it declares it takes (until learned)", MIB),
    Key("models.NAME", "adapters", Kind.TABLE, {}, "llama: LoRA adapters loaded at its "
        "start, each a model name `NAME:ADAPTER` (`{ sql = \"sql.gguf\" }`, or "
        "`{ sql = { path = ..., scale = 0.8, aliases = [...] } }`)", custom=True),
    Key("models.NAME", "source", Kind.STRING, None, "where its file is pulled from at first "
        "use (`ORG/REPO[:QUANT|:FILE]` or `hf://ORG/REPO/FILE`), into `models_dir/NAME/`",
        custom=True),

    Key("models.VARIANT", "variant_of", Kind.STRING, None, "the model whose engine serves "
        "it (one with an engine of its own, not a variant); required"),
    Key("models.VARIANT", "aliases", Kind.STRINGS, [], "more names for it"),
    Key("models.VARIANT", "adapter", Kind.STRING, None, "one of its base's `adapters`, "
        "applied to its requests"),
    Key("models.VARIANT", "defaults", Kind.TABLE, {}, "request fields set where the "
        "client sends none (`{ temperature = 0.2 }`; a table merged key by key)",
        custom=True),
    Key("models.VARIANT", "system_prompt", Kind.STRING, None,
        "a system message put first where the client sends none"),
    Key("models.VARIANT", "limits", Kind.TABLE, {}, "what the client cannot exceed: "
        "`{ max_tokens = 512 }` (a larger or missing length is lowered to it)",
        custom=True),
    Key("models.VARIANT", "priority", Kind.WORD, None,
        "its requests' class (unset: its base's; a key's wins)", words=CLASSES),

    Key("upstreams.NAME", "url", Kind.STRING, None, "its OpenAI base URL "
        "(`http://gpu-box:8080/v1`); required"),
    Key("upstreams.NAME", "models", Kind.STRINGS, None,
        "the models it serves (unset: discovered from its `/models`)"),
    Key("upstreams.NAME", "api_key_file", Kind.PATH, None, "a file holding its API key"),
    Key("upstreams.NAME", "api_key_credential", Kind.STRING, None,
        "or: the systemd credential holding it (`LoadCredential=NAME:...`)"),
    Key("upstreams.NAME", "tls_verify", Kind.BOOLEAN, True, "verify its TLS certificate"),
    Key("upstreams.NAME", "ca_file", Kind.PATH, None, "the CA its certificate is checked "
        "against (unset: the system's)"),
    Key("upstreams.NAME", "connect_timeout_s", Kind.NUMBER, DEFAULT_CONNECT_TIMEOUT_S,
        "not connected by then: it is down", POSITIVE),
    Key("upstreams.NAME", "read_timeout_s", Kind.NUMBER, None,
        "longest silence mid-answer (unset: the gateway's)", POSITIVE),
    Key("upstreams.NAME", "health_interval_s", Kind.NUMBER, DEFAULT_HEALTH_INTERVAL_S,
        "its `/models` is asked this often", POSITIVE),
    Key("upstreams.NAME", "max_concurrency", Kind.INTEGER, None,
        "requests at once; above: the next upstream, or 429", POSITIVE),

    Key("keys.NAME", "sha256", Kind.STRING, None, "the key's SHA-256, 64 lowercase hex "
        "digits (`llm-gateway key new NAME` prints it); required"),
    Key("keys.NAME", "models", Kind.STRINGS, [ALL_MODELS], "the models it may use"),
    Key("keys.NAME", "scopes", Kind.STRINGS, [INFERENCE],
        f"what it may do: {', '.join(f'`{s}`' for s in sorted(SCOPES))}"),
    Key("keys.NAME", "priority", Kind.WORD, None,
        "its requests' class (unset: the model's)", words=CLASSES),
)


_BY_TABLE = {table: tuple(key for key in KEYS if key.table == table) for table in TABLES}
# the key names each table may hold: its keys, and at the top level the tables
_KNOWN = {table: frozenset(key.name for key in keys) for table, keys in _BY_TABLE.items()}
_KNOWN[""] |= {table.partition(".")[0] for table in TABLES
               if table and table not in KEYS_FILE_TABLES}


def keys_of(table: str) -> tuple[Key, ...]:
    """The keys of one table ("" the top level, "models.NAME" a model's)."""
    return _BY_TABLE[table]


def known(table: str) -> frozenset[str]:
    """The key names a table may hold (at the top level: with the tables)."""
    return _KNOWN[table]


def no_unknown(data: Mapping[str, Any], table: str, where: str) -> None:
    """A typo is an error, never a key that silently does nothing."""
    allowed = known(table)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(allowed))}")


def read_table(data: Mapping[str, Any], table: str, where: str, prefix: str,
               base: Path) -> dict[str, Any]:
    """Every key of a table that the schema reads (not custom), by the field it fills;
    prefix is how the message names the table ("listen.", "models.chat.")."""
    return {key.fills: read(data.get(key.name, key.default), key, where, prefix + key.name,
                            base)
            for key in keys_of(table) if not key.custom}


_PYTHON_TYPE = {Kind.INTEGER: int, Kind.BOOLEAN: bool, Kind.STRING: str}


def read(value: Any, key: Key, where: str, name: str, base: Path) -> Any:
    """One value as its key declares it; an error names the key (name: as the file has
    it, e.g. "models.chat.ctx_size"). None stays None: unset, with no default."""
    if value is None:
        return None
    if key.kind is Kind.WORD:
        if not isinstance(value, str) or value not in key.words:
            raise ConfigError(f"{where}: {name} must be one of {', '.join(key.words)}, "
                              f"not {value!r}")
        return key.words[value]
    if key.kind is Kind.PATH:
        path = Path(expect(value, str, where, name)).expanduser()
        return path if path.is_absolute() else base / path
    if key.kind is Kind.PROGRAM:
        return program(value, base, where, name)
    if key.kind is Kind.SIZE:
        return size(value, where, name)
    if key.kind is Kind.CPU_QUOTA:
        return cpu_quota(value, where, name)
    if key.kind is Kind.STRINGS:
        for i, item in enumerate(expect(value, list, where, name)):
            expect(item, str, where, f"{name}[{i}]")
        return tuple(value)
    if key.kind is Kind.STRING_TABLE:
        for item, text in expect(value, dict, where, name).items():
            expect(text, str, where, f"{name}.{item}")
        return dict(value)
    if key.kind is Kind.NUMBER:
        expect(value, (int, float), where, name)
        if not math.isfinite(value):   # inf is no timeout at all (a timer overflows)
            raise ConfigError(f"{where}: {name} = {value} is not a finite number")
    else:
        expect(value, _PYTHON_TYPE[key.kind], where, name)
    for bound in key.bounds:
        if not bound.holds(value):
            raise ConfigError(f"{where}: " + bound.says.format(
                key=name, value=value, low=bound.low, high=bound.high))
    if key.kind is Kind.NUMBER:
        return float(value)
    return value * key.scale if key.scale != 1 else value


def expect(value: Any, kind: type | tuple[type, ...], where: str, key: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: {key} must be a {names}, not {value!r}")
    return value


def program(value: Any, base: Path, where: str, key: str) -> str:
    """An engine server: a bare name is looked up in PATH when an engine starts; a path
    with a slash is taken from base (the configuration file's directory) if relative."""
    name = expect(value, str, where, key).strip()
    if not name:
        raise ConfigError(f"{where}: {key} is empty: give the engine server's name or path")
    return str(base / name) if "/" in name and not name.startswith("/") else name


def size(value: Any, where: str, key: str) -> int:
    """512M, 8G, or a plain number of bytes (systemd's base-1024 suffixes)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
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


def cpu_quota(value: Any, where: str, key: str) -> float:
    """"150%" (of one CPU) -> 150.0."""
    text = str(value).strip()
    try:
        number = float(text.removesuffix("%")) if text.endswith("%") else -1.0
    except ValueError:
        number = -1.0
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{where}: {key} = {value!r} is not a CPU quota (use e.g. \"200%\")")
    return number


def markdown() -> str:
    """The reference of every key, one table per TOML table, for docs/configuration.md."""
    out: list[str] = []
    for table, about in TABLES.items():
        heading = "Top level" if table == "" else f"`[{table}]`"
        out += [f"### {heading}", "", f"{about[0].upper()}{about[1:]}.", "",
                "| key | type | default | allowed | what it does |", "|---|---|---|---|---|"]
        for key in keys_of(table):
            cells = (f"`{key.name}`", key.kind.value, _toml(key.default), key.allowed, key.doc)
            # a | in a cell, even inside `code`, would end it
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def _toml(value: Any) -> str:
    """A default as the file would write it ("" when unset)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list):
        return f"`[{', '.join(_toml(v).strip('`') for v in value)}]`"
    if isinstance(value, dict):
        return "`{}`"
    return f"`{value}`"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m gatewayd.core.config_schema --markdown")
    print(markdown(), end="")
