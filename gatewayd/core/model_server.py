"""What an endpoint picker reads of a model server (the Gateway API Inference Extension's
"model server protocol", as llm-d's router scrapes it), worked out for a gateway that is
many model servers behind one address.

A picker reads one figure per endpoint, per name: it takes the first series of a family,
so per-model series would be read as one model's. The host figures here are therefore
whole-host sums, and the models a host has warm are told the way vLLM tells its loaded
LoRA adapters (`running_lora_adapters`, `waiting_lora_adapters`, `max_lora`), so that a
picker's adapter-affinity scorer sends each model's requests where its engine runs. The
rendering is adapters/metrics.py's; docs/fleet.md has the mapping.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class KvUse:
    """An engine's KV cache as its /slots shows it: tokens held by the slots serving a
    request, of the context all its slots have."""
    held: int
    size: int

    @property
    def ratio(self) -> float:
        """0 (empty) to 1 (full)."""
        return min(1.0, self.held / self.size) if self.size > 0 else 0.0


def kv_use(slots: object, *, shared: bool = False) -> KvUse | None:
    """llama-server's GET /slots answer (a list of slots) as a KvUse; None where it is not
    one. A slot serving a request holds its `n_prompt_tokens` (prompt and tokens generated
    so far, measured on the build used here); an idle slot's cached prompt is not counted,
    as vLLM does not count its free blocks' cached prefixes: the next request may take it.
    shared: the slots share one KV cache (llama-server's default, -kvu), and each reports
    the whole of it as its n_ctx (measured: -c 2048, four slots of 2048); else each has
    its own part."""
    if not isinstance(slots, list) or not slots:
        return None
    held, sizes = 0, []
    for slot in slots:
        if not isinstance(slot, dict):
            return None
        n_ctx = slot.get("n_ctx")
        if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx < 0:
            return None
        sizes.append(n_ctx)
        tokens = slot.get("n_prompt_tokens")
        if slot.get("is_processing") is True and isinstance(tokens, int) \
                and not isinstance(tokens, bool) and tokens > 0:
            held += min(tokens, n_ctx)
    size = max(sizes) if shared else sum(sizes)
    return KvUse(min(held, size), size)


class KvReadings:
    """Each ready engine's last KV reading: a busy engine answers /slots only between its
    batches, so a scrape during a long prompt gets none in time, and would otherwise read
    the busiest engine as absent (the host as emptier than it is)."""

    def __init__(self) -> None:
        self._last: dict[str, KvUse] = {}

    def read(self, answered: dict[str, KvUse | None]) -> dict[str, KvUse]:
        """answered: per ready engine's model, its reading now, or None (no answer in
        time); each engine's reading, its last one where it gave none now. Engines not
        in answered (stopped) are forgotten."""
        self._last = {m: use if use is not None else self._last[m]
                      for m, use in answered.items()
                      if use is not None or m in self._last}
        return dict(self._last)


def host_kv(uses: Iterable[KvUse]) -> KvUse:
    """The host's KV cache: every engine's held tokens over every engine's context."""
    held = size = 0
    for use in uses:
        held, size = held + use.held, size + use.size
    return KvUse(held, size)


def room_for_one_more(places: int, max_engines: int, needs: Iterable[tuple[int, int]],
                      free_ram: int | None, free_vram: int | None) -> bool:
    """Whether a model not running would load without evicting: a place under max_engines,
    and one of needs (models not running: each one's (RAM, VRAM) need, bytes; the caller
    gives the smallest) fits in what memory is free for planning (None: not known, so not
    a bound)."""
    if places >= max_engines:
        return False
    return any((free_ram is None or ram <= free_ram)
               and (free_vram is None or vram <= free_vram) for ram, vram in needs)


@dataclass(frozen=True)
class Warm:
    """The names a host answers from an engine already running (running), from one on its
    way (waiting), and how many names it could hold (max): one more where another model
    would load without evicting (room_for_one_more), else exactly what it holds, so that a
    picker's "room for one more" (running + waiting < max) is true only then."""
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max: int


def warm(names: Mapping[str, Iterable[str]], ready: Iterable[str], coming: Iterable[str],
         *, room: bool) -> Warm:
    """names: per model id, every name a client may send for its engine (the id, aliases,
    variants, adapters); ready and coming: the models whose engine is ready, and on its way
    (starting, loading, or requests waiting for it); room: room_for_one_more."""
    def of(models: Iterable[str]) -> tuple[str, ...]:
        # a name with a comma would split in the picker's list: such a name is no model's
        return tuple(sorted({n for m in models for n in names.get(m, (m,)) if "," not in n}))
    running = of(ready)
    waiting = tuple(n for n in of(coming) if n not in running)
    held = len(running) + len(waiting)
    return Warm(running, waiting, held + 1 if room else held)
