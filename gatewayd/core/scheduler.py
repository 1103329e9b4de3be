"""Scheduling decisions. Pure: usage snapshots in, decisions out; no I/O, no awaits.

The dispatcher (gatewayd.service) gathers a snapshot, asks one of these
functions, and carries out the answer (stop a victim, mark one draining, start
an engine, wait). Because a decision never awaits, nothing can change under it:
no locks.

Who gets the next place: models waiting for room form one line. Only the model at
the head may make room; the ones behind it may take room that is already free only if
it is more than the models ahead of them need. The line's order is `line_order`:

- `schedule = "grouped"` (the default): by priority class (core/priority, aged by
  waiting), then the models whose oldest request has waited max_wait_s ("overdue"),
  oldest first, then the model with the most requests waiting (one load serves them
  all), then the oldest;
- `schedule = "fifo"`: in the order models asked for room (their first request queued),
  as llama-swap did before 2026.

How room is made, at the head of the line:
1. evict an engine among those that can go now (ready, serving nobody, awaited by
   nobody or draining, not pinned): the least recently *used* (used = an inference
   request; status polls do not count); grouped, of the lowest class first, and only
   one that has served nobody for IDLE_GRACE_S (its clients' next request is on its way)
   unless the waiting model is overdue or of a higher class, or no engine serves anyone
   and the engine's only recent client is the one now waiting (a lone client switching
   models swaps at once);
2. if none can go now, *drain* one (same order): its in-flight requests finish (never
   preempted), its new requests queue behind the waiting model, and once it serves
   nobody it is evicted (1.). Under fifo at once; grouped only when the waiting model
   is of a higher class than the engine's requests, or is overdue and of its class or
   higher: otherwise the busy engine keeps its place and its own traffic goes on (the
   waiting model takes a place as soon as one serves nobody). That is the grouping: a
   swap serves every request that waited for it, instead of one swap per change of
   model in the arrivals. The bound: a request waits for its model's turn at most
   max_wait_s (plus, while higher classes or overdue models are ahead of it, their
   turns), then the drain of the requests in flight, then one load.
One victim at a time; the dispatcher waits for its memory to come back before
deciding again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gatewayd.core.budget import still_to_load_mib
from gatewayd.core.engines import EngineState, holds_place
from gatewayd.core.priority import NORMAL

# grouped: how long an engine must have served nobody before it gives way to a model
# whose turn has not come. Its clients' next request follows an answer by milliseconds
# (an agent's tool call, a script's loop): an engine free for that moment still has work,
# and evicting it then is a swap per gap. Small beside any load (0.3 s for a tiny model,
# seconds to tens of seconds for real ones), so a model left without clients goes at once.
IDLE_GRACE_S = 1.0


@dataclass(frozen=True)
class Usage:
    """One engine as the scheduler sees it."""

    model_id: str
    state: EngineState
    in_flight: int = 0        # requests being served right now
    queued: int = 0           # requests waiting for this engine
    pinned: bool = False
    last_used: float = 0.0    # monotonic time of the last inference request
    estimate_mib: int = 0     # what it is expected to hold (file + mmproj + margin)
    measured_mib: int | None = None   # what NVML says its process holds, where known
    idle_ttl_s: float | None = None
    draining: bool = False    # picked to make room: finishing its requests, then evicted
    exit_unconfirmed: bool = False   # a signal said it ended; systemd has not confirmed
    devices: tuple[str, ...] = ()    # the GPUs it was placed on; (): all (or no GPU)
    priority: int = NORMAL    # the highest class among its requests (idle: its model's)
    # the one client it served over its last moments (its requests in flight, or within
    # IDLE_GRACE_S of the last); None: several, or not known
    sole_client: str | None = None

    def victim_order(self, grouped: bool) -> tuple[float, ...]:
        """Sort key of victims, first evicted first: the least recently used (grouped:
        of the lowest class)."""
        return (self.priority, self.last_used) if grouped else (self.last_used,)

    def on(self, devices: frozenset[str] | None) -> bool:
        """Whether stopping it frees memory on any of these devices (None: any)."""
        return devices is None or not self.devices or not devices.isdisjoint(self.devices)

    @property
    def holds_place(self) -> bool:
        return holds_place(self.state, self.exit_unconfirmed)

    def why_not_evictable(self) -> str | None:
        """Why this engine may not be stopped now (None: it may)."""
        if self.pinned:
            return "pinned"
        if self.state is not EngineState.READY:
            return self._state_text()
        if self.in_flight:
            return f"serving {self.in_flight} request(s)"
        if self.queued and not self.draining:
            return f"awaited by {self.queued} request(s)"
        return None

    def _state_text(self) -> str:
        if self.exit_unconfirmed:
            return f"{self.state.value}, not yet confirmed by systemd"
        return self.state.value

    def why_not_drainable(self) -> str | None:
        """Why this engine may not be drained to make room (None: it may)."""
        if self.pinned:
            return "pinned"
        if self.state is not EngineState.READY:
            return self._state_text()
        if self.queued and not self.draining:
            # requests woken by its load, about to take their turns: each load serves
            # the requests that waited for it, so swapping always makes progress
            return f"awaited by {self.queued} request(s)"
        return None


@dataclass(frozen=True)
class Fits:
    """Start now: there is room."""


@dataclass(frozen=True)
class Evict:
    """Stop this engine first (then decide again)."""

    model_id: str
    reason: str
    # the shortage alone ("max_engines reached", "needs 300 MiB of GPU memory, 100 MiB
    # free"), for the victim's stop reason; the decision is the same whatever its words
    why: str = field(default="", compare=False)


@dataclass(frozen=True)
class Drain:
    """Nothing can go now: let this engine finish what it serves, queue its new
    requests, and evict it once idle (then decide again)."""

    model_id: str
    reason: str


@dataclass(frozen=True)
class Wait:
    """Room is being made (a drain or a stop is under way), or models ahead in the
    line come first, or (grouped) the engines that hold the places are busy and the
    model's turn has not come: wait for a change, then decide again."""

    why: str
    turn: bool = False     # waiting for its turn (grouped), not for room being made


@dataclass(frozen=True)
class Blocked:
    """No room and nothing may go. `holders` say what is holding the resources."""

    limit: str                      # "engine_limit", "gpu_memory" or "ram"
    holders: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class TryAnyway:
    """Nothing else is running and it still does not fit by estimate: the estimate is
    conservative, so start it and report the engine's own failure if it does not load."""


Decision = Fits | Evict | Drain | Wait | Blocked | TryAnyway


def plan_start(model_id: str, usages: Sequence[Usage], *, max_engines: int, need_mib: int,
               free_mib: int | None, ahead: int = 0,
               devices: frozenset[str] | None = None, ram_need_mib: int = 0,
               ram_free_mib: int | None = None, ahead_ram_mib: int = 0,
               grouped: bool = False, overdue: bool = False,
               priority: int = NORMAL, now: float = 0.0,
               client: str | None = None) -> Decision:
    """Can model_id's engine start now, and if not, what happens first?

    free_mib is a fresh reading of free GPU memory on the devices placement chose
    (None: no GPU, memory not checked); devices: those devices (UUIDs), where memory
    is made room on: short of GPU memory, victims are the engines on them (short of
    places or of RAM, any engine); ram_free_mib: what the RAM ledger leaves for it
    (None: not checked); ahead is how many models are before this one in the line
    for room, and ahead_ram_mib the RAM they need. grouped: the grouped order (else
    fifo); overdue: the model's oldest request has waited its max_wait_s; priority: the
    highest class among its waiting requests (aged); now: the clock of last_used;
    client: the one client all its waiting requests come from (None: several, or
    not known).
    """
    others = [u for u in usages if u.model_id != model_id and u.holds_place]
    free_places = max_engines - len(others)
    gpu_short = free_mib is not None and need_mib > free_mib
    ram_short = ram_free_mib is not None and ram_need_mib > ram_free_mib
    if ahead:
        # the models ahead come first; a place beyond what they need may be taken, and
        # RAM beyond theirs (GPU memory may not: where they go is not known here)
        if free_places > ahead and free_mib is None and (
                ram_free_mib is None or ram_need_mib + ahead_ram_mib <= ram_free_mib):
            return Fits()
        return Wait(f"{ahead} model(s) ahead in the line for room")
    if free_places > 0 and not gpu_short and not ram_short:
        return Fits()
    places_short = free_places <= 0
    limit = "engine_limit" if places_short else "gpu_memory" if gpu_short else "ram"
    why = ("max_engines reached" if places_short else
           f"needs {need_mib} MiB of GPU memory, {free_mib} MiB free" if gpu_short else
           f"needs {ram_need_mib} MiB of RAM, {ram_free_mib} MiB free")
    # short of GPU memory, only an engine on the chosen devices frees what is missing;
    # every engine holds RAM
    candidates = [u for u in others if u.on(devices)] if gpu_short and not places_short \
        else others
    victims = sorted((u for u in candidates if u.why_not_evictable() is None),
                     key=lambda u: u.victim_order(grouped))
    if grouped and not overdue:
        # an engine idle for a moment between its clients' requests still has work: only
        # one idle for IDLE_GRACE_S gives way to a model whose turn has not come (or one
        # of a lower class than the waiting model's requests). Nor does one whose only
        # client is the one now waiting while no engine serves anyone: that client's next
        # request is the one waiting (a lone client switching models), and the grace
        # would wait for nobody
        nobody_served = not any(u.in_flight for u in usages)
        settled = [u for u in victims if now - u.last_used >= IDLE_GRACE_S
                   or priority > u.priority
                   or (nobody_served and client is not None and u.sole_client == client)]
        if victims and not settled:
            return Wait(f"{', '.join(repr(u.model_id) for u in victims)} just served: "
                        f"{model_id!r} waits its turn", turn=True)
        victims = settled
    if victims:
        return Evict(victims[0].model_id, f"making room for {model_id}: {why}", why=why)
    if any(u.draining for u in candidates):
        return Wait("an engine is finishing its requests to make room")
    if any(u.state in (EngineState.STOPPING,) for u in candidates):
        return Wait("an engine is stopping")
    drainable = sorted((u for u in candidates if u.why_not_drainable() is None),
                       key=lambda u: u.victim_order(grouped))
    if grouped and drainable:
        # a busy engine keeps its place for its own traffic unless the waiting model
        # outranks it, or has waited its max_wait_s and is of its class or higher
        may_drain = [u for u in drainable
                     if priority > u.priority or (overdue and priority >= u.priority)]
        if not may_drain:
            busy = ", ".join(repr(u.model_id) for u in drainable)
            return Wait(f"{busy} busy: {model_id!r} waits its turn", turn=True)
        drainable = may_drain
    if drainable:
        return Drain(drainable[0].model_id, f"making room for {model_id}: {why}")
    if not candidates and gpu_short and not ram_short:
        # the GPU estimate errs high (llama.cpp may also fit what it can): the engine's
        # own failure says more than a refusal. RAM is not tried: the OOM killer's
        # victim may be any process of the machine
        return TryAnyway()
    holders = tuple((u.model_id, u.why_not_evictable() or "running") for u in others)
    return Blocked(limit, holders)


@dataclass(frozen=True)
class Want:
    """A model in the line for room, as its order sees it."""

    model_id: str
    asked_at: float            # when it joined the line (its first request queued)
    oldest_at: float | None    # when its oldest waiting request queued (None: nobody)
    waiting: int = 0           # requests waiting for it
    priority: int = NORMAL     # the highest class among them, aged (core/priority.aged)
    max_wait_s: float = 20.0
    # grouped: the room an engine gave up goes to the model it was evicted or drained
    # for (room_made: the order in which room was made, first first), and a model whose
    # own engine is draining goes behind: its queue grows while its engine finishes, and
    # by count it would take back the place it just gave up, a swap for nothing
    room_made: int | None = None
    draining: bool = False
    # by when its turn comes at the latest: the earliest of its waiting requests'
    # arrival + core/priority.turn_bound_s (None: nobody waits)
    turn_by: float | None = None
    client: str | None = None   # the one client its waiting requests come from (None: several)

    def overdue(self, now: float) -> bool:
        return self.oldest_at is not None and now - self.oldest_at >= self.max_wait_s


def sole_client(clients: Iterable[str | None]) -> str | None:
    """The one client these requests come from; None where they are several, or one of
    them is not known."""
    seen = set(clients)
    return seen.pop() if len(seen) == 1 else None


def line_order(wants: Iterable[Want], *, grouped: bool, now: float) -> list[Want]:
    """The line for room, head first (the module's docstring says the rule)."""
    if not grouped:
        return sorted(wants, key=lambda w: w.asked_at)

    def key(w: Want) -> tuple[float, ...]:
        oldest = w.oldest_at if w.oldest_at is not None else float("inf")
        # within a class: the room an engine gave up goes to the model it was made for,
        # and a model whose own engine is draining waits behind (see Want)
        made = (w.draining, w.room_made if w.room_made is not None else float("inf"))
        if w.overdue(now):
            return (-w.priority, *made, 0, oldest, w.asked_at)
        return (-w.priority, *made, 1, -w.waiting, oldest, w.asked_at)
    return sorted(wants, key=key)


@dataclass(frozen=True)
class Ledger:
    """GPU memory, accounted for. All MiB.

    held     = Σ measured use of the engines' processes (NVML per process; 0 where unknown)
    pending  = Σ over engines holding a place that are not ready (starting, loading,
               restarting, stopping) of max(0, estimate - measured): memory a load will
               still take, which NVML's free figure does not show yet; a stopping engine
               counts until it is gone (it may have been loading, or hold what it
               loaded: counting it twice errs on the safe side for a moment)
    external = max(0, total - free - held): what other processes hold
    plan_free = max(0, free - pending): what a new engine may count on
    """

    total_mib: int
    free_mib: int
    held_mib: int
    pending_mib: int
    external_mib: int

    @property
    def plan_free_mib(self) -> int:
        return max(0, self.free_mib - self.pending_mib)


def memory_ledger(total_mib: int, free_mib: int, usages: Iterable[Usage]) -> Ledger:
    held = pending = 0
    for u in usages:
        if not u.holds_place:
            continue
        held += u.measured_mib or 0
        pending += still_to_load_mib(u.state, True, u.estimate_mib, u.measured_mib)
    return Ledger(total_mib=total_mib, free_mib=free_mib, held_mib=held, pending_mib=pending,
                  external_mib=max(0, total_mib - free_mib - held))


def idle_expired(usages: Iterable[Usage], now: float) -> list[str]:
    """Engines idle (ready, serving and awaited by nobody) for longer than their idle_ttl."""
    return [u.model_id for u in usages
            if u.idle_ttl_s is not None and u.state is EngineState.READY and not u.in_flight
            and not u.queued and not u.pinned and now - u.last_used >= u.idle_ttl_s]
