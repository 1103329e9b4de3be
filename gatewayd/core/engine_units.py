"""What an engine's unit looks like: its name, socket, argv and properties. Pure.

A model id is client-controlled text as far as this module is concerned, so
it only ever reaches systemd in three escaped forms:

- the unit name: systemd's unit-name escaping (`systemd-escape`), shortened
  with a hash when long, so the socket path stays under the 108-byte limit;
- argv and environment: passed as separate strings over D-Bus (never through
  a shell), with `$` doubled, because systemd expands `${VAR}` in ExecStart
  even for transient units (verified; `%` specifiers are not expanded there);
- the model id itself travels only as a value (Description, environment,
  journal field), from which adoption reads it back.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePosixPath

from gatewayd.core.catalog import Model
from gatewayd.core.config import Backend, GatewayConfig, ModelKind, fill
from gatewayd.core.unit_spec import UnitSpec, exec_args
from gatewayd.core.variants import adapter_args, adapter_env

UNIT_PREFIX = "llm-engine"
ENGINES_SLICE = "llm-engines.slice"
SOCKET_NAME = "engine.sock"
MODEL_ENV = "LLM_GATEWAY_MODEL"
SOCKET_ENV = "LLM_GATEWAY_SOCKET"
DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# the LoRA adapters it loaded, in --lora's order (core/variants.adapter_env): what its
# requests' lora list is made from, after a reload or a gateway restart too
ADAPTERS_ENV = "LLM_GATEWAY_ADAPTERS"
MAX_INSTANCE = 64          # /run/llm-engine-<instance>/engine.sock stays < 108 bytes
WHISPER_PORT = 8080        # a TCP engine's, inside its private network namespace
# The engines' identity, never the gateway's: a static system user where the package
# made one (sysusers.d), else DynamicUser= allocates one of that name per start
ENGINE_USER = "llm-engine"
# PrivateTmp= gives every engine a /tmp and /var/tmp of its own: files there are unseen
PRIVATE_TMP = ("/tmp", "/var/tmp")
# DevicePolicy=closed lets through /dev/null & co. and these: the NVIDIA GPUs
# (frontend: /dev/nvidia0.. and /dev/nvidiactl; uvm: unified memory; caps: MIG)
GPU_DEVICES = ("char-nvidia-frontend", "char-nvidia-uvm", "char-nvidia-caps")
_AF_INET, _AF_INET6 = 2, 10
_ANY = [(_AF_INET, bytes(4), 0), (_AF_INET6, bytes(16), 0)]
_LOOPBACK = [(_AF_INET, bytes([127, 0, 0, 0]), 8), (_AF_INET6, bytes(15) + b"\x01", 128)]
_EPERM = 1
_MS_REC = 16384   # a recursive bind, as BindReadOnlyPaths= in a unit file
ADMIN_SOCKET = "/run/llm-gateway/admin.sock"   # a root gateway's (adapters/admin_socket)
_UNIT_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:_.")


def escape_unit_component(text: str) -> str:
    """systemd's unit_name_escape(): what `systemd-escape TEXT` prints."""
    out = []
    for i, byte in enumerate(text.encode()):
        char = chr(byte)
        if char == "/":
            out.append("-")
        elif char in _UNIT_SAFE and not (i == 0 and char == "."):
            out.append(char)
        else:
            out.append(f"\\x{byte:02x}")
    return "".join(out)


def engine_instance(model_id: str) -> str:
    """The escaped, length-bounded name that identifies a model's engine in systemd."""
    if not model_id:
        raise ValueError("empty model id")
    escaped = escape_unit_component(model_id)
    if len(escaped) <= MAX_INSTANCE:
        return escaped
    digest = hashlib.sha256(model_id.encode()).hexdigest()[:12]
    head = escaped[:MAX_INSTANCE - 13]
    cut = head.rfind("\\", len(head) - 3)  # never cut an \xNN escape in half
    if cut != -1:
        head = head[:cut]
    return f"{head}_{digest}"


@dataclass(frozen=True)
class EngineLayout:
    """Where a model's engine lives: its unit, runtime directory and socket."""
    model_id: str
    instance: str
    unit: str
    runtime_directory: str    # relative to /run (RuntimeDirectory=)
    socket: str

    @classmethod
    def for_model(cls, model_id: str, *, template: bool = False,
                  run_root: str = "/run") -> EngineLayout:
        instance = engine_instance(model_id)
        unit = f"{UNIT_PREFIX}@{instance}.service" if template else \
            f"{UNIT_PREFIX}-{instance}.service"
        rundir = f"{UNIT_PREFIX}-{instance}"
        return cls(model_id, instance, unit, rundir, f"{run_root}/{rundir}/{SOCKET_NAME}")


def unit_patterns() -> list[str]:
    """Glob patterns matching every engine unit, in both modes."""
    return [f"{UNIT_PREFIX}-*.service", f"{UNIT_PREFIX}@*.service"]


def server_binary(model: Model, config: GatewayConfig) -> tuple[str, str]:
    """(the engine server's configured name or path, its configuration key); a bare name
    is resolved against PATH by the adapter."""
    if model.backend is Backend.LLAMA:
        return config.llama_server, "llama_server"
    if model.backend is Backend.OPENAI:
        return model.config.command[0], f"models.{model.id}.command"
    return config.whisper_server, "whisper_server"


def listens_on_tcp(model: Model) -> bool:
    """Its server listens on a TCP port, not a unix socket: whisper-server, an openai
    server told {port}. The unit then runs it behind the launcher's socket proxy
    (gatewayd.engine_launch), in a network namespace of its own where it can."""
    return model.backend is Backend.WHISPER or (
        model.backend is Backend.OPENAI and model.config.listens_on_port)


def placeholder_values(model: Model, layout: EngineLayout) -> dict[str, str]:
    """What an openai model's placeholders stand for ({port}: chosen by the launcher
    where the engine runs, so left as it is)."""
    mc = model.config
    values = {"socket": layout.socket, "model": model.id}
    for name, value in (("model_path", mc.path), ("ctx_size", mc.ctx_size),
                        ("threads", mc.threads)):
        if value is not None:
            values[name] = str(value)
    return values


def engine_fingerprint(model: Model, config: GatewayConfig) -> tuple[object, ...]:
    """What a model's engine is started with: two equal fingerprints, one same engine.
    A configuration reload restarts an engine whose fingerprint changed (its aliases,
    pinning or queue limits are not in it: those change nothing in the process)."""
    layout = EngineLayout.for_model(model.id)
    binary = server_binary(model, config)[0]
    return (binary, tuple(server_argv(model, layout, binary)),
            tuple(sorted(engine_env(model, layout).items())), tuple(resource_limits(model)),
            model.backend, model.size_bytes)


def keeps_kv_cache(model: Model) -> bool:
    """Its KV cache is saved at a stop and restored at the next start: llama chat engines
    (embedding and rerank engines keep no conversation worth a file), unless the model
    says kv_cache_save = false."""
    return (model.backend is Backend.LLAMA and model.kind is ModelKind.CHAT
            and model.config.kv_cache_save)


def settings_stamp(model: Model, config: GatewayConfig) -> str:
    """engine_fingerprint as a short stable key (a file name, a JSON key)."""
    return hashlib.sha256(repr(engine_fingerprint(model, config)).encode()).hexdigest()[:32]


def server_argv(model: Model, layout: EngineLayout, binary: str, *,
                slot_save_path: str | None = None) -> list[str]:
    """The engine server's own command line; binary: its absolute path; slot_save_path:
    where llama-server may write slot files (keeps_kv_cache models).

    For a TCP server (whisper, an openai server told {port}), "{port}" stands for the
    loopback port the launcher chooses.
    """
    mc = model.config
    threads = ["-t", str(mc.threads)] if mc.threads else []
    if model.backend is Backend.OPENAI:
        values = placeholder_values(model, layout)
        return [binary, *(fill(arg, values) for arg in mc.command[1:])]
    if model.backend is Backend.LLAMA:
        argv = [binary, "--host", layout.socket,
                "-m", str(mc.path), "--alias", model.id, *threads,
                *([] if "--metrics" in mc.args else ["--metrics"])]   # /admin/metrics?engines=1
        if mc.mmproj:
            argv += ["--mmproj", str(mc.mmproj)]
        argv += adapter_args(mc.adapters)
        if mc.ctx_size:
            argv += ["-c", str(mc.ctx_size)]
        if model.kind is ModelKind.EMBEDDING:   # then it serves embeddings only
            argv.append("--embeddings")
            # OpenAI's embeddings need pooling: the header's, or else mean
            if "--pooling" not in mc.args and (model.facts is None
                                               or model.facts.pooling_type is None):
                argv += ["--pooling", "mean"]
        elif model.kind is ModelKind.RERANK and not {"--rerank", "--reranking"} & set(mc.args):
            argv.append("--rerank")   # embeddings with rank pooling: /v1/rerank only
        if slot_save_path is not None and "--slot-save-path" not in mc.args:
            argv += ["--slot-save-path", slot_save_path]
        return argv + list(mc.args)
    return [binary, "-m", str(mc.path),
            "--host", "127.0.0.1", "--port", "{port}",
            "--inference-path", "/v1/audio/transcriptions", *threads, *mc.args]


def engine_argv(model: Model, layout: EngineLayout, binary: str, *,
                slot_save_path: str | None = None) -> list[str]:
    """ExecStart of a transient engine unit."""
    argv = server_argv(model, layout, binary, slot_save_path=slot_save_path)
    if not listens_on_tcp(model):
        return argv
    # a TCP server: the launcher runs it on a loopback port inside the unit's private
    # network namespace and exposes it on the unix socket.
    return [sys.executable, "-m", "gatewayd.engine_launch", "--socket", layout.socket,
            "--port", str(WHISPER_PORT), "--", *argv]


def engine_env(model: Model, layout: EngineLayout,
               visible_devices: str | None = None) -> dict[str, str]:
    """The engine's environment. visible_devices: the GPUs placement chose (where the
    model names none); not part of the engine's fingerprint, as any device will do."""
    own = model.config.env
    if model.backend is Backend.OPENAI:
        values = placeholder_values(model, layout)
        own = {name: fill(value, values) for name, value in own.items()}
    env = {MODEL_ENV: model.id, SOCKET_ENV: layout.socket, **own}
    if model.config.adapters:
        env[ADAPTERS_ENV] = adapter_env(model.config.adapters)
    named = model.config.cuda_visible_devices
    devices = visible_devices if named is None else named
    if devices is not None:
        env[DEVICES_ENV] = devices
    return env


def template_settings(model: Model, layout: EngineLayout, binary: str, *,
                      slot_save_path: str | None = None,
                      visible_devices: str | None = None) -> dict[str, object]:
    """What llm-engine@<instance>.service reads (gatewayd.engine_launch --settings)."""
    return {"model": model.id, "backend": model.backend.value, "socket": layout.socket,
            "port": WHISPER_PORT, "tcp": listens_on_tcp(model),
            "argv": server_argv(model, layout, binary, slot_save_path=slot_save_path),
            "env": engine_env(model, layout, visible_devices)}


ENGINE_OOM_SCORE_ADJUST = 200   # llm-engine@.service says the same
EX_CONFIG = 78   # engine_launch's exit when the engine cannot work as configured


def resource_limits(model: Model) -> list[tuple[str, str, object]]:
    """Per-model cgroup limits as (property, D-Bus signature, value)."""
    limits: list[tuple[str, str, object]] = []
    if model.config.memory_max is not None:
        limits.append(("MemoryMax", "t", model.config.memory_max))
    if model.config.memory_high is not None:
        limits.append(("MemoryHigh", "t", model.config.memory_high))
    if model.config.cpu_quota is not None:   # percent -> CPU time per second
        limits.append(("CPUQuotaPerSecUSec", "t", round(model.config.cpu_quota * 10_000)))
    return limits


def gateway_secrets(config: GatewayConfig) -> list[str]:
    """What an engine must never see of the gateway's, whatever the files' modes: the
    call records, the configuration, the API keys and upstream keys, the admin socket.
    (A root gateway's files are often world-readable under its umask.)"""
    records = str(config.records_file)
    paths = [records, f"{records}-wal", f"{records}-shm", f"{records}-journal",
             str(config.admin_socket or ADMIN_SOCKET)]
    paths += [str(p) for p in (config.source, config.auth_keys_file) if p is not None]
    paths += [str(u.api_key_file) for u in config.upstreams if u.api_key_file is not None]
    return paths


def within(path: str, roots: Sequence[str]) -> str | None:
    """The root of roots that path is, or is under (None: none)."""
    return next((r for r in roots if path == r or path.startswith(r + "/")), None)


def in_private_tmp(paths: Sequence[str]) -> list[str]:
    """The paths an engine's private /tmp or /var/tmp would hide (PrivateTmp=)."""
    return [p for p in paths if within(p, PRIVATE_TMP)]


def engine_sandbox(model: Model, *, system: bool, slot_save_path: str | None = None,
                   hidden: Sequence[str] = (), shown: Sequence[str] = ()
                   ) -> list[tuple[str, str, object]]:
    """What confines an engine unit, as StartTransientUnit properties; the same as
    llm-engine@.service's (units/). An engine parses untrusted models, prompts, images
    and audio: one that is compromised must not become the gateway or root.

    system: a unit of the system manager (the gateway is root), which can give the
    engine the whole sandbox. A user manager cannot change identity or set up mount
    namespaces and BPF firewalls for an unprivileged user: what it can enforce is kept
    (seccomp and the no-new-privileges bit: system calls, address families, personality,
    realtime, namespaces)."""
    tcp = listens_on_tcp(model)
    # llama-server (an openai server told {socket}) listens on its unix socket only;
    # whisper-server (one told {port}) on a loopback port (in its own network namespace
    # where systemd can make one) behind the unix socket
    families = ["AF_UNIX", "AF_INET"] if tcp else ["AF_UNIX"]
    props: list[tuple[str, str, object]] = [
        ("NoNewPrivileges", "b", True),
        ("LockPersonality", "b", True),
        ("RestrictRealtime", "b", True),
        ("RestrictSUIDSGID", "b", True),
        ("RestrictNamespaces", "t", 0),   # = yes: no namespace of its own
        ("RestrictAddressFamilies", "(bas)", (True, families)),
        ("SystemCallArchitectures", "as", ["native"]),
        ("SystemCallFilter", "(bas)", (True, ["@system-service"])),
        ("SystemCallFilter", "(bas)", (False, ["@privileged"])),
        ("SystemCallErrorNumber", "i", _EPERM),   # a denied call fails, not the engine
    ]
    if not system:
        return props
    props += [
        ("CapabilityBoundingSet", "t", 0),
        ("PrivateTmp", "b", True),
        ("ProtectSystem", "s", "strict"),      # models and everything else read-only
        ("ProtectHome", "s", "read-only"),     # models may live in home directories
        ("ProtectProc", "s", "invisible"),
        ("ProtectKernelTunables", "b", True),
        ("ProtectKernelModules", "b", True),
        ("ProtectKernelLogs", "b", True),
        ("ProtectControlGroups", "b", True),
        ("ProtectClock", "b", True),
        ("ProtectHostname", "b", True),
        ("RemoveIPC", "b", True),
        ("DevicePolicy", "s", "closed"),
        ("DeviceAllow", "a(ss)", [(device, "rw") for device in GPU_DEVICES]),
        # no IP at all for a unix-socket engine; a TCP one's loopback only
        ("IPAddressDeny", "a(iayu)", _ANY),
    ]
    if tcp:
        props.append(("IPAddressAllow", "a(iayu)", _LOOPBACK))
    if slot_save_path is not None:
        # the one place it writes besides its runtime directory: the KV folders (the
        # template's too). Not its own folder alone: systemd 252 writes the path into the
        # transient unit's file unescaped, and reads an instance's "\x2d" back as "x2d"
        # after a daemon-reexec (the unit then fails, 226/NAMESPACE); "-": may be missing
        props.append(("ReadWritePaths", "as", [f"-{PurePosixPath(slot_save_path).parent}"]))
    if hidden:   # "-": one that does not exist is no error
        props.append(("InaccessiblePaths", "as", [f"-{path}" for path in hidden]))
    if shown:    # the gateway's own code under /tmp (a checkout there): seen read-only
        props.append(("BindReadOnlyPaths", "a(ssbt)",
                      [(path, path, True, _MS_REC) for path in shown]))
    return props


def unreadable_by_engine(chain: Sequence[tuple[str, int, int, int]], uid: int | None,
                         gids: frozenset[int], *, bound: bool = False) -> str | None:
    """Why the engine's user cannot read a file, or None if it can. chain: (path, st_mode,
    st_uid, st_gid) of every directory from / down, then of the file itself; uid None: a
    dynamic user (owns nothing, in no group: the "other" bits decide); bound: the file is
    bound into the engine's private /tmp (the gateway's own code: in_private_tmp)."""
    for n, (path, mode, owner, group) in enumerate(chain):
        if path == "/" or not path:
            continue
        if not bound and (tmp := within(path, PRIVATE_TMP)):
            return f"{path} is in {tmp}, which the engine's private {tmp} hides (PrivateTmp=)"
        need = 0o4 if n == len(chain) - 1 else 0o1   # the file: read; a directory: search
        if uid is not None and owner == uid:
            bits = mode >> 6
        elif group in gids:
            bits = mode >> 3
        else:
            bits = mode
        if not bits & need:
            what = "read" if need == 0o4 else "search (x)"
            return f"{path} (mode {mode & 0o7777:04o}) does not let user {ENGINE_USER} {what} it"
    return None


def transient_spec(model: Model, layout: EngineLayout, binary: str, *,
                   private_network: bool = True, slot_save_path: str | None = None,
                   visible_devices: str | None = None, system: bool = False,
                   hidden: Sequence[str] = (), shown: Sequence[str] = ()) -> UnitSpec:
    """The transient service unit that runs this model's engine.

    private_network: TCP engines (listens_on_tcp) get a network namespace of their own (their TCP
    port reachable by nobody); where systemd cannot set one up properly, they listen
    on a free loopback port behind the same unix socket (engine_launch).
    system: a unit of the system manager: it runs as ENGINE_USER in the whole sandbox
    (engine_sandbox), its KV directory handed over to that user at each start; shown:
    the gateway's own code where the private /tmp would hide it (whisper's launcher and
    the parked wait's preloaded library run from it); hidden:
    paths it must not see at all (gateway_secrets)."""
    env = engine_env(model, layout, visible_devices)
    extra: dict[str, tuple[str, object]] = {
        # llama-server refuses to start on a leftover socket file. The runtime directory
        # is recreated on every start, but not for systemd's own restart of a crashed
        # engine after a daemon-reexec. (As ExecStopPost it would cost the cold start
        # nothing, but a crash then passes through deactivating/stop-post, which reads
        # as a stop: the place freed while systemd restarts the engine. Tried, reverted.)
        # (Inside the sandbox, so a unit being parked takes noticeably longer to reach its
        # wait on a loaded host, docs/benchmarks.md, "Figures behind choices in the code";
        # a privileged ExecStartPreEx= would not, but systemd 252 loses those at a
        # daemon-reexec, which is when this one is needed: tried, reverted.)
        "ExecStartPre": ("a(sasb)", [["/bin/rm", exec_args(["/bin/rm", "-f", "--", layout.socket]),
                                      False]]),
        "LogExtraFields": ("aay", [f"{MODEL_ENV}={model.id}".encode()]),
        "MemoryAccounting": ("b", True),   # memory per engine, from systemd
        # a process of the engine killed for want of memory: the whole unit stops (with
        # Result=oom-kill on cgroup v2), and the gateway does not let systemd restart it
        # into the same wall (engine_lifecycle); systemd's default, said on purpose
        "OOMPolicy": ("s", "stop"),
        # when the machine runs out, the kernel had better kill an engine (reported,
        # restarted on demand) than the user's other programs or the gateway
        "OOMScoreAdjust": ("i", ENGINE_OOM_SCORE_ADJUST),
        # the launcher's "this cannot work as configured" (a TCP server on the wrong
        # port, loopback down): a restart would meet the same, so the unit fails at once
        # with the reason in its journal
        "RestartPreventExitStatus": ("(aiai)", ([EX_CONFIG], [])),
    }
    if listens_on_tcp(model) and private_network:
        extra["PrivateNetwork"] = ("b", True)
    for name, signature, value in resource_limits(model):
        extra[name] = (signature, value)
    return UnitSpec(
        name=layout.unit,
        argv=engine_argv(model, layout, binary, slot_save_path=slot_save_path),
        description=f"LLM engine {model.id}",
        environment=env,
        runtime_directory=layout.runtime_directory,
        syslog_identifier=f"{UNIT_PREFIX}-{layout.instance}",
        slice=ENGINES_SLICE,
        restart_sec=1.0,
        extra=extra,
        user=ENGINE_USER if system else None,
        hand_over=(slot_save_path,) if system and slot_save_path is not None else (),
        sandbox=engine_sandbox(model, system=system, slot_save_path=slot_save_path,
                               hidden=hidden, shown=shown),
    )



# -- parked units ------------------------------------------------------------------
#
# A parked unit is a model's engine unit created ahead of its start, its main process
# blocked on opening a FIFO. Waking it is one write to the FIFO, and the engine runs
# under the unit's name, journal, cgroup and limits with no fork, no cgroup attach and
# no D-Bus round trip on the request's path: a wake is a fraction of a new unit's start
# (docs/benchmarks.md, "Figures behind choices in the code"). The gateway unlinks the
# FIFO as it wakes the unit, so systemd's restart of a crashed engine (the same
# ExecStart) finds none and runs the engine at once. The wake line carries the
# CUDA_VISIBLE_DEVICES placement chose ("-": keep the unit's own).
#
# Two ways to wait. Preloaded (gatewayd/engine_park.c): the unit runs the engine's own
# command line with a small library preloaded that blocks before the engine's main(),
# after the dynamic linker bound every symbol and the constructors ran, so the wake
# starts main() at once (the exec and linking, far longer for a CUDA build's libraries
# than for a CPU llama-server, are paid while parked). Behind a shell, where the library
# was not built or the engine binary cannot take it (static, or not glibc's): the shell
# execs the engine in place once woken.
PARKED_ENV = "LLM_GATEWAY_PARKED"     # the digest of the engine unit it becomes
PARK_FIFO_ENV = "LLM_GATEWAY_PARK_FIFO"   # the preloaded wait's FIFO
PARK_PROGRAM_ENV = "LLM_GATEWAY_PARK_PROGRAM"   # who waits (not the unit's ExecStartPre)
PARKED_COMM = "llm-parked"    # the preloaded wait's process name while it waits
PARK_SHELL = "/bin/sh"
KEEP_DEVICES = "-"
PARK_SCRIPT = (f'if [ -p "$0" ]; then read -r d < "$0" && [ "$d" != {KEEP_DEVICES} ] && '
               f'export {DEVICES_ENV}="$d"; fi; exec "$@"')


def spec_digest(spec: UnitSpec) -> str:
    """What a unit is, as a short key: a parked unit becomes the engine unit of the same
    digest, and one parked for a setup that has changed since is discarded."""
    return hashlib.sha256(repr(spec.properties()).encode()).hexdigest()[:32]


def parked_spec(spec: UnitSpec, fifo: str, preload: str | None = None) -> UnitSpec:
    """spec's unit, its engine waiting behind the FIFO until woken: in the engine itself
    with the preload library (its path) where given, else behind a shell. A model whose
    environment sets LD_PRELOAD of its own is parked behind the shell (the preloaded
    wait clears LD_PRELOAD for the engine's children)."""
    environment = {**spec.environment, PARKED_ENV: spec_digest(spec)}
    if spec.user:   # the engine's user opens the FIFO
        spec = replace(spec, hand_over=(*spec.hand_over, fifo))
    if preload is not None and "LD_PRELOAD" not in spec.environment:
        return replace(spec, environment={**environment, "LD_PRELOAD": preload,
                                          "LD_BIND_NOW": "1", PARK_FIFO_ENV: fifo,
                                          PARK_PROGRAM_ENV: spec.argv[0]})
    return replace(spec, argv=[PARK_SHELL, "-c", PARK_SCRIPT, fifo, *spec.argv],
                   environment=environment)


def wake_line(spec: UnitSpec, visible_devices: str | None) -> bytes:
    """What the FIFO is told: the devices placement chose where they differ from the
    unit's own environment (a model that names its devices keeps them)."""
    if visible_devices is None or DEVICES_ENV in spec.environment \
            or "\n" in visible_devices or visible_devices == KEEP_DEVICES:
        return f"{KEEP_DEVICES}\n".encode()
    return f"{visible_devices}\n".encode()


def adapters_of(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The adapters an engine loaded, read back from its environment (engine_env); None
    where the environment is not an engine's (no model in it)."""
    if MODEL_ENV not in env:
        return None
    return tuple(name for name in env.get(ADAPTERS_ENV, "").split(",") if name)
