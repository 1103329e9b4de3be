"""Break the gateway one rule at a time and check that the tests named for it catch it.

    .venv/bin/python -m tests.mutants              # every mutant (CI runs this)
    .venv/bin/python -m tests.mutants -k drain     # those whose name contains "drain"
    .venv/bin/python -m tests.mutants --list       # the mutants, their tests, and whether
                                                   # their edits still apply
    .venv/bin/python -m tests.mutants --scenarios  # the dispatcher model test's fixed
                                                   # scenarios alone (no random search)

Each mutant is one small textual edit of the gateway, a regression someone could really
write (a fix undone, an allow-list widened, a comparison off by one), and names the tests
that must kill it: a few fast ones of the layer it breaks (no systemd, no container). It
is applied to a copy of the working tree under a temporary directory (never to this
tree; the built native modules go along), and only its tests run there (`pytest -x`),
-j mutants at a time. Alongside, all their tests run once on an unchanged copy (the
baseline): a mutant counts as killed only by a test that passes there. The exit status is
1 if a mutant survives, an edit no longer applies (the list must follow the code), its
tests error or time out, or the baseline fails.

CI runs it after the test suite (.ci/run): the suite says the code does what its tests
say; this says the tests would notice if it stopped doing so.

Left out, because no run can tell them apart from the code (equivalent mutants):
- a stop marking the engine `stopping` only once it holds the model's lifecycle lock
  (not before waiting for it): the lock is held only by a start job or another stop,
  so the engine is never ready (never handed to a request) while a stop waits for it;
- `_forget` not failing leftover waiters: nobody can begin to wait once the stop has
  marked the engine (wait_ready refuses a stopping engine; signals do not move it out).
- a starting engine taking the creation's "inactive" as an exit: the signal guard keeps
  its place until systemd confirms, and the "activating" that follows moves it back to
  starting (a moment of log noise and nothing else).
- the wait after an eviction measuring room without the loads in progress
  ("settle-ignores-loads"): since that wait also ends once the room the loader needs is
  there, ignoring loads can only end it early, and the scheduler's own ledger (net of
  loads) then decides again; at worst it evicts an idle engine it need not have, which no
  invariant of the model forbids (500 examples: survived).
- a client that left mid-stream not closing the engine connection in `_client_left`
  (proxy.py): relay()'s `finally` releases the answer, and a release of an answer not
  read to its end closes the connection anyway (engine_client's and aiohttp's alike), at
  once after; the engine stops generating all the same.
- a local engine's stream not sending its head before the first pushed chunk
  (`writer.send_headers()` in proxy.py): the aiohttp pinned sends a StreamResponse's head
  in prepare() already; the call keeps the hand-framed chunks after the head if that
  changes.
They stay as cheap guards for code that changes around them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_TESTS = "tests/unit/test_dispatcher_model.py"
# built from this tree's C source and ignored by git: without it a copy would park engines
# behind /bin/sh, and the preloaded wait's tests could not run
BUILT = ("gatewayd/_engine_park*.so",)
FAST_TIER = "not systemd and not container"
SUMMARY = re.compile(r"(FAILED|ERROR) tests/\S+")   # pytest's line for a failed test


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str       # the rule the code keeps
    path: str
    old: str
    new: str
    also: tuple[tuple[str, str, str], ...] = ()   # more edits: (path, old, new)
    tests: tuple[str, ...] = (MODEL_TESTS,)      # pytest files or node ids that kill it

    def edits(self) -> list[tuple[str, str, str]]:
        return [(self.path, self.old, self.new), *self.also]


SIGNAL_GUARD_OFF = ("gatewayd/core/engines.py",
                    "                new = replace(new, exit_unconfirmed=True)",
                    "                pass")

# the tests that kill them, by file (node ids: file + "::" + test; a parametrized test
# runs with all its parameters)
D = "tests/unit/test_dispatcher.py::"
FIFO = "tests/unit/test_fifo_scenarios.py"
SCHED = "tests/unit/test_scheduler.py::"
ROUTES = "tests/unit/test_routes.py::"
ADMIN_SOCKET = "tests/http/test_admin_socket.py::"
TRUST = "tests/http/test_trust_boundary.py::"
KEYS = "tests/http/test_api_keys.py::"
FRONT = "tests/http/test_front_door.py::"
UP = "tests/http/test_upstreams.py::"
UPSTREAM_RULES = "tests/unit/test_upstreams.py::"
CLIENT = "tests/unit/test_engine_client.py::"
SSE = "tests/unit/test_sse.py::"
ENDS = "tests/http/test_stream_ends.py::"
RELOAD = "tests/unit/test_reload_plan.py::"
PLACE = "tests/unit/test_placement.py::"
STORAGE = "tests/unit/test_storage_faults.py::"
RETENTION = "tests/unit/test_records_retention.py::"
RAM = "tests/unit/test_ram_budget.py::"

# -- the scheduler, the loader and the engines' lifecycle --------------------------------
SCHEDULING = (
    Mutant("no-lifecycle-lock", "a start and a stop of one model never overlap",
           "gatewayd/service/engine_lifecycle.py",
           "            async with self._lock(model_id):\n"
           "                self._registry.bump(model_id)\n                yield",
           "            if True:\n"
           "                self._registry.bump(model_id)\n                yield"),
    Mutant("await-before-stop", "choosing a victim and stopping it are atomic",
           "gatewayd/service/eviction.py",
           "        log.info(\"evicting %s (%s)\", victim, reason)\n",
           "        log.info(\"evicting %s (%s)\", victim, reason)\n"
           "        await asyncio.sleep(0)\n"),
    Mutant("restarting-frees-place", "an engine that systemd restarts holds its place "
           "(with the signal guard off too: alone, the guard keeps the place until systemd "
           "confirms, and it says 'activating')",
           "gatewayd/core/engines.py",
           "                         EngineState.RESTARTING, EngineState.STOPPING})",
           "                         EngineState.STOPPING})", also=(SIGNAL_GUARD_OFF,)),
    Mutant("signal-frees-place", "a signal alone never frees a place",
           "gatewayd/core/engines.py",
           "                new = replace(new, exit_unconfirmed=True)",
           "                pass"),
    Mutant("already-active-fails", "a unit systemd already runs is adopted, not failed",
           "gatewayd/service/engine_lifecycle.py",
           "            except UnitAlreadyActive:\n",
           "            except UnitAlreadyActive if False else ():\n"),
    Mutant("no-reconciler", "the reconciler brings the views together again",
           "gatewayd/service/restore.py",
           "        self._task = asyncio.get_running_loop().create_task(self._loop())",
           "        self._task = None"),
    Mutant("vanished-load-waits", "whoever waits for an engine hears that it stopped "
           "outside the gateway",
           "gatewayd/service/engine_lifecycle.py",
           "        elif new.state is EngineState.STOPPED:",
           "        elif False:"),
    Mutant("deactivating-listed-as-gone", "a unit found deactivating still holds its place",
           "gatewayd/core/engines.py",
           '    if ev.active_state == "deactivating":\n',
           '    if False:\n'),
    Mutant("admit-ignores-loads", "an operator's start counts loads in progress against "
           "free memory",
           "gatewayd/service/engine_capacity.py",
           "                pending_mib=budget.still_to_load_mib(engine.state, True, need, held),",
           "                pending_mib=0,"),
    Mutant("try-anyway-at-once", "'try anyway' waits while a stopped engine's memory may "
           "still be coming back",
           "gatewayd/service/loader.py",
           "            case scheduler.TryAnyway() if self._evictor.memory_coming_back():",
           "            case scheduler.TryAnyway() if False:"),
    Mutant("settle-waits-for-gone-memory", "an eviction does not wait for memory that "
           "showed as free before its stop, while room is there",
           "gatewayd/service/eviction.py",
           "                        room_for is not None and now >= room_for):",
           "                        False):"),
    Mutant("stopping-holds-no-memory", "a stopping engine's memory counts until it is gone",
           "gatewayd/core/budget.py",
           "    if not holds_place or state is EngineState.READY:",
           "    if not holds_place or state not in (EngineState.STARTING, EngineState.LOADING):"),
    Mutant("failed-is-sticky", "a failed model is tried again by a later request",
           "gatewayd/service/loader.py",
           "            if (left := self._engines.registry.backoff_left(model.id)) > 0:",
           "            if (failed := self._engines.registry.get(model.id)) is not None \\\n"
           "                    and failed.state is EngineState.FAILED:\n"
           "                raise self._engines.registry.failed_error(model.id)\n"
           "            if (left := self._engines.registry.backoff_left(model.id)) > 0:"),
    Mutant("no-drain", "a model waiting under load on the others gets a place (drain)",
           "gatewayd/service/loader.py",
           "                self._drain(victim, model.id, reason, want, usages)",
           "                await self._wait(bounds.room_by, model, reason)"),
    Mutant("no-fifo-line", "models get room in the order they asked",
           "gatewayd/service/loader.py",
           "ahead=len(ahead),",
           "ahead=0,", tests=(FIFO,)),
    Mutant("awaited-engine-drained", "an engine its woken waiters are about to use is not "
           "drained (livelock)",
           "gatewayd/core/scheduler.py",
           "        if self.queued and not self.draining:\n"
           "            # requests woken by its load",
           "        if False:\n            # requests woken by its load"),
    Mutant("silent-place-free", "a place freed without a change of state wakes the loaders",
           "gatewayd/service/dispatcher.py",
           "        if old.state is new.state and old.holds_place == new.holds_place:",
           "        if old.state is new.state:"),
    # -- added with the mutants of every layer
    Mutant("evict-most-recent", "the least recently used engine is evicted",
           "gatewayd/core/scheduler.py",
           "        return (self.priority, self.last_used) if grouped else (self.last_used,)",
           "        return (self.priority, -self.last_used) if grouped else (-self.last_used,)",
           tests=(D + "test_lru_idle_engine_is_evicted_when_places_run_out",)),
    Mutant("evict-busy", "an engine serving a request is never evicted",
           "gatewayd/core/scheduler.py",
           "        if self.in_flight:\n            return f\"serving",
           "        if False:\n            return f\"serving",
           tests=(D + "test_a_busy_engine_is_never_evicted",)),
    Mutant("evict-pinned", "a pinned engine is never evicted",
           "gatewayd/core/scheduler.py",
           "        \"\"\"Why this engine may not be stopped now (None: it may).\"\"\"\n"
           "        if self.pinned:",
           "        \"\"\"Why this engine may not be stopped now (None: it may).\"\"\"\n"
           "        if False:",
           tests=(SCHED + "test_plan_start",)),
    Mutant("drain-pinned", "a pinned engine is never drained",
           "gatewayd/core/scheduler.py",
           "        \"\"\"Why this engine may not be drained to make room (None: it may).\"\"\"\n"
           "        if self.pinned:",
           "        \"\"\"Why this engine may not be drained to make room (None: it may).\"\"\"\n"
           "        if False:",
           tests=(SCHED + "test_plan_start",)),
    Mutant("draining-never-evicted", "a draining engine that serves nobody is evicted, "
           "though requests queue for it",
           "gatewayd/core/scheduler.py",
           "        if self.queued and not self.draining:\n"
           "            return f\"awaited by {self.queued} request(s)\"\n        return None\n\n"
           "    def _state_text",
           "        if self.queued:\n"
           "            return f\"awaited by {self.queued} request(s)\"\n        return None\n\n"
           "    def _state_text",
           tests=(SCHED + "test_plan_start",)),
    Mutant("memory-victim-on-any-device", "short of memory, the victim is on the device "
           "the model goes to",
           "gatewayd/core/scheduler.py",
           "    candidates = [u for u in others if u.on(devices)] "
           "if gpu_short and not places_short \\\n"
           "        else others",
           "    candidates = others",
           tests=(D + "test_eviction_frees_the_device_that_needs_the_memory",)),
    Mutant("ram-not-a-budget", "short of RAM, room is made before a start",
           "gatewayd/core/scheduler.py",
           "    ram_short = ram_free_mib is not None and ram_need_mib > ram_free_mib",
           "    ram_short = False",
           tests=(RAM + "test_a_ram_budget_for_two_evicts_the_least_recently_used_for_the_third",)),
    Mutant("ram-tried-anyway", "RAM short with nothing that may go is never tried anyway",
           "gatewayd/core/scheduler.py",
           "    if not candidates and gpu_short and not ram_short:",
           "    if not candidates and (gpu_short or ram_short):",
           tests=(RAM + "test_short_of_ram_with_nothing_that_may_go_is_blocked_never_"
                  "tried_anyway",)),
    Mutant("mapped-weights-free", "an engine's mapped weights, counted as available by the "
           "kernel, are not free for another model",
           "gatewayd/core/ram_budget.py",
           "                   self.total_mib - self.reserve_mib - self.claimed_mib)",
           "                   self.available_mib)",
           tests=(RAM + "test_an_engines_mapped_weights_counted_as_available_are_still_its_own",
                  )),
    Mutant("oom-restarted", "an OOM-killed engine is not restarted into the same wall",
           "gatewayd/service/engine_capacity.py",
           "            if use.oom_kills > seen:",
           "            if False:",
           tests=(RAM + "test_an_oom_killed_engine_is_failed_not_restarted_and_learns_a_"
                  "higher_need",)),
    Mutant("oom-sigkill-restarted", "an engine SIGKILLed as the machine counts an OOM kill "
           "is not restarted into the same wall (cgroup v1: its cgroup is gone by then)",
           "gatewayd/service/engine_capacity.py",
           "        if signal == SIGKILL and before is not None and now is not None and "
           "now > before:",
           "        if False:",
           tests=(RAM + "test_with_its_cgroup_gone_a_sigkill_is_an_oom_when_the_machine_"
                  "counted_one",)),
    Mutant("epipe-counted-as-sent", "a request written into the end of an engine that just "
           "died reached no process: it waits for the restarted engine",
           "gatewayd/adapters/engine_wire/client.py",
           "                        unsent = e.connect\n",
           "                        unsent = False\n",
           tests=(CLIENT + "test_a_request_written_into_the_end_of_an_engine_that_just_died_"
                  "reached_none",)),
    Mutant("idle-ttl-stops-busy", "the idle reaper never stops an engine serving a request",
           "gatewayd/core/scheduler.py",
           "u.state is EngineState.READY and not u.in_flight\n",
           "u.state is EngineState.READY\n",
           tests=(SCHED + "test_idle_ttl",)),
    Mutant("fifo-counts-those-behind", "only the models ahead in the line come first",
           "gatewayd/service/room_line.py",
           "            if other == model_id:\n                break",
           "            if other == model_id:\n                continue",
           tests=(FIFO,)),
    Mutant("drain-outlives-its-loader", "a drain ends when the model it made room for "
           "no longer wants room",
           "gatewayd/service/room_line.py",
           "            if use.draining_for == model_id:\n"
           "                use.draining_for = None",
           "            if use.draining_for == model_id:\n"
           "                pass",
           tests=(D + "test_pinned_engines_stay_busy_ones_drain_and_the_wait_is_bounded",)),
    Mutant("draining-takes-new-requests", "a draining engine takes no new requests: they "
           "queue behind the model it makes room for",
           "gatewayd/service/dispatcher.py",
           "                    not use.draining or not autoload):",
           "                    True or not autoload):",
           tests=(MODEL_TESTS + "::test_a_model_waiting_under_steady_load_on_the_others_is"
                  "_served",)),
    Mutant("queue-limit-plus-one", "at most queue_limit requests wait for a model",
           "gatewayd/service/turns.py",
           "        if len(use.waiters) >= limit:",
           "        if len(use.waiters) > limit:",
           tests=(D + "test_queue_limit_and_fair_wakeup",)),
    Mutant("concurrency-limit-plus-one", "at most max_concurrency requests per engine",
           "gatewayd/service/turns.py",
           "        if limit is not None and use.in_flight >= limit:",
           "        if limit is not None and use.in_flight > limit:",
           tests=(D + "test_concurrency_limit_is_429_with_retry_after",)),
    Mutant("polls-count-as-use", "a status poll does not make an engine recently used",
           "gatewayd/service/turns.py",
           "        use.serving[priority] += 1\n        if counts_as_use:",
           "        use.serving[priority] += 1\n        if True:",
           tests=(D + "test_polls_do_not_count_as_use",)),
)

# -- the access gate and the route table ---------------------------------------------------
ACCESS = (
    Mutant("model-id-dot-segments", "a model's name in /v1/models/{id} has no dot segments",
           "gatewayd/core/routes.py",
           '''and rest and not {".", ".."} & set(rest.split("/")):''',
           "and rest:",
           tests=(ROUTES + "test_anything_else_is_not_found",)),
    Mutant("slot-number-any-text", "/slots/{n} takes a number only",
           "gatewayd/core/routes.py",
           "rest.isascii() and rest.isdigit() and len(rest) <= 6:",
           "rest.isascii() and rest.isalnum() and len(rest) <= 6:",
           tests=(ROUTES + "test_anything_else_is_not_found",)),
    Mutant("no-head-for-get", "HEAD is answered wherever GET is, and nowhere else",
           "gatewayd/core/routes.py",
           "        verbs.add(\"HEAD\")",
           "        pass",
           tests=(ROUTES + "test_a_method_not_listed_is_405_naming_the_allowed",)),
    Mutant("admin-public-by-default", "the admin API is on the public port only while "
           "[admin] public",
           "gatewayd/http/auth.py",
           "    if admin and not access.admin_public:",
           "    if admin and False:",
           tests=(ADMIN_SOCKET + "test_off_the_public_port_by_default_with_a_clear_answer_and"
                  "_metrics_by_choice",)),
    Mutant("public-metrics-opens-admin", "[admin] public_metrics opens /admin/metrics, "
           "nothing else",
           "gatewayd/http/auth.py",
           "        if access.metrics_public and route.path == METRICS_PATH:",
           "        if access.metrics_public:",
           tests=(ADMIN_SOCKET + "test_off_the_public_port_by_default_with_a_clear_answer_and"
                  "_metrics_by_choice",)),
    Mutant("inference-key-is-admin", "an admin route needs a key with the admin scope",
           "gatewayd/http/auth.py",
           "            ADMIN if admin else INFERENCE)",
           "            INFERENCE)",
           tests=(KEYS + "test_models_and_scopes_are_enforced",)),
    Mutant("encoded-path-passes", "a path only its decoding makes a table path is a 404",
           "gatewayd/http/auth.py",
           "    if raw == request.path or (matched.route.path == MODEL_PATH",
           "    if True or (matched.route.path == MODEL_PATH",
           tests=(TRUST + "test_paths_spelled_to_slip_past_the_table_reach_nothing",)),
    Mutant("admin-socket-serves-inference", "the admin socket serves no inference path",
           "gatewayd/http/auth.py",
           "    if matched.route.access is Caller.INFERENCE:\n        raise web.HTTPNotFound()",
           "    if False:\n        raise web.HTTPNotFound()",
           tests=(ADMIN_SOCKET + "test_the_cli_reaches_the_admin_api_on_the_socket_only",)),
    Mutant("admin-socket-any-peer", "the admin socket serves root, the gateway's user "
           "and the admin group only",
           "gatewayd/http/auth.py",
           "        if not may_administer(peer, access.own_uid, access.admin_gid):",
           "        if False:",
           tests=(ADMIN_SOCKET + "test_a_peer_that_is_not_root_the_gateways_user_or_in_its_group"
                  "_is_refused",)),
    Mutant("any-application-type-is-json", "a JSON route takes JSON only (a form post is "
           "what a page sends without a preflight)",
           "gatewayd/http/auth.py",
           "(kind.startswith(\"application/\")\n"
           "                                           and kind.endswith(\"+json\")):",
           "(kind.startswith(\"application/\")\n"
           "                                           or kind.endswith(\"+json\")):",
           tests=(TRUST + "test_a_json_route_takes_json_only_whatever_a_form_can_send",)),
    Mutant("router-one-handler-for-all", "each request gets the handler its table line "
           "names", "gatewayd/http/router.py",
           "return TableMatch(_parts(matched), self._routes[matched.route], matched, None)",
           "return TableMatch(_parts(matched), next(iter(self._routes.values())), matched, "
           "None)",
           tests=(ROUTES + "test_the_router_hands_each_request_the_handler_its_line_names",)),
    Mutant("config-bound-low-excluded", "a bound takes its low edge (max_engines = 1, a "
           "timeout of 0.5)", "gatewayd/core/config_schema.py",
           "        return (number > self.low if self.above else number >= self.low) \\",
           "        return (number > self.low) \\",
           tests=("tests/unit/test_config_schema.py::test_each_bound_holds_at_its_edges_and_"
                  "refuses_past_them",)),
    Mutant("config-unknown-key-ignored", "a typo in the configuration is an error, never a "
           "key that silently does nothing", "gatewayd/core/config_schema.py",
           "    if unknown:\n        raise ConfigError(",
           "    if False:\n        raise ConfigError(",
           tests=("tests/unit/test_config.py",)),
    Mutant("localhost-anywhere-in-the-name", "only localhost and names under .localhost "
           "are loopback names (x.localhost.attacker.example is the attacker's)",
           "gatewayd/core/origins.py",
           "    if host == \"localhost\" or host.endswith(\".localhost\"):",
           "    if host == \"localhost\" or \".localhost\" in host:",
           tests=(ROUTES + "test_the_host_must_name_this_gateway",)),
    Mutant("origin-port-ignored", "another port of the same host is another origin",
           "gatewayd/core/origins.py",
           "                and authority == host_header.strip().lower():",
           "                and host_name(authority) == host_name(host_header):",
           tests=(ROUTES + "test_an_origin_is_the_gateways_own_or_listed",)),
    Mutant("any-host-on-the-local-address", "a Host must name the address the client "
           "connected to, not any address",
           "gatewayd/core/origins.py",
           "        return host.strip(\"[]\") == local",
           "        return True",
           tests=(ROUTES + "test_the_host_must_name_this_gateway",)),
    Mutant("key-for-any-model", "a key may use only the models it lists",
           "gatewayd/core/auth.py",
           "        return ALL_MODELS in self.models or model_id.casefold() in self.models \\\n"
           "            or not self.models.isdisjoint(names)",
           "        return ALL_MODELS in self.models or model_id.casefold() in self.models \\\n"
           "            or bool(names)",
           tests=(KEYS + "test_models_and_scopes_are_enforced",)),
    Mutant("default-model-not-checked", "a key's model check covers a model the gateway "
           "chose (default_model), not only the one asked for",
           "gatewayd/http/openai_api.py",
           "    if key is not None:\n        check_model(key, model_id, names)",
           "    if False:\n        check_model(key, model_id, names)",
           tests=(KEYS + "test_a_model_the_gateway_chooses_is_checked_against_the_key_too",)),
    Mutant("refused-body-untold", "a body the HTTP parser refuses part-way (a framing "
           "field in its trailers) is answered and its connection closed, not held",
           "gatewayd/http/request_parser.py",
           "                body.set_exception(refusal)",
           "                pass",
           tests=("tests/http/test_fuzz.py::test_a_body_refused_part_way_is_answered_and_its"
                  "_connection_closed",)),
)

# -- forwarding: what crosses the gateway to an engine or an upstream ----------------------
FORWARDING = (
    Mutant("client-credentials-forwarded", "a client's key never reaches an engine or "
           "an upstream",
           "gatewayd/http/proxy.py",
           "REQUEST_HEADERS = frozenset({\"content-type\", \"accept\", \"user-agent\", "
           "\"openai-beta\",",
           "REQUEST_HEADERS = frozenset({\"content-type\", \"accept\", \"user-agent\", "
           "\"openai-beta\", \"authorization\", \"x-api-key\",",
           tests=(KEYS + "test_either_header_style_is_accepted_and_never_forwarded",)),
    Mutant("answer-headers-unfiltered", "an answer reaches the client with the listed "
           "headers only (no engine cookie or CORS header)",
           "gatewayd/http/proxy.py",
           "                       if (name := k.lower()) in ANSWER_HEADERS\n",
           "                       if (name := k.lower()) or name in ANSWER_HEADERS\n",
           tests=(TRUST + "test_the_attack_matrix_every_route_method_and_credential",)),
    Mutant("upstream-gets-no-key", "an upstream is sent its own key, from the gateway",
           "gatewayd/http/openai_api.py",
           "        headers.update(remote.auth_headers())",
           "        pass",
           tests=(UP + "test_a_remote_model_is_listed_routed_with_its_key_and_recorded",)),
    Mutant("upstream-path-loses-its-slash", "/v1/X goes to the upstream's base URL + /X",
           "gatewayd/core/upstreams.py",
           "        return self.url + path_qs[len(REMOTE_PREFIX) - 1:]",
           "        return self.url + path_qs[len(REMOTE_PREFIX):]",
           tests=(UP + "test_a_remote_model_is_listed_routed_with_its_key_and_recorded",)),
    Mutant("upstream-model-name-kept", "an upstream is asked for a model by its own name "
           "for it",
           "gatewayd/http/openai_api.py",
           "            payload[\"model\"] = target.id     # the name the upstream knows it by",
           "            pass",
           tests=(UP + "test_a_remote_model_is_listed_routed_with_its_key_and_recorded",)),
    Mutant("upstream-concurrency-plus-one", "an upstream serves at most max_concurrency "
           "requests at once",
           "gatewayd/adapters/remote_upstreams.py",
           "                    and remote.in_flight >= limit:",
           "                    and remote.in_flight > limit:",
           tests=(UP + "test_max_concurrency_tries_the_next_upstream_then_says_429",)),
    Mutant("upstream-backoff-doubled", "a down upstream is probed again after 1, 2, 4 ... s",
           "gatewayd/core/upstreams.py",
           "FIRST_BACKOFF_S * 2.0 ** (self.failures - 1))",
           "FIRST_BACKOFF_S * 2.0 ** self.failures)",
           tests=(UPSTREAM_RULES + "test_health_backs_off_while_down_and_probes_at_the_interval"
                  "_while_up",)),
    Mutant("upstream-key-in-errors", "an upstream's key never shows in an error's words",
           "gatewayd/core/upstreams.py",
           "            text = text.replace(self.api_key, \"***\")",
           "            pass",
           tests=(UPSTREAM_RULES + "test_an_upstreams_credentials_never_show_in_words_about_it",)),
    Mutant("upstream-redirect-followed", "an upstream's redirect is not followed (the "
           "key would go along)",
           "gatewayd/adapters/remote_client.py",
           "                    method, url, data=body or None, headers=headers, "
           "allow_redirects=False))",
           "                    method, url, data=body or None, headers=headers, "
           "allow_redirects=True))",
           tests=("tests/http/test_upstream_redirects.py",)),
)

# -- the engine wire: framing, keep-alive, connections --------------------------------
WIRE = (
    Mutant("keepalive-no-retry", "a reused connection the engine had closed is tried "
           "once more on a new one",
           "gatewayd/adapters/engine_wire/client.py",
           "                    if reused and e.fresh:\n",
           "                    if False:\n",
           tests=("tests/http/test_keepalive_retry.py",)),
    Mutant("retry-after-bytes", "a request whose answer had begun is never sent again",
           "gatewayd/adapters/engine_wire/connection.py",
           "            elif self._got_bytes:\n",
           "            elif False:\n",
           tests=(CLIENT + "test_a_reused_connection_closed_before_answering_is_retried_once",)),
    Mutant("chunk-size-0x", "a chunk size is plain hex digits (int(x, 16) also takes "
           "a 0x, a sign, underscores)",
           "gatewayd/adapters/engine_wire/framing.py",
           "or digits.strip(HEX_DIGITS):",
           "or digits.strip(HEX_DIGITS + b\"xX\"):",
           tests=("tests/unit/test_engine_framing.py::test_a_chunk_size_that_is_not_plain_hex"
                  "_is_refused_as_framing",)),
    Mutant("content-length-overrun", "bytes past the Content-Length are refused",
           "gatewayd/adapters/engine_wire/framing.py",
           "        if len(data) > self._left:\n",
           "        if False:\n",
           tests=(CLIENT + "test_bytes_past_an_answers_end_break_its_connection",)),
    Mutant("no-content-204", "a 204 has no body (no waiting for one)",
           "gatewayd/adapters/engine_wire/framing.py",
           "NO_BODY_STATUSES = frozenset({204, 304})",
           "NO_BODY_STATUSES = frozenset({304})",
           tests=(CLIENT + "test_a_no_content_answer_ends_at_its_head_on_a_kept_connection",)),
    Mutant("connection-close-ignored", "a connection the engine said it closes is not "
           "reused",
           "gatewayd/adapters/engine_wire/framing.py",
           "    keep_alive = \"close\" not in connection if parts[0] == \"HTTP/1.1\" else \\\n"
           "        \"keep-alive\" in connection",
           "    keep_alive = True",
           tests=(CLIENT + "test_connection_close_and_a_stale_connection_are_not_reused",)),
    Mutant("stale-keepalive-reused", "an idle connection past keepalive_s is not reused",
           "gatewayd/adapters/engine_wire/pool.py",
           "            if conn.open and now - conn.idle_since < self.keepalive_s:",
           "            if conn.open:",
           tests=(CLIENT + "test_connection_close_and_a_stale_connection_are_not_reused",)),
    Mutant("connection-queue-unbounded", "at most queue_limit requests wait for an "
           "engine's connections",
           "gatewayd/adapters/engine_wire/pool.py",
           "        if len(self.waiters) >= queue_limit:",
           "        if False:",
           tests=(CLIENT + "test_the_wait_for_connections_is_bounded_by_the_queue_limit",)),
    Mutant("interim-answer-taken", "a 1xx answer is skipped: the real one follows",
           "gatewayd/adapters/engine_wire/framing.py",
           "            if 100 <= status < 200:\n",
           "            if False:\n",
           tests=(CLIENT + "test_an_answer_until_close_a_1xx_first_and_no_body_answers",)),
    Mutant("bytes-after-answer-ignored", "bytes after a whole answer break the connection",
           "gatewayd/adapters/engine_wire/framing.py",
           "        elif self.state == DONE and data:\n",
           "        elif False:\n",
           tests=(CLIENT + "test_bytes_past_an_answers_end_break_its_connection",)),
)

# -- the stream relays (sse.py, proxy.py) --------------------------------------------------
RELAYS = (
    Mutant("usage-event-not-hidden", "the usage event the gateway asked for is hidden "
           "from a client that did not",
           "gatewayd/http/sse.py",
           "                return not self.drop_usage_event",
           "                return True",
           tests=(SSE + "test_only_the_usage_only_chunk_is_dropped",)),
    Mutant("usage-not-asked", "the gateway asks a stream for its usage on the client's "
           "behalf (the record's token counts)",
           "gatewayd/http/openai_api.py",
           "    if stream and request.path in USAGE_PATHS and payload is not None:",
           "    if False:",
           tests=(FRONT + "test_stream_gets_usage_for_the_record_but_not_for_the_client",)),
    Mutant("framed-usage-passes", "an event naming usage goes through feed (read, and "
           "hidden where asked), never on as it came",
           "gatewayd/http/sse.py",
           "or b'\"usage\"' in data",
           "or False",
           tests=(SSE + "test_framed_events_pass_as_they_are_only_when_feed_would_pass_them"
                  "_unchanged",)),
    Mutant("incomplete-response-is-broken", "a Responses stream that ends incomplete has "
           "ended properly",
           "gatewayd/http/sse.py",
           "b\"event: response.failed\",\n               b\"event: response.incomplete\", ",
           "b\"event: response.failed\",\n               ",
           tests=(SSE + "test_a_responses_stream_ends_with_any_of_its_three_final_events",)),
    Mutant("end-split-across-reads", "an event whose blank line is split over two reads "
           "is passed on when the second comes",
           "gatewayd/http/sse.py",
           "            if b\"\\n\\n\" not in chunk and not (chunk[:1] == b\"\\n\" and "
           "pending[-1][-1:] == b\"\\n\"):",
           "            if b\"\\n\\n\" not in chunk:",
           tests=(SSE.rstrip(":"),)),
    Mutant("cut-stream-looks-whole", "a stream that ends without its final event ends "
           "with an error event",
           "gatewayd/http/proxy.py",
           "            if not sse.ended:\n",
           "            if False:\n",
           tests=(ENDS + "test_a_stream_that_ends_without_its_final_event_ends_with_an_error"
                  "_event",)),
    Mutant("pushed-first-event-untimed", "a local engine's stream records when its first "
           "event went out (ttft_ms), though every event of it is pushed",
           "gatewayd/http/proxy.py",
           "        if record.ttft_ms is None:\n            record.ttft_ms = (time.monotonic() - "
           "t0) * 1000\n        record.bytes_out += size",
           "        record.bytes_out += size",
           tests=(FRONT + "test_a_stream_reaches_the_client_as_whole_chunks_of_whole_events",)),
    Mutant("pushed-bytes-not-counted", "the record counts the bytes of the events pushed",
           "gatewayd/http/proxy.py",
           "            record.ttft_ms = (time.monotonic() - t0) * 1000\n        "
           "record.bytes_out += size",
           "            record.ttft_ms = (time.monotonic() - t0) * 1000",
           tests=(FRONT + "test_a_stream_reaches_the_client_as_whole_chunks_of_whole_events",)),
)

# -- reload planning, GPU placement, call records ----------------------------------------------
PLANNING = (
    Mutant("reload-keeps-changed-engine", "a reload restarts an engine whose unit settings "
           "changed",
           "gatewayd/core/reload.py",
           "        elif before is None or (engine_fingerprint(before, old_config)\n"
           "                                != engine_fingerprint(after, new_config)):",
           "        elif before is None:",
           tests=(RELOAD + "test_only_what_changes_the_engine_restarts_it",)),
    Mutant("fingerprint-without-env", "an engine's environment is part of what a reload "
           "compares",
           "gatewayd/core/engine_units.py",
           "            tuple(sorted(engine_env(model, layout).items())), "
           "tuple(resource_limits(model)),",
           "            tuple(resource_limits(model)),",
           tests=(RELOAD + "test_only_what_changes_the_engine_restarts_it",)),
    Mutant("restart-only-setting-missed", "a reload says which settings need the "
           "gateway's restart",
           "gatewayd/core/reload.py",
           "RESTART_ONLY = (\"listen_host\", \"listen_port\", ",
           "RESTART_ONLY = (",
           tests=(RELOAD + "test_only_what_changes_the_engine_restarts_it",)),
    Mutant("worst-fit", "an engine goes to the smallest device hole that holds it",
           "gatewayd/core/placement.py",
           "        best = min(fitting, key=lambda r: (r.plan_free_mib, r.device.index))",
           "        best = max(fitting, key=lambda r: (r.plan_free_mib, r.device.index))",
           tests=(PLACE + "test_best_fit_is_the_smallest_hole_that_holds_the_model",)),
    Mutant("room-where-most-is-missing", "room is made where the least is missing",
           "gatewayd/core/placement.py",
           "    target = max(rooms_, key=lambda r: (r.plan_free_mib + r.evictable_mib, "
           "-r.device.index))",
           "    target = min(rooms_, key=lambda r: (r.plan_free_mib + r.evictable_mib, "
           "-r.device.index))",
           tests=(PLACE + "test_room_is_made_where_the_least_is_missing",)),
    Mutant("pending-on-every-device", "a load in progress counts on its own devices only",
           "gatewayd/core/placement.py",
           "        on = [u for u in engine.devices if u in pending]",
           "        on: list[str] = []",
           tests=(PLACE + "test_loads_in_progress_count_against_their_device_only",)),
    Mutant("one-device-named", "with one device there is no choice: CUDA_VISIBLE_DEVICES "
           "is not set",
           "gatewayd/core/placement.py",
           "        if self.named or len(self.rooms) < 2:",
           "        if self.named:",
           tests=(PLACE + "test_one_device_is_never_named_to_the_engine",)),
    Mutant("records-pending-lost-at-close", "the records not yet handed over are written "
           "at close",
           "gatewayd/adapters/records.py",
           "        batch, self._pending = self._pending, []\n        if batch:\n"
           "            self._queue.put(batch)\n        self._queue.put(None)",
           "        self._queue.put(None)",
           tests=(STORAGE + "test_records_still_lingering_at_close_are_written_and_the_file"
                  "_reopens",)),
    Mutant("prune-newest-first", "past records.max_mb the oldest records go",
           "gatewayd/adapters/records.py",
           "                    \"ORDER BY ts\", limit=",
           "                    \"ORDER BY ts DESC\", limit=",
           tests=(RETENTION + "test_the_oldest_records_go_when_the_data_is_over_its_size",)),
    Mutant("prune-by-age-inverted", "past records.max_age_days the old records go, "
           "not the new",
           "gatewayd/adapters/records.py",
           "self._delete(\"WHERE ts < ?\",",
           "self._delete(\"WHERE ts > ?\",",
           tests=(RETENTION + "test_records_past_their_age_are_deleted_by_the_writer_thread",)),
    Mutant("records-oldest-first", "records are listed newest first",
           "gatewayd/adapters/records.py",
           "    sql += \" ORDER BY ts DESC, id DESC LIMIT ?\"",
           "    sql += \" ORDER BY ts, id LIMIT ?\"",
           tests=(STORAGE + "test_a_batch_is_written_in_a_few_statements_and_every_field_comes"
                  "_back",)),
    Mutant("migration-version-behind", "a migration runs once: user_version says which ran",
           "gatewayd/adapters/records.py",
           "    for number, statement in enumerate(MIGRATIONS[version:], start=version + 1):",
           "    for number, statement in enumerate(MIGRATIONS[version:], start=version):",
           tests=(STORAGE + "test_records_still_lingering_at_close_are_written_and_the_file"
                  "_reopens",)),
)

# an engine restart is a wait, not an error (issue 41)
RESTART = "tests/unit/test_engine_restart.py::"
STATES = "tests/unit/test_engines_state.py::"
RESTARTS = (
    Mutant("auto-restart-is-a-start", "a process that ended while systemd restarts it is "
           "restarting (holding its place, its waiters waiting), not starting afresh",
           "gatewayd/core/engines.py",
           '    if active == "activating" and sub == "auto-restart":\n        return True',
           '    if active == "activating" and sub == "auto-restart":\n        return False',
           tests=(STATES + "test_crash_and_systemd_restart_is_counted",)),
    Mutant("dead-process-active-is-the-restart", "the killed process's own late 'active' "
           "is not the restarted one (one kill, one restart)",
           "gatewayd/core/engines.py",
           '    if active == "active" and (pid != engine.dead_pid or not pid):',
           '    if active == "active":',
           tests=(STATES + "test_one_kill_is_one_restart_whatever_order_its_signals_come_in",
                  "tests/unit/test_liveness.py")),
    Mutant("systemd-252-failed-is-final", "systemd 252's 'failed' on its way to "
           "auto-restart is a restart, confirmed with systemd",
           "gatewayd/core/engines.py",
           '    return active == "failed" and result not in (None, "success", '
           '"start-limit-hit")',
           "    return False",
           tests=(STATES + "test_systemd_252s_failed_on_the_way_to_auto_restart_is_a_restart"
                  "_it_confirms",)),
    Mutant("restart-job-inactive-is-a-stop", "systemd 252's restart job passes through "
           "inactive: still the restart",
           "gatewayd/core/engines.py",
           '        changes["main_pid"] = 0\n        return _with(engine, changes)\n'
           '    pid = changes.get("main_pid", engine.main_pid)',
           '        return _to(engine, EngineState.STOPPED, ev.now, main_pid=0)\n'
           '    pid = changes.get("main_pid", engine.main_pid)',
           tests=(STATES + "test_systemd_252s_failed_on_the_way_to_auto_restart_is_a_restart"
                  "_it_confirms",)),
    Mutant("restart-fails-waiters", "whoever waits for a restarting engine waits on",
           "gatewayd/service/engine_registry.py",
           "        if engine.state is EngineState.FAILED:\n            raise self.failed_error",
           "        if engine.state in (EngineState.FAILED, EngineState.RESTARTING):\n"
           "            raise self.failed_error",
           tests=(RESTART + "test_requests_during_a_restart_wait_and_are_served_by_the_"
                  "restarted_engine",)),
    Mutant("restart-fails-the-queued", "requests queued for an engine that crashed wait "
           "for systemd's restart of it",
           "gatewayd/service/engine_lifecycle.py",
           "        elif new.state is EngineState.RESTARTING:   # its waiters wait on\n",
           "        elif new.state is EngineState.RESTARTING:   # its waiters wait on\n"
           "            self._registry.fail_waiters(\n"
           "                new.model_id, self._registry.failed_error(new.model_id))\n",
           tests=("tests/unit/test_dispatcher_model.py::test_requests_queued_for_an_engine_"
                  "that_crashes_wait_for_its_restart",)),
    Mutant("restart-start-job-fails", "a start job that failed because systemd restarts "
           "its process is that restart, not a failed start",
           "gatewayd/service/engine_lifecycle.py",
           "                if isinstance(e, GatewayError) and current is not None and "
           "current.restarting:",
           "                if False:",
           tests=(RESTART + "test_a_start_job_that_fails_because_systemd_restarts_its_process"
                  "_is_a_wait",)),
    Mutant("kill-failure-keeps-waiting", "a kill that finds no unit leaves no one waiting "
           "for a restart",
           "gatewayd/service/engine_lifecycle.py",
           "                self._registry.reconcile(model_id, await self.info(engine.unit))",
           "                await self.info(engine.unit)",
           tests=(RESTART + "test_a_kill_that_finds_no_unit_leaves_no_one_waiting_for_a_"
                  "restart",)),
    Mutant("shut-socket-fails-at-once", "a request that met a just-dead engine's shut "
           "socket waits for systemd's restart",
           "gatewayd/service/dispatcher.py",
           "            if last or not refused.reached_no_process or not await "
           "self.coming_back(engine):",
           "            if True:",
           tests=("tests/http/test_engine_restart_http.py",)),
    Mutant("reset-request-replayed", "a request the dying engine's connection took is "
           "never sent to the restarted one",
           "gatewayd/adapters/engine_wire/client.py",
           "                        e.connect = unsent",
           "                        e.connect = True",
           tests=(CLIENT + "test_a_request_sent_on_a_connection_the_dying_engine_reset_is_no_"
                  "connect_error",)),
    Mutant("restart-counted-as-failed-start", "restarts are counted as restarts",
           "gatewayd/adapters/metrics.py",
           '            self.restarts.inc((model, failure.kind if failure else "other"))',
           '            self.starts.inc((model, "failed"))',
           tests=(RESTART + "test_a_restart_is_counted_as_a_restart_not_a_failed_start",)),
    Mutant("log-tail-read-once", "a failure's log tail is read again after journald "
           "caught up",
           "gatewayd/service/failure_logs.py",
           "        for at in (0.0,) * now + LOG_REREAD_S:",
           "        for at in (0.0,) * now:",
           tests=("tests/unit/test_engine_manager.py::test_the_failure_gets_the_journal_lines_"
                  "written_after_the_exit",)),
)

# the gateway's stop, on aiohttp's public API (issue 35): it must still drain
DRAIN = "tests/http/test_drain.py::"
STOP = (
    Mutant("drain-sees-no-request", "a request in flight at the stop is answered in full",
           "gatewayd/http/drain.py",
           "        task = asyncio.current_task()\n        if task is not None:",
           "        task = None\n        if task is not None:",
           tests=(DRAIN + "test_requests_in_flight_finish_and_those_past_the_drain_time_"
                  "say_so",)),
    Mutant("drain-no-grace-for-fresh", "a connection accepted just before the stop has its "
           "request served",
           "gatewayd/http/drain.py",
           "    deadline = loop.time() + FRESH_CONNECTION_GRACE_S\n",
           "    deadline = loop.time()\n",
           tests=(DRAIN + "test_a_connection_accepted_just_before_the_stop_has_its_request_"
                  "served",)),
    Mutant("drain-cut-by-aiohttp", "a request past the drain time answers shutting_down on "
           "its open connection (aiohttp would cancel it after closing the transport)",
           "gatewayd/http/drain.py",
           "        cancel_open_requests(app)\n",
           "",
           tests=(DRAIN + "test_requests_in_flight_finish_and_those_past_the_drain_time_"
                  "say_so",)),
    Mutant("drain-shuts-the-socket", "the listening socket stays systemd's: the next process "
           "accepts what this one did not",
           "gatewayd/adapters/listener.py",
           "        for sock in self._sockets:\n            sock.close()",
           "        for sock in self._sockets:\n            sock.shutdown(socket.SHUT_RDWR)\n"
           "            sock.close()",
           tests=(DRAIN + "test_the_stop_resets_no_connection_and_leaves_the_rest_to_the_"
                  "next_process",)),
)

OPENAI = "tests/unit/test_openai_backend.py::"
ANY_ENGINE = (
    Mutant("openai-socket-server-on-tcp", "an openai server told {socket} gets no network "
           "(a TCP one's loopback only inside its own namespace)",
           "gatewayd/core/engine_units.py",
           "    families = [\"AF_UNIX\", \"AF_INET\"] if tcp else [\"AF_UNIX\"]",
           "    families = [\"AF_UNIX\", \"AF_INET\"]",
           tests=(OPENAI + "test_a_unix_socket_server_gets_no_network_at_all",)),
    Mutant("openai-unknown-placeholder", "a placeholder the gateway does not know is refused, "
           "not passed to the server as text",
           "gatewayd/core/config.py",
           "        if name is None or name not in PLACEHOLDERS:",
           "        if name is None:",
           tests=(OPENAI + "test_a_hostile_or_mistaken_command_is_refused_naming_the_key",)),
    Mutant("openai-listens-nowhere", "an openai command must say where its server listens",
           "gatewayd/core/config.py",
           "    if len(listens) != 1:",
           "    if len(listens) > 1:",
           tests=(OPENAI + "test_a_hostile_or_mistaken_command_is_refused_naming_the_key",)),
    Mutant("llama-kind-contradicted", "a llama model's kind that its --embeddings/--rerank "
           "contradicts is refused, not started as an engine that refuses its every request",
           "gatewayd/core/config.py",
           "    if kinds[0] is ModelKind.CHAT or (",
           "    if False and (",
           tests=(OPENAI + "test_a_llama_kind_its_flags_contradict_is_refused",)),
    Mutant("openai-ready-by-health", "an openai server is ready by its own ready_path",
           "gatewayd/core/catalog.py",
           "        if self.backend is Backend.OPENAI:\n            return self.config.ready_path",
           "        if False:\n            return self.config.ready_path",
           tests=(OPENAI + "test_an_openai_server_is_ready_when_its_own_path_says_so",)),
    Mutant("gpu-held-by-main-pid-only", "the GPU memory of a unit's other processes (a TCP "
           "engine's server, vLLM's workers) is learned too",
           "gatewayd/service/engine_capacity.py",
           "        if not pids:\n",
           "        if True:\n",
           tests=("tests/unit/test_engine_manager.py::test_gpu_memory_held_by_the_units_other_"
                  "processes_is_learned_too",)),
)

PULLS_T = "tests/unit/test_pulls.py::"
PULL_API_T = "tests/http/test_pull_api.py::"
PULLS = (
    Mutant("pull-unverified", "a pulled file is checked against the hub's hash before it "
           "lands", "gatewayd/service/pulls.py",
           "            await _in_daemon_thread(_verify, part, file)\n",
           "            pass\n",
           tests=(PULLS_T + "test_a_corrupt_file_is_refused_and_nothing_is_left",)),
    Mutant("pull-restarts-at-zero", "a pull resumes at the bytes it has",
           "gatewayd/service/pulls.py",
           "            have = out.tell()\n",
           "            have = out.truncate(0)\n",
           tests=(PULLS_T + "test_a_pull_the_gateway_stopped_resumes_at_its_bytes",)),
    Mutant("pull-full-disk-keeps-bytes", "a disk that filled gets the pull's partial bytes "
           "back", "gatewayd/service/pulls.py",
           "            full = e.errno in (errno.ENOSPC, errno.EDQUOT)\n"
           "            keep_partial = False\n",
           "            full = e.errno in (errno.ENOSPC, errno.EDQUOT)\n"
           "            keep_partial = True\n",
           tests=(PULLS_T + "test_a_disk_that_fills_mid_download_leaves_nothing_and_says_so",)),
    Mutant("pull-quant-unbounded", "Q4_K is not Q4_K_M, Q4_XS is not IQ4_XS",
           "gatewayd/core/pull.py",
           '    return re.search(rf"(?<![a-z0-9_]){re.escape(quant.casefold())}(?![a-z0-9_])",',
           '    return re.search(rf"{re.escape(quant.casefold())}",',
           tests=("tests/unit/test_pull_core.py::test_the_quant_picks_its_file_and_not_a_"
                  "longer_or_i_quant",)),
    Mutant("pull-name-escapes", "a model's name is one folder in models_dir",
           "gatewayd/core/pull.py",
           '    if not is_part(name) or _NAME_UNSAFE.search(name) or len(name) > MAX_NAME:',
           '    if not name or len(name) > MAX_NAME:',
           tests=("tests/unit/test_pull_core.py::test_names_are_one_safe_folder",)),
    Mutant("rm-configured-model", "rm leaves a configured model to the configuration",
           "gatewayd/service/model_removal.py",
           "    if any(m.name == model.id for m in config.models):",
           "    if False:",
           tests=(PULL_API_T + "test_rm_leaves_a_configured_model_to_the_configuration",)),
    Mutant("rm-running-model", "rm refuses a running engine's model without --force",
           "gatewayd/service/model_removal.py",
           "    if (running or model.config.pin) and not force:",
           "    if model.config.pin and not force:",
           tests=(PULL_API_T + "test_rm_refuses_a_running_model_unless_forced",)),
)

# the console's figures and feeds (issue 40): what the charts, the timeline and the live
# logs are made of
SERIES_T = "tests/unit/test_series.py::"
EVENTS_T = "tests/unit/test_event_history.py::"
LOGS_T = "tests/http/test_events_and_logs.py::"
CONSOLE = (
    Mutant("series-503-not-rejected", "a 503 (no room, downloading) is a rejection, not "
           "an error", "gatewayd/core/series.py",
           "REJECTED_STATUSES: tuple[int, ...] = (429, 503)",
           "REJECTED_STATUSES: tuple[int, ...] = (429,)",
           tests=(SERIES_T + "test_rejected_and_errors_are_apart",)),
    Mutant("series-bound-in-next-bin", "a latency exactly on a bound is in that bound's bin",
           "gatewayd/adapters/record_series.py",
           'return (f"CASE WHEN {column} <= {LATENCY_BOUNDS_MS[mid]} THEN',
           'return (f"CASE WHEN {column} < {LATENCY_BOUNDS_MS[mid]} THEN',
           tests=(SERIES_T + "test_calls_land_in_their_bucket_and_bin",)),
    Mutant("events-keep-queue-depths", "queue depths are live only: they would push the "
           "evictions out of the kept window", "gatewayd/adapters/events.py",
           '    if kind == "queue":\n        return False\n',
           '    if kind == "queue":\n        return True\n',
           tests=(EVENTS_T + "test_queue_depths_and_pull_progress_go_to_followers_but_are_"
                  "not_kept",)),
    Mutant("eviction-forgets-for-whom", "an eviction's events name the model it made room "
           "for", "gatewayd/service/engine_lifecycle.py",
           "            self.evicted_for[model_id] = evicted_for\n",
           "            self.evicted_for.pop(model_id, None)\n",
           tests=(LOGS_T + "test_the_history_says_who_was_evicted_for_whom_and_how_long_"
                  "loads_took",)),
    Mutant("console-quantile-off-a-bin", "the page's percentile interpolates inside the "
           "bin that holds the rank", "gatewayd/http/console_core.js",
           "        const lower = i === 0 ? 0 : bounds[i - 1];\n",
           "        const lower = i === 0 ? 0 : bounds[i];\n",
           tests=("tests/test_console_js.py::test_the_pages_computations",)),
    Mutant("console-average-of-models", "the overall figures add every model's histograms",
           "gatewayd/http/console_core.js",
           "      if (model !== undefined && row.model !== model) continue;\n",
           "      if (row.model !== model) continue;\n",
           tests=("tests/test_console_js.py::test_the_pages_computations",)),
    Mutant("log-follows-unbounded", "at most MAX_FOLLOWS journalctl processes at once",
           "gatewayd/adapters/journal.py",
           "        if self.following >= self.limit:\n",
           "        if self.following > self.limit:\n",
           tests=(LOGS_T + "test_at_most_eight_follows_and_the_ninth_is_refused",)),
)

# issue 50's hardening: each finding's class, undone
SAFE_T = "tests/unit/test_safe_paths.py::"
TRUST_T = "tests/http/test_trust_boundary.py::"
PARAMS_T = "tests/http/test_admin_params_fuzz.py::"
HARDENING = (
    Mutant("safe-part-takes-dots", "a path part never starts with a dot ('.', '..', a "
           "hidden file)", "gatewayd/core/safe_paths.py",
           '_PART = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]{0,254}")',
           '_PART = re.compile(r"[A-Za-z0-9_.+-][A-Za-z0-9_.+-]{0,254}")',
           tests=(SAFE_T + "test_a_part_is_one_component_below_its_root_or_refused",)),
    Mutant("rm-joins-the-name", "rm of a name that is not a model touches only that "
           "pull's own record (issue 50: '../../x' removed files outside models_dir)",
           "gatewayd/service/pulls.py",
           "        if models_dir is None or name in self._active or not is_part(name):\n",
           "        if models_dir is None or name in self._active:\n",
           also=(("gatewayd/service/pull_folder.py",
                  '        return inside(self._pulls, f"{name}.json", what="a pull\'s name")',
                  '        return self._pulls / f"{name}.json"'),
                 ("gatewayd/service/pull_folder.py",
                  "        if not is_part(name):\n            return",
                  "        if False:\n            return"),
                 ("gatewayd/service/pull_folder.py",
                  '        shutil.rmtree(inside(self._pulls, name, what="a pull\'s name"), '
                  'ignore_errors=True)',
                  "        shutil.rmtree(self._pulls / name, ignore_errors=True)")),
           tests=(SAFE_T + "test_removing_an_unfinished_pull_by_any_name_touches_nothing_"
                  "outside",)),
    Mutant("hub-listing-unchecked", "a hub's file paths and hashes are checked before they "
           "name files", "gatewayd/core/pull.py",
           '        relative_parts(self.path, what="the hub\'s file path")\n'
           '        for key in ("sha256", "git_sha1"):',
           '        for key in ():',
           tests=(PULLS_T + "test_a_hostile_hub_cannot_choose_a_path",)),
    Mutant("fetch-site-unchecked", "another site's page gets nothing without an allowed "
           "Origin", "gatewayd/http/auth.py",
           "    _check_fetch_site(request, matched)\n", "",
           tests=(TRUST_T + "test_a_request_from_another_sites_page_needs_an_allowed_origin",)),
    Mutant("console-framable", "no site may frame the console",
           "gatewayd/http/admin_api.py",
           '"base-uri \'none\'; form-action \'none\'; frame-ancestors \'none\'")',
           '"base-uri \'none\'; form-action \'none\'")',
           tests=(TRUST_T + "test_the_console_is_served_with_a_policy_that_runs_only_its_"
                  "own_scripts",)),
    Mutant("query-int-unbounded", "an admin parameter's number is bounded before SQLite "
           "sees it", "gatewayd/core/query.py",
           "                not self.low <= (value := int(raw)) <= self.high:",
           "                (value := int(raw)) is None:",
           tests=(PARAMS_T + "test_any_query_on_an_admin_route_is_answered_below_500",)),
    Mutant("listener-small-backlog", "a burst of connections is queued, not dropped",
           "gatewayd/adapters/listener.py",
           "BACKLOG = socket.SOMAXCONN\n", "BACKLOG = 128\n",
           tests=("tests/unit/test_listener_backlog.py",)),
)

# issue 51's order for room (grouped): each rule undone
MODEL_T = "tests/unit/test_dispatcher_model.py::"
PRIORITY_T = "tests/unit/test_priority.py"
GROUPED = (
    Mutant("grouped-line-wait-keeps-the-deadline", "a lower class waiting behind models "
           "ahead in the line is served once aged, not refused when the wait for room runs "
           "out", "gatewayd/service/loader.py",
           "            case scheduler.Wait(why) if ahead and self.grouped and want.turn_by "
           "is not None \\\n",
           "            case scheduler.Wait(why) if False and want.turn_by is not None \\\n",
           tests=(MODEL_T + "test_grouped_a_lower_class_behind_models_ahead_waits_to_be_aged_"
                  "not_refused",)),
    Mutant("grouped-turn-keeps-the-deadline", "a lower class waiting to be aged is served, "
           "not refused when the wait for room runs out",
           "gatewayd/service/loader.py",
           "                bounds.room_by = max(bounds.room_by, self._clock() + "
           "self._config.eviction_wait_s)\n"
           "                await self._wait(want.turn_by",
           "                await self._wait(want.turn_by",
           tests=(MODEL_T + "test_grouped_a_lower_class_waits_to_be_aged_not_refused",)),
    Mutant("grouped-drains-at-once", "a busy engine keeps its place for its own traffic "
           "while the waiting model's turn has not come", "gatewayd/core/scheduler.py",
           "    if grouped and drainable:\n", "    if False:\n",
           tests=(MODEL_T + "test_grouped_a_busy_engine_keeps_its_place_until_the_waiting_"
                  "models_turn",)),
    Mutant("grouped-bound-ignored", "an overdue model drains a busy engine of its class",
           "gatewayd/core/scheduler.py",
           "                     if priority > u.priority or (overdue and priority >= "
           "u.priority)]",
           "                     if priority > u.priority]",
           tests=(MODEL_T + "test_grouped_a_busy_engine_keeps_its_place_until_the_waiting_"
                  "models_turn",)),
    Mutant("grouped-class-ignored-in-drain", "a higher class drains a busy engine at once",
           "gatewayd/core/scheduler.py",
           "                     if priority > u.priority or (overdue and priority >= "
           "u.priority)]",
           "                     if overdue and priority >= u.priority]",
           tests=(MODEL_T + "test_grouped_a_higher_class_does_not_wait_its_turn",)),
    Mutant("grouped-class-ignored-in-line", "a higher class goes first in the line",
           "gatewayd/core/scheduler.py",
           "        return (-w.priority, *made, 1, -w.waiting, oldest, w.asked_at)",
           "        return (0, *made, 1, -w.waiting, oldest, w.asked_at)",
           also=(("gatewayd/core/scheduler.py",
                  "            return (-w.priority, *made, 0, oldest, w.asked_at)",
                  "            return (0, *made, 0, oldest, w.asked_at)"),),
           tests=(MODEL_T + "test_grouped_the_model_with_more_waiting_goes_first_then_"
                  "classes_first",)),
    Mutant("grouped-overdue-not-first", "an overdue model goes before one with more waiting",
           "gatewayd/core/scheduler.py",
           "        if w.overdue(now):\n            return (-w.priority, *made, 0, oldest, "
           "w.asked_at)\n",
           "",
           tests=(MODEL_T + "test_grouped_an_overdue_model_goes_before_one_with_more_"
                  "waiting",)),
    Mutant("grouped-count-ignored", "the model with more requests waiting goes first",
           "gatewayd/core/scheduler.py",
           "        return (-w.priority, *made, 1, -w.waiting, oldest, w.asked_at)",
           "        return (-w.priority, *made, 1, 0, oldest, w.asked_at)",
           tests=(MODEL_T + "test_grouped_the_model_with_more_waiting_goes_first_then_"
                  "classes_first",)),
    Mutant("grouped-no-idle-grace", "an engine idle for a moment between its clients' "
           "requests keeps its place until the waiting model's turn",
           "gatewayd/core/scheduler.py", "IDLE_GRACE_S = 1.0\n", "IDLE_GRACE_S = 0.0\n",
           tests=(MODEL_T + "test_grouped_an_engine_idle_between_its_clients_requests_keeps_"
                  "its_place",)),
    Mutant("grouped-grace-holds-a-lone-client", "a lone client switching models is not "
           "held by the grace (nobody else is there to come back)",
           "gatewayd/core/scheduler.py",
           "                   or (nobody_served and client is not None"
           " and u.sole_client == client)]",
           "                   or False]",
           tests=(MODEL_T + "test_grouped_a_lone_client_switching_models_is_not_held_by_the_"
                  "grace", "tests/unit/test_scheduler.py")),
    Mutant("grouped-grace-ignores-the-client", "the grace is skipped only for the engine's "
           "own client, not for another's request in its gap",
           "gatewayd/core/scheduler.py",
           "                   or (nobody_served and client is not None"
           " and u.sole_client == client)]",
           "                   or nobody_served]",
           tests=(MODEL_T + "test_grouped_an_engine_idle_between_its_clients_requests_keeps_"
                  "its_place", "tests/unit/test_scheduler.py")),
    Mutant("turns-sole-client-never-several", "two clients of one engine are several, not "
           "the last one", "gatewayd/service/turns.py",
           "                use.sole_client = sole_client((use.sole_client, client)) if recent \\\n"
           "                    else client",
           "                use.sole_client = client",
           tests=("tests/unit/test_turns.py",)),
    Mutant("priority-raised-by-client", "a client may lower its class, never raise it",
           "gatewayd/core/priority.py", "    return min(granted, wanted)",
           "    return wanted", tests=(PRIORITY_T,)),
    Mutant("priority-never-ages", "a waiting low class is lifted: never starved for good",
           "gatewayd/core/priority.py",
           "    return min(HIGH, klass + int(waited_s // aging_s))", "    return klass",
           tests=(PRIORITY_T,)),
)

# issue 52: errors say whose they are (gateway, engine, upstream)
WHOSE = "tests/http/test_error_source.py::"
ERROR_SOURCES = (
    Mutant("relayed-error-said-as-the-gateways", "an engine's error answer is relayed "
           "saying it is the engine's, not taken for the gateway's own",
           "gatewayd/http/proxy.py",
           "            headers[ERROR_SOURCE_HEADER] = out.source.value",
           "            pass  # headers[ERROR_SOURCE_HEADER] = out.source.value",
           tests=(WHOSE + "test_an_engines_error_is_relayed_as_it_said_it_and_says_engine",)),
    Mutant("engine-sets-the-error-source", "an engine cannot set the gateway's own "
           "LLM-Gateway-Error-Source (the answer-header allow-list leaves it out)",
           "gatewayd/http/proxy.py",
           "ANSWER_HEADERS = frozenset({\"content-type\", ",
           "ANSWER_HEADERS = frozenset({\"llm-gateway-error-source\", \"content-type\", ",
           tests=(WHOSE + "test_an_engine_cannot_say_its_answer_is_the_gateways",)),
    Mutant("gateway-error-record-without-source", "the record of a call the gateway "
           "refused says the error was the gateway's",
           "gatewayd/http/openai_api.py",
           "        record.error_source = ErrorSource.GATEWAY.value   # (the middleware "
           "answers it)",
           "        pass",
           tests=(WHOSE + "test_the_gateways_own_errors_say_so_in_header_and_body",)),
)

BATCHES_T = "tests/unit/test_batches.py::"
BATCH_API_T = "tests/http/test_batches_api.py::"
BATCHES = (
    Mutant("batch-lines-at-the-users-class", "a batch line is served at the lowest class, "
           "below every interactive request", "gatewayd/service/batch_lines.py",
           "                    autoload=quiet, priority=LOW, client=f\"batch:{batch.id}\")",
           "                    autoload=quiet, priority=NORMAL, client=f\"batch:{batch.id}\")",
           also=(("gatewayd/service/batch_lines.py", "from gatewayd.core.priority import LOW\n",
                  "from gatewayd.core.priority import LOW, NORMAL\n"),),
           tests=(BATCHES_T + "test_every_line_is_answered_once_in_order_at_the_lowest_"
                  "priority",)),
    Mutant("batch-busy-engine-filled", "until the gateway is quiet a batch has one line per "
           "ready engine, and loads nothing", "gatewayd/service/batch_lines.py",
           "    return ready and in_flight < 1 and others == 0 and model_quiet_s >= USER_GAP_S",
           "    return in_flight < concurrency",
           tests=(BATCHES_T + "test_may_send_keeps_a_batch_to_one_line_per_ready_engine_"
                  "until_quiet", BATCHES_T + "test_while_interactive_traffic_came_lately_a_"
                  "line_waits_for_a_ready_engine")),
    Mutant("batch-line-beside-users", "until the gateway is quiet a batch line goes only in "
           "a gap of its engine's users", "gatewayd/service/batch_lines.py",
           "    return ready and in_flight < 1 and others == 0 and model_quiet_s >= USER_GAP_S",
           "    return ready and in_flight < 1 and model_quiet_s >= USER_GAP_S",
           tests=(BATCHES_T + "test_may_send_keeps_a_batch_to_one_line_per_ready_engine_"
                  "until_quiet", BATCHES_T + "test_a_line_waits_for_a_gap_in_its_engine_s_"
                  "users")),
    Mutant("batch-line-in-a-moment-s-gap", "a gap of a moment in a model's users (one "
           "between two requests) lets no batch line in", "gatewayd/service/batch_lines.py",
           "    return ready and in_flight < 1 and others == 0 and model_quiet_s >= USER_GAP_S",
           "    return ready and in_flight < 1 and others == 0",
           tests=(BATCHES_T + "test_may_send_keeps_a_batch_to_one_line_per_ready_engine_"
                  "until_quiet",)),
    Mutant("batch-sent-lines-lost-at-a-crash", "a line on its way at a crash is sent again "
           "by the next run", "gatewayd/adapters/batch_store.py",
           "            db.execute(\"UPDATE lines SET state = ? WHERE batch_id = ? AND state = ? "
           "AND \"\n                       \"attempts < ?\", (PENDING, batch_id, SENT, "
           "ATTEMPTS))",
           "            pass",
           tests=(BATCHES_T + "test_a_line_on_its_way_at_a_crash_is_sent_again_once",)),
    Mutant("batch-resent-for-ever", "a line sent twice by runs that died is not sent a "
           "third time", "gatewayd/adapters/batch_store.py",
           "                               (batch_id, SENT, ATTEMPTS)).fetchall()",
           "                               (batch_id, SENT, 99)).fetchall()",
           also=(("gatewayd/adapters/batch_store.py",
                  "\"attempts < ?\", (PENDING, batch_id, SENT, ATTEMPTS))",
                  "\"attempts < ?\", (PENDING, batch_id, SENT, 99))"),),
           tests=(BATCHES_T + "test_a_line_sent_twice_when_the_gateway_stopped_is_failed_"
                  "not_sent_again",)),
    Mutant("batch-no-turn-is-a-failure", "a line that got no turn is tried again, not "
           "failed", "gatewayd/service/batch_lines.py",
           "            except NOT_NOW as e:", "            except ValueError as e:",
           tests=(BATCHES_T + "test_a_line_that_gets_no_turn_is_tried_again_not_failed",)),
    Mutant("batch-never-expires", "a batch whose window ran out ends expired, its "
           "unanswered lines in its error file", "gatewayd/service/batches.py",
           "            await self._finish(batch_id, running.stop or COMPLETED, errors)",
           "            await self._finish(batch_id, COMPLETED, errors)",
           tests=(BATCHES_T + "test_a_batch_expires_when_its_window_runs_out",)),
    Mutant("batch-cancel-cuts-its-end", "a cancel while a batch writes its files is "
           "refused, not cutting the writing off", "gatewayd/service/batches.py",
           "            if batch.status == FINALIZING or (running is not None and "
           "running.finishing):",
           "            if batch.status == FINALIZING:",
           tests=(BATCHES_T + "test_a_cancel_while_its_files_are_written_is_refused_and_the_"
                  "batch_ends", BATCHES_T + "test_a_cancel_while_an_expired_batch_writes_"
                  "its_files_is_refused")),
    Mutant("batch-unwritable-end-stuck", "a batch whose files cannot be written ends "
           "failed", "gatewayd/service/batches.py",
           "        except Exception as e:    # a full disk while writing its files",
           "        except ValueError as e:    # a full disk while writing its files",
           tests=(BATCHES_T + "test_a_batch_whose_files_cannot_be_written_ends_failed_not_"
                  "stuck",)),
    Mutant("batch-ended-line-marked-sent", "a line no longer pending is not marked sent",
           "gatewayd/adapters/batch_store.py",
           "                              (SENT, batch_id, number, PENDING)).rowcount == 1",
           "                              (SENT, batch_id, number, SENT)).rowcount < 2",
           tests=(BATCHES_T + "test_a_line_that_is_no_longer_pending_is_not_marked_sent",)),
    Mutant("batch-files-shared", "a key sees only its own files",
           "gatewayd/http/batches_api.py",
           "    return None if key is None or ADMIN in key.scopes else key.name",
           "    return None",
           tests=(BATCH_API_T + "test_a_key_sees_only_its_own_files_and_batches",)),
    Mutant("batch-key-any-part", "a file or batch id is one id-like part of the path",
           "gatewayd/core/routes.py", '_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")',
           '_KEY = re.compile(r".{1,64}")',
           tests=(BATCH_API_T + "test_hostile_reads_get_clear_errors",)),
    Mutant("batch-metrics-count-every-call", "the batch lines' figures count batch lines "
           "only", "gatewayd/adapters/metrics.py", "        if record.batch is not None:",
           "        if True:",
           tests=(BATCH_API_T + "test_the_metrics_count_batch_lines_waiting_ended_and_their_"
                  "tokens",)),
    Mutant("batch-bad-lines-kept", "a file with a bad line is refused whole",
           "gatewayd/core/batch.py", "    if problems:\n        shown",
           "    if False:\n        shown",
           tests=("tests/unit/test_batch_core.py", BATCH_API_T + "test_a_bad_file_is_"
                  "refused_line_by_line_and_nothing_is_kept")),
)

VARIANTS_T = "tests/unit/test_variants.py::"
FLEET_T = "tests/http/test_fleet_haproxy.py::"
MODEL_SERVER_T = "tests/http/test_model_server_metrics.py::"
VARIANTS_HTTP_T = "tests/http/test_variants_http.py::"
VARIANTS = (
    Mutant("variant-default-overrides-client", "a variant's default fills only what the "
           "client left out", "gatewayd/core/variants.py",
           "        payload[name] = _merged(value, payload[name]) if name in payload \\\n"
           "            else copy.deepcopy(value)",
           "        payload[name] = copy.deepcopy(value)",
           tests=(VARIANTS_T + "test_a_default_fills_only_what_the_client_left_out",
                  VARIANTS_HTTP_T + "test_the_clients_values_win_over_defaults_never_over_"
                  "the_limit")),
    Mutant("variant-default-table-replaced", "a default table is merged key by key with "
           "the client's", "gatewayd/core/variants.py",
           "    if isinstance(default, dict) and isinstance(given, dict):",
           "    if False:",
           tests=(VARIANTS_T + "test_a_default_table_is_merged_key_by_key_with_the_clients",)),
    Mutant("variant-limit-not-held", "a variant's limit lowers any larger length",
           "gatewayd/core/variants.py", "        if value < 0 or value > limit:",
           "        if value < 0:",
           tests=(VARIANTS_T + "test_a_limit_holds_whatever_the_client_asks",
                  VARIANTS_HTTP_T + "test_the_clients_values_win_over_defaults_never_over_"
                  "the_limit")),
    Mutant("variant-limit-misses-n-predict", "the limit lowers every length field "
           "llama-server reads, n_predict first",
           "gatewayd/core/variants.py",
           'LENGTH_FIELDS = ("n_predict", "max_tokens",',
           'LENGTH_FIELDS = ("max_tokens",',
           tests=(VARIANTS_T + "test_a_limit_holds_whatever_the_client_asks",)),
    Mutant("adapter-sent-without-lora", "a request for an adapter carries the engine's "
           "lora list", "gatewayd/http/openai_api.py",
           "    if call.inference and request.path in INFERENCE_PATHS and with_adapters(",
           "    if call.inference and call.adapter is None and request.path in INFERENCE_PATHS "
           "and with_adapters(",
           tests=(VARIANTS_HTTP_T + "test_an_adapter_and_the_base_share_one_engine_each_"
                  "with_its_lora_list",)),
    Mutant("adapter-base-sent-without-lora", "the base of an engine with adapters is "
           "sent the list that applies none", "gatewayd/core/variants.py",
           "    if not loaded:\n        return False",
           "    if not loaded or applied is None:\n        return False",
           tests=(VARIANTS_T + "test_the_lora_list_is_the_engines_whole_list_whatever_the_"
                  "client_sent",
                  VARIANTS_HTTP_T + "test_an_adapter_and_the_base_share_one_engine_each_"
                  "with_its_lora_list")),
    Mutant("adapter-client-lora-kept", "the lora list is the gateway's, not the client's",
           "gatewayd/core/variants.py", '    payload["lora"] = [{"id": i,',
           '    payload["lora"] = payload.get("lora") or [{"id": i,',
           tests=(VARIANTS_T + "test_the_lora_list_is_the_engines_whole_list_whatever_the_"
                  "client_sent",
                  VARIANTS_HTTP_T + "test_an_adapter_and_the_base_share_one_engine_each_"
                  "with_its_lora_list")),
    Mutant("adapter-ids-from-the-configuration", "the lora ids are the running engine's "
           "(a reload restarts it only once idle)", "gatewayd/http/openai_api.py",
           "    loaded = loaded_adapters(engine.adapters,",
           "    loaded = loaded_adapters(None,",
           tests=(VARIANTS_HTTP_T + "test_the_lora_list_is_the_engines_own_after_a_reload_"
                  "changed_the_adapters",)),
    Mutant("adapter-on-anthropic-path", "llama-server's Anthropic path drops the lora "
           "list: refused for an engine with adapters", "gatewayd/core/variants.py",
           '    if path.startswith("/v1/messages") and not path.endswith("/count_tokens"):',
           '    if False:',
           tests=(VARIANTS_T + "test_an_adapter_its_engine_did_not_load_or_a_body_without_"
                  "the_list_is_refused",
                  VARIANTS_HTTP_T + "test_a_request_that_cannot_carry_the_lora_list_is_"
                  "refused")),
    Mutant("variant-name-of-a-model", "a variant cannot take a model's own name",
           "gatewayd/core/catalog.py",
           '            if (kind, other) != ("variant", variant_id):',
           '            if other != variant_id:',
           tests=(VARIANTS_T + "test_a_variant_cannot_be_called_as_a_model_found_in_models_dir",)),
    Mutant("variant-chain-allowed", "a variant names a model with an engine of its own",
           "gatewayd/core/catalog.py",
           "        if named in adapter_ids or any(named == other.name.casefold()",
           "        if False and any(named == other.name.casefold()",
           tests=(VARIANTS_T + "test_a_variant_that_cannot_work_is_refused_naming_its_key",)),
    Mutant("adapter-file-listed-as-model", "a GGUF whose header says adapter is no model",
           "gatewayd/core/catalog.py",
           "    configured = [*config.models, *(m for m in discovered if not adapter_file(m))]",
           "    configured = [*config.models, *discovered]",
           tests=(VARIANTS_T + "test_an_adapter_file_in_models_dir_is_no_model_and_serves_its_"
                  "base", "tests/unit/test_pulls.py::test_a_lora_adapter_is_pulled_like_a_"
                  "model_and_listed_as_none")),
    Mutant("openai-alias-sent-as-is", "an openai server is asked for the model by its id",
           "gatewayd/core/catalog.py", "            or payload[\"model\"] == model.id:",
           "            or payload[\"model\"] != model.id:",
           tests=(VARIANTS_HTTP_T + "test_an_openai_servers_request_names_the_model_by_its_id",
                  BATCHES_T + "test_an_openai_servers_line_names_the_model_by_its_id")),
    Mutant("batch-line-variant-unshaped", "a batch line for a variant is changed as the "
           "variant says", "gatewayd/service/batch_lines.py",
           "            shape_body(served.shape, line.url, payload)\n",
           "            served.shape\n",
           tests=(BATCHES_T + "test_a_variants_line_goes_to_its_bases_engine_changed_as_the_"
                  "variant_says",)),
    Mutant("sole-client-despite-requests-at-once", "requests at once from one host and key "
           "are not a lone client's", "gatewayd/service/turns.py",
           "            if use.in_flight > 1:\n                # requests at once",
           "            if False:\n                # requests at once",
           tests=("tests/unit/test_turns.py::test_requests_at_once_from_one_host_and_key_are_"
                  "several_clients",)),
    Mutant("haproxy-round-robin", "the shipped HAProxy keeps each model on one gateway",
           "packaging/haproxy/haproxy.cfg", "    balance hash var(txn.model)",
           "    balance roundrobin",
           tests=(FLEET_T + "test_each_model_lives_on_one_gateway",)),
    Mutant("haproxy-no-retry-on-503", "the shipped HAProxy sends a gateway's 503 to another",
           "packaging/haproxy/haproxy.cfg", "    retry-on conn-failure 503",
           "    retry-on conn-failure",
           tests=(FLEET_T + "test_a_503_and_a_refused_connection_are_answered_by_the_other_"
                  "gateway",)),
    Mutant("haproxy-factor-150", "a model with a few requests at once stays on its "
           "gateway", "packaging/haproxy/haproxy.cfg", "    hash-balance-factor 180\n",
           "    hash-balance-factor 150\n",
           tests=(FLEET_T + "test_a_model_with_a_few_requests_at_once_stays_on_its_gateway",)),
    Mutant("haproxy-no-balance-factor", "a hot model overflows to a second gateway",
           "packaging/haproxy/haproxy.cfg", "    hash-balance-factor 180\n", "",
           tests=(FLEET_T + "test_a_hot_model_overflows_to_a_second_gateway_and_comes_home_"
                  "after",)),
    Mutant("haproxy-plain-errors", "what HAProxy answers itself is an OpenAI error that "
           "says it is the balancer's", "packaging/haproxy/haproxy.cfg",
           "    http-error status 503 content-type", "    #http-error status 503 content-type",
           also=(("packaging/haproxy/haproxy.cfg", "    http-error status 408 content-type",
                  "    #http-error status 408 content-type"),),
           tests=(FLEET_T + "test_a_slow_upload_gets_the_balancers_timeout_as_an_openai_error",
                  FLEET_T + "test_no_gateway_up_is_the_balancers_503_as_an_openai_error")),
    Mutant("no-body-idle-watch", "a body that stops coming is refused, not waited for",
           "gatewayd/http/middleware.py",
           "        if request.body_exists and not request.content.is_eof():",
           "        if False:",
           tests=("tests/http/test_slow_body.py",)),
    Mutant("body-idle-is-total", "a slow body that keeps coming is read whole",
           "gatewayd/http/middleware.py",
           "        if content.total_bytes != seen:", "        if False:",
           tests=("tests/http/test_slow_body.py",)),
    Mutant("kv-counts-idle-slots", "an idle slot's cached prompt is not held KV",
           "gatewayd/core/model_server.py",
           '        if slot.get("is_processing") is True and isinstance(tokens, int) \\\n',
           '        if isinstance(tokens, int) \\\n',
           tests=("tests/unit/test_model_server.py",)),
    Mutant("warm-names-only-ids", "every name a client may send for a warm engine is warm",
           "gatewayd/core/model_server.py",
           "n for m in models for n in names.get(m, (m,)) if",
           "n for m in models for n in (m,) if",
           tests=(MODEL_SERVER_T + "test_an_idle_host_reads_empty_with_its_warm_models_and_"
                  "room",)),
    Mutant("room-despite-full", "no room for one more where every place is taken",
           "gatewayd/core/model_server.py",
           "    if places >= max_engines:\n        return False",
           "    if False:\n        return False",
           tests=(MODEL_SERVER_T + "test_requests_in_flight_and_queued_are_the_hosts_"
                  "figures", "tests/unit/test_model_server.py")),
    Mutant("draining-is-warm", "an engine drained to make room is not told as warm",
           "gatewayd/http/admin_api.py",
           "             if e.state == EngineState.READY.value and e.model not in leaving]",
           "             if e.state == EngineState.READY.value]",
           tests=(MODEL_SERVER_T + "test_an_engine_drained_to_make_room_is_not_warm",)),
    Mutant("kv-sum-of-shared-slots", "slots sharing one cache count it once",
           "gatewayd/core/model_server.py",
           "    size = max(sizes) if shared else sum(sizes)", "    size = sum(sizes)",
           tests=("tests/unit/test_model_server.py",)),
    Mutant("busy-engine-absent", "an engine that does not answer /slots counts at its last "
           "reading", "gatewayd/core/model_server.py",
           "        self._last = {m: use if use is not None else self._last[m]",
           "        self._last = {m: use if use is not None else KvUse(0, 0)",
           tests=("tests/unit/test_model_server.py",)),
    Mutant("queue-of-engines-only", "a model waiting for its first engine counts as queued",
           "gatewayd/http/admin_api.py",
           "    depths = dispatcher.queue_depths() if dispatcher is not None else {}",
           "    depths = {u.model_id: u.queued for u in dispatcher.usages() if u.queued} "
           "if dispatcher is not None else {}",
           tests=(MODEL_SERVER_T + "test_requests_in_flight_and_queued_are_the_hosts_"
                  "figures",)),
    Mutant("ready-while-draining", "/ready answers 503 once the gateway is stopping",
           "gatewayd/http/openai_api.py", "    if request.app[SHUTDOWN].draining:",
           "    if False:",
           tests=(FLEET_T + "test_a_draining_gateway_leaves_the_ring_and_loses_nothing",
                  FLEET_T + "test_the_drain_notice_says_draining_and_still_serves")),
    Mutant("retry-header-on-any-error", "only a 503 of the gateway's own says retry is safe",
           "gatewayd/http/middleware.py", "    if status == 503:\n        own[RETRY_HEADER]",
           "    if status >= 400:\n        own[RETRY_HEADER]",
           tests=(FLEET_T + "test_a_503_and_a_refused_connection_are_answered_by_the_other_"
                  "gateway",)),
    Mutant("body-rest-not-discarded", "a body a little over the limit is read and dropped, "
           "so its 413 arrives", "gatewayd/http/middleware.py",
           "        if isinstance(e, BodyTooLarge) and await _rest_discarded(request):",
           "        if False:",
           tests=("tests/http/test_fuzz.py::test_any_request_gets_an_answer_of_the_right_"
                  "shape",)),
    Mutant("adapters-metric-empty", "the metrics say which adapters each engine loaded",
           "gatewayd/http/admin_api.py",
           "            adapters=engine.adapters or (), kv=kv.get(engine.model_id)))",
           "            adapters=(), kv=kv.get(engine.model_id)))",
           tests=(VARIANTS_HTTP_T + "test_the_metrics_say_which_adapters_each_engine_loaded",)),
)

MUTANTS = (SCHEDULING + ACCESS + FORWARDING + WIRE + RELAYS + PLANNING + RESTARTS + STOP
           + ANY_ENGINE + PULLS + CONSOLE + HARDENING + GROUPED + ERROR_SOURCES + BATCHES
           + VARIANTS)


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored), and the
    native modules built from it."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    names = [os.fsdecode(name) for name in files if name]
    names += [str(p.relative_to(ROOT)) for pattern in BUILT for p in ROOT.glob(pattern)]
    for name in names:
        src = ROOT / name
        if src.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    (dest / ".venv").symlink_to(ROOT / ".venv")


@dataclass
class Outcome:
    mutant: Mutant | None    # None: the baseline
    ok: bool                 # killed (for the baseline: every test passed)
    detail: str              # the killer's FAILED line, or what went wrong
    took: float
    failed: tuple[str, ...] = ()   # node ids of the failed tests


def pytest_in(tree: Path, tests: list[str], extra: list[str], timeout_s: float
              ) -> tuple[int, str, float]:
    """pytest run in tree (asserting that it is tree's gatewayd that is tested)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    began = time.monotonic()
    try:
        proc = subprocess.run(
            [str(ROOT / ".venv/bin/python"), "-c",
             "import gatewayd, sys; assert gatewayd.__file__.startswith(sys.argv[1]), "
             "gatewayd.__file__; import pytest; sys.exit(pytest.main(sys.argv[2:]))",
             str(tree), "-q", "-p", "no:cacheprovider", "-m", FAST_TIER, *extra, *tests],
            cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout_s:g}s", time.monotonic() - began
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - began


def failed_lines(out: str) -> list[str]:
    """pytest's summary lines of the tests that failed or errored (not log lines)."""
    return [line for line in out.splitlines() if SUMMARY.match(line)]


def node_of(line: str) -> str:
    """The node id in a `FAILED tests/x.py::test_y - why` summary line."""
    return line.split(" ", 2)[1]


def run_mutant(mutant: Mutant, workdir: Path, extra: list[str], timeout_s: float) -> Outcome:
    tree = workdir / mutant.name
    copy_tree(tree)
    for name, old, new in mutant.edits():
        path = tree / name
        text = path.read_text()
        if text.count(old) != 1:
            return Outcome(mutant, False, f"edit not applicable: {old!r} found "
                                          f"{text.count(old)} times in {name}", 0.0)
        path.write_text(text.replace(old, new))
    rc, out, took = pytest_in(tree, list(mutant.tests), ["-x", *extra], timeout_s)
    shutil.rmtree(tree, ignore_errors=True)
    if rc == 1:   # tests failed: killed
        failed = failed_lines(out)
        return Outcome(mutant, True, failed[0] if failed else "failed", took,
                       tuple(node_of(line) for line in failed))
    if rc == 0:
        return Outcome(mutant, False, "SURVIVED: every test passed", took)
    if rc == -1:   # a hang is no kill here: CI would wait it out each time
        return Outcome(mutant, False, f"{out}: name a test that fails instead", took)
    return Outcome(mutant, False, f"pytest exit {rc}:\n{out[-2000:]}", took)


def run_baseline(tests: list[str], workdir: Path, extra: list[str], timeout_s: float
                 ) -> Outcome:
    tree = workdir / "baseline"
    copy_tree(tree)
    rc, out, took = pytest_in(tree, tests, extra, timeout_s)
    shutil.rmtree(tree, ignore_errors=True)
    failed = failed_lines(out)
    if rc == 0:
        return Outcome(None, True, "every test passed", took)
    return Outcome(None, False, "\n".join(failed) if failed else f"pytest exit {rc}:\n"
                   f"{out[-2000:]}", took, tuple(node_of(line) for line in failed))


def union(mutants: list[Mutant]) -> list[str]:
    """Every mutant's tests, each once (a node id under a file that runs whole is left
    out: pytest would run it twice)."""
    tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
    files = {t for t in tests if "::" not in t}
    return [t for t in tests if "::" not in t or t.split("::")[0] not in files]


def applies(mutant: Mutant) -> str:
    for name, old, _ in mutant.edits():
        count = (ROOT / name).read_text().count(old)
        if count != 1:
            return f"NOT APPLICABLE ({count} matches in {name})"
    return "applies"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this")
    parser.add_argument("-j", type=int, default=max(1, (os.cpu_count() or 2) // 2 + 1),
                        help="mutants run at once (default: half the CPUs, plus one)")
    parser.add_argument("--list", action="store_true",
                        help="print the mutants, their tests and whether their edits apply")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one mutant's tests may take (default 300)")
    parser.add_argument("--tests", nargs="+", metavar="TEST",
                        help="run these tests instead of each mutant's own (to find a "
                             "killer: the FAILED line names it)")
    parser.add_argument("--scenarios", action="store_true",
                        help="only the model test's fixed scenarios (no random search): each "
                             "mutant must be killed by a scenario written for it")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.k in m.name]
    if args.tests:
        chosen = [replace(m, tests=tuple(args.tests)) for m in chosen]
    if args.list:
        for m in chosen:
            print(f"{m.name:32} {m.path}  [{applies(m)}]\n    {m.why}\n    tests: "
                  + "\n           ".join(m.tests))
        print(f"{len(chosen)} mutants")
        return 0
    extra = ["-k", "not TestDispatcherModel"] if args.scenarios else []
    began = time.monotonic()
    bad = 0
    with tempfile.TemporaryDirectory(prefix="gatewayd-mutants-") as tmp, \
            ThreadPoolExecutor(args.j) as pool:
        work = Path(tmp)
        baseline = pool.submit(run_baseline, union(chosen), work, extra, args.timeout)
        runs: list[Future[Outcome]] = [
            pool.submit(run_mutant, m, work, extra, args.timeout) for m in chosen]
        try:
            for run in runs:
                outcome = run.result()
                assert outcome.mutant is not None
                bad += not outcome.ok
                print(f"{'killed  ' if outcome.ok else 'FAILED  '} {outcome.mutant.name:32} "
                      f"{outcome.took:5.1f}s  ({outcome.mutant.why})\n         "
                      f"{outcome.detail}", flush=True)
            base = baseline.result()
        except BaseException:   # (^C): the runs under way end, the rest do not start
            for run in runs:
                run.cancel()
            raise
    # a kill by a test that fails without any mutant says nothing about the mutant
    doubtful = [o for o in (r.result() for r in runs)
                if o.ok and o.failed and o.failed[0] in base.failed]
    print(f"baseline (the same tests, no mutant): {base.took:.1f}s, "
          + ("every test passed" if base.ok else f"FAILED:\n{base.detail}"))
    for o in doubtful:
        assert o.mutant is not None
        print(f"NOT KILLED {o.mutant.name}: its killer fails without it too ({o.failed[0]})")
    bad += len(doubtful)
    print(f"{len(chosen) - bad} of {len(chosen)} mutants killed in "
          f"{time.monotonic() - began:.0f}s (-j {args.j})")
    return 1 if bad or not base.ok else 0


if __name__ == "__main__":
    sys.exit(main())
