"""core/model_server: an engine's KV use from llama-server's /slots, the host's, and the
models a host has warm, as an endpoint picker reads them."""

from __future__ import annotations

from typing import Any

import pytest

from gatewayd.core.model_server import (
    KvReadings,
    KvUse,
    host_kv,
    kv_use,
    room_for_one_more,
    warm,
)

# GET /slots of the llama-server built here, one slot generating (12 prompt tokens, 204
# generated so far) and one idle that served a request before (19 tokens still cached)
SLOTS: list[dict[str, Any]] = [
    {"id": 0, "n_ctx": 512, "speculative": False, "is_processing": False, "id_task": 1,
     "n_prompt_tokens": 19, "n_prompt_tokens_processed": 0, "n_prompt_tokens_cache": 0,
     "next_token": [{"has_next_token": False, "n_remain": -1, "n_decoded": 0}]},
    {"id": 1, "n_ctx": 512, "speculative": False, "is_processing": True, "id_task": 12,
     "n_prompt_tokens": 216, "n_prompt_tokens_processed": 1, "n_prompt_tokens_cache": 11,
     "next_token": [{"has_next_token": True, "n_remain": 96, "n_decoded": 204}]},
    {"id": 2, "n_ctx": 512, "speculative": False, "is_processing": False},
]


def test_the_slots_serving_a_request_hold_their_tokens_of_every_slots_context() -> None:
    use = kv_use(SLOTS)
    assert use == KvUse(216, 3 * 512) and use.ratio == 216 / 1536


def test_slots_sharing_one_cache_each_report_all_of_it_and_count_it_once() -> None:
    """llama-server's default (-np auto, -kvu): -c 2048 gives four slots of n_ctx 2048,
    one cache of 2048 (measured on the build here)."""
    shared = [{"n_ctx": 2048, "is_processing": i < 2, "n_prompt_tokens": 1500}
              for i in range(4)]
    assert kv_use(shared, shared=True) == KvUse(2048, 2048)   # 3000 held: capped, full
    assert kv_use(shared, shared=False) == KvUse(3000, 8192)


def test_a_busy_engine_counts_at_its_last_reading_and_a_gone_one_is_forgotten() -> None:
    readings = KvReadings()
    assert readings.read({"a": KvUse(1, 10), "b": None}) == {"a": KvUse(1, 10)}
    assert readings.read({"a": None, "b": KvUse(2, 10)}) == {"a": KvUse(1, 10),
                                                             "b": KvUse(2, 10)}
    assert readings.read({"b": None}) == {"b": KvUse(2, 10)}   # a stopped: forgotten
    assert readings.read({"a": None}) == {}


@pytest.mark.parametrize("places, needs, free_ram, free_vram, room", [
    (1, [(100, 0)], 200, None, True),
    (4, [(100, 0)], 200, None, False),          # every place taken
    (1, [(300, 0)], 200, None, False),          # the model not running needs more RAM
    (1, [(300, 0), (100, 0)], 200, None, True),  # one of them fits
    (1, [(100, 500)], 200, 400, False),         # ... nor the GPU's
    (1, [(100, 500)], None, None, True),        # memory not known: no bound
    (1, [], 200, None, False),                  # every model already held
])
def test_room_for_one_more_is_a_place_and_the_memory_for_a_model_not_running(
        places: int, needs: list[tuple[int, int]], free_ram: int | None,
        free_vram: int | None, room: bool) -> None:
    assert room_for_one_more(places, 4, needs, free_ram, free_vram) is room


@pytest.mark.parametrize("answer", [
    None, {}, [], "[]", [1], [{"id": 0}], [{"n_ctx": "512"}], [{"n_ctx": -1}],
    [{"n_ctx": True}], [{"n_ctx": 512}, None]])
def test_an_answer_that_is_no_list_of_slots_is_no_figure(answer: object) -> None:
    assert kv_use(answer) is None


@pytest.mark.parametrize("tokens", ["9", True, -5, None, 0])
def test_a_token_count_that_is_no_count_holds_nothing(tokens: object) -> None:
    assert kv_use([{"n_ctx": 100, "is_processing": True, "n_prompt_tokens": tokens}]) \
        == KvUse(0, 100)


def test_a_slot_never_holds_more_than_its_context_and_the_ratio_stays_in_0_1() -> None:
    use = kv_use([{"n_ctx": 100, "is_processing": True, "n_prompt_tokens": 10**9}])
    assert use == KvUse(100, 100) and use.ratio == 1.0
    assert KvUse(0, 0).ratio == 0.0 and KvUse(5, 4).ratio == 1.0


def test_the_host_is_every_engines_tokens_over_every_engines_context() -> None:
    assert host_kv([KvUse(100, 1000), KvUse(0, 3000)]) == KvUse(100, 4000)
    assert host_kv([]).ratio == 0.0


NAMES = {"a": ("a", "a.gguf", "coder"), "b": ("b",), "c": ("c", "weird,name")}


def test_warm_names_every_name_of_the_running_and_coming_engines() -> None:
    w = warm(NAMES, ["a", "b"], ["c"], room=True)
    assert w.running == ("a", "a.gguf", "b", "coder")
    assert w.waiting == ("c",)             # a name with a comma would split in the list
    assert w.max == 6                      # room: one more than held


def test_without_room_max_is_what_is_held_so_a_load_scores_as_an_eviction() -> None:
    w = warm(NAMES, ["a"], [], room=False)
    assert w.max == len(w.running) + len(w.waiting) == 3


def test_a_name_running_is_not_also_waiting_and_an_unknown_model_is_its_own_name() -> None:
    w = warm({"a": ("a", "x")}, ["a"], ["a", "z"], room=False)
    assert w.running == ("a", "x") and w.waiting == ("z",)
