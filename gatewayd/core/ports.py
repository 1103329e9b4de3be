"""The small interfaces the engine layer needs from the outside world.

The core and the engine manager depend on these, never on D-Bus, NVML or
journald directly; tests pass fakes, app.py passes the real adapters.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from gatewayd.core.budget import MIB
from gatewayd.core.catalog import Model
from gatewayd.core.engine_units import EngineLayout
from gatewayd.core.placement import DeviceMemory
from gatewayd.core.pull import RemoteFile, RepoListing
from gatewayd.core.ram_budget import HostMemory

if TYPE_CHECKING:   # (the batches' types: the engine layer's ports need none of them)
    from gatewayd.core.batch import Batch, Line, StoredFile


@dataclass(frozen=True)
class EngineUnitInfo:
    """What systemd knows about one engine unit."""

    unit: str
    model_id: str | None        # read back from the unit's environment
    socket: str | None
    active_state: str
    sub_state: str
    main_pid: int
    n_restarts: int
    memory_bytes: int | None    # systemd's MemoryCurrent (cgroup accounting)
    started_at_us: int          # ExecMainStartTimestamp (µs since the epoch), 0 if never
    cpu_ns: int | None = None   # systemd's CPUUsageNSec (cgroup accounting)
    visible_devices: str | None = None   # its CUDA_VISIBLE_DEVICES (placement), if any
    control_group: str | None = None     # systemd's ControlGroup, e.g. /system.slice/x.service
    adapters: tuple[str, ...] | None = None   # the LoRA adapters it loaded (None: unknown)


UnitWatcher = Callable[[str, Mapping[str, Any]], None]


class UnitControl(Protocol):
    """Creates, stops and lists engine units. One implementation per privilege mode."""

    mode: str        # "transient" or "template"
    manager: str     # "system" or "user"

    def layout(self, model_id: str) -> EngineLayout: ...
    def check_startable(self, model: Model) -> None:
        """Raise what start_engine would fail on before anything runs: the engine server
        not found or not executable (EngineBinaryMissing), the model's files missing or
        not readable by the engine's user (ConfigError). Asked before room is made for the
        engine, so that a start that cannot happen evicts nobody. A few file looks."""
        ...

    async def start_engine(self, model: Model,
                           visible_devices: str | None = None) -> EngineLayout:
        """Start the model's unit (visible_devices: its CUDA_VISIBLE_DEVICES, where
        placement chose among several GPUs). Raises UnitAlreadyActive when systemd already runs a
        unit of that name (the gateway lost track of it); waits out a previous instance
        that is still being collected."""
        ...

    async def stop_engine(self, unit: str) -> None:
        """Stop the unit; returns once it is inactive and (transient units) gone, so the
        next start of the same name cannot collide with it. No such unit: done."""
        ...

    async def kill_engine(self, unit: str) -> None:
        """SIGKILL every process of the unit (a hung engine): systemd restarts it."""
        ...

    async def limit_memory(self, unit: str, high_bytes: int) -> None:
        """MemoryHigh= on the running unit, for this boot (auto_memory_high): above it the
        kernel reclaims the engine's memory instead of letting it grow into the rest of
        the machine."""
        ...

    async def park(self, model: Model) -> bool:
        """Prepare the stopped model's unit so that its next start_engine is fast (a
        parked unit: no engine, invisible to list_engines, engine_info and watch until
        that start). False: this mode or model is not parked."""
        ...

    def parked(self) -> list[str]:
        """The models whose unit is parked now."""
        ...

    async def list_engines(self) -> list[EngineUnitInfo]: ...
    async def engine_info(self, unit: str) -> EngineUnitInfo | None: ...
    def watch(self, callback: UnitWatcher) -> Callable[[], None]: ...


class KvCacheStore(Protocol):
    """An engine's KV cache kept across its stop (llama-server's slot files). Neither call
    raises: a failure is logged and counted, and the stop or start goes on without it."""

    @property
    def counts(self) -> Mapping[tuple[str, str], int]:
        """(save|restore, ok|failed) -> how many."""
        ...

    async def save(self, model_id: str, socket: str, instance: str) -> int:
        """Save the KV cache of the ready engine at socket; how many parallel slots."""
        ...

    async def restore(self, model_id: str, socket: str, instance: str) -> int:
        """Restore the saved KV cache into the engine at socket; tokens restored."""
        ...

    def prune(self, keep: Collection[str]) -> list[str]:
        """Delete the saved KV cache of every engine instance not in keep; the instances
        deleted. Blocking (the file system): run it off the event loop."""
        ...


class MemoryBook(Protocol):
    """GPU memory learned per engine setup (a settings stamp) from what engines held."""

    def get(self, key: str) -> int | None: ...
    def record(self, key: str, model_id: str, mib: int) -> bool:
        """Keep it; True when it changed what was known."""
        ...

    def forget_model(self, model_id: str) -> int:
        """Drop every figure learned for model_id (it was removed); how many."""
        ...


class GpuProbe(Protocol):
    """Fresh GPU memory readings; None means no GPU (or no NVML)."""

    description: str

    def devices(self) -> list[DeviceMemory] | None:
        """Every device's total and free memory, read now; raises GpuUnavailable when
        NVML fails on one."""
        ...

    def process_mib(self) -> dict[int, int] | None:
        """MiB of GPU memory per process (NVML), or None where that is unknown."""
        ...


class HealthProbe(Protocol):
    async def status(self, socket: str, timeout: float = 2.0,
                     path: str = "/health") -> int | None:
        """HTTP status of GET path (the model's health path: catalog.Model.health) over
        the unix socket; None if unreachable or no answer within timeout seconds."""
        ...


class JournalReader(Protocol):
    async def tail(self, unit: str, lines: int) -> list[str]: ...


class DesiredList(Protocol):
    """The engines the user wants running, in the order they were started (kept across
    reboots). add/remove change the list at once and store it in the background (a
    failure to store it is the list's to report); flush waits until it is stored."""

    @property
    def ids(self) -> list[str]: ...
    def add(self, model_id: str) -> None: ...
    def remove(self, model_id: str) -> None: ...
    async def flush(self) -> None: ...


@dataclass(frozen=True)
class MemoryUse:
    """What one engine unit holds in RAM now, and where the figure came from."""

    current_bytes: int
    # "cgroup": highest the kernel saw since the cgroup was made; "pss": highest this
    # meter sampled while the unit's processes lived (a lower bound); None: unknown
    peak_bytes: int | None
    # "cgroup": what the kernel charges to the unit's memory cgroup (v2 memory.current,
    # v1 memory.usage_in_bytes): its anonymous and kernel memory, and page cache only where
    # the unit read it first: a model file it mmaps that was already cached (read by an
    # earlier engine, a download) is not in it. "pss": the sum of its processes'
    # proportional set sizes: all they map, cached files included, shared ones divided
    source: str
    oom_kills: int | None   # kernel OOM kills inside the unit's cgroup so far; None: unknown

    @property
    def current_mib(self) -> int:
        return -(-self.current_bytes // MIB)

    @property
    def peak_mib(self) -> int | None:
        return None if self.peak_bytes is None else -(-self.peak_bytes // MIB)


class MemoryMeter(Protocol):
    def read(self, control_group: str) -> MemoryUse | None:
        """The unit's memory now (control_group: systemd's ControlGroup property of the
        unit); None where neither its cgroup nor its processes can be read. Blocking: a
        cgroup read is a few small files, but PSS makes the kernel walk the processes'
        page tables, which takes time in proportion to what they map, so call it from a
        thread (asyncio.to_thread), not the event loop."""
        ...

    def pids(self, control_group: str) -> list[int] | None:
        """Every process of the unit (its cgroup and below): what NVML shows per process
        is summed over them, as a server's GPU work may run in its children (vLLM's
        workers; any TCP engine, whose main process is the launcher). None: unknown."""
        ...


class HostMemoryProbe(Protocol):
    """The machine's memory, read fresh (/proc/meminfo), and its OOM kills."""

    def read(self) -> HostMemory: ...

    def oom_kills(self) -> int | None:
        """The kernel's count of OOM kills since boot (/proc/vmstat oom_kill; None:
        unknown)."""
        ...


class HubClient(Protocol):
    """A model hub (adapters/hub.py: Hugging Face, through its own client)."""

    def listing(self, repo: str, revision: str | None) -> RepoListing: ...

    def probe(self, repo: str, commit: str, file: RemoteFile) -> None:
        """Raise what downloading file would (a gated repository without a token), before
        a pull is promised to its caller."""
        ...

    def download(self, repo: str, commit: str, file: RemoteFile, out: BinaryIO,
                 cancel: threading.Event) -> None:
        """Append the rest of the file's bytes to out (opened for appending: its position
        is what it has); PullCancelled once cancel is set, OSError when writing fails (a
        full disk)."""
        ...


class BatchBook(Protocol):
    """Batch jobs kept (adapters/batch_store.py: SQLite and a folder of files). Every call
    is its own transaction, and blocks: the service calls it off the event loop."""

    def path_of(self, file_id: str) -> Any: ...

    def add_file(self, stored: StoredFile, chunks: Iterable[bytes]) -> None: ...

    def file(self, file_id: str) -> StoredFile | None: ...

    def files(self, owner: str | None, *, purpose: str | None, after: str | None,
              limit: int, newest_first: bool) -> list[StoredFile]: ...

    def count_files(self) -> int: ...

    def free_bytes(self) -> int: ...

    def delete_file(self, file_id: str) -> None: ...

    def input_of_running(self, file_id: str) -> str | None: ...

    def add_batch(self, batch: Batch, lines: Iterable[Line]) -> None: ...

    def save(self, batch: Batch) -> None: ...

    def batch(self, batch_id: str) -> Batch | None: ...

    def batches(self, owner: str | None, *, after: str | None, limit: int
                ) -> list[Batch]: ...

    def unended(self) -> list[Batch]: ...

    def lines_waiting(self) -> dict[tuple[str, str], int]: ...

    def pending(self, batch_id: str, limit: int) -> list[Line]: ...

    def mark_sent(self, batch_id: str, number: int) -> bool: ...

    def unsend(self, batch_id: str, number: int | None = None) -> int: ...

    def fail_unanswered(self, batch_id: str, code: str, message: str,
                        request_id: Callable[[], str]) -> int: ...

    def finish(self, batch_id: str, number: int, *, ok: bool | None,
               result: dict[str, Any]) -> None: ...

    def resume(self, batch_id: str) -> list[tuple[int, str]]: ...

    def results(self, batch_id: str, *, ok: bool) -> Iterator[bytes]: ...

    def drop_lines(self, batch_id: str) -> None: ...

    def close(self) -> None: ...


class WholeAnswers(Protocol):
    """One request to a local engine's socket, its answer read whole
    (adapters/engine_wire/client.EngineClient.ask): (status, body). Raises
    EngineUnavailable (reached_no_process where it reached no process), EngineBusy,
    EngineFailed (the answer broke off) or AnswerTooLarge."""

    async def ask(self, socket: str, target: str, body: bytes, *, limit: int
                  ) -> tuple[int, bytes]: ...
