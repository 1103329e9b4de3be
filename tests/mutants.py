"""Revert the scheduler's fixes one at a time and check the model-based tests catch each.

    .venv/bin/python -m tests.mutants            # every mutant
    .venv/bin/python -m tests.mutants -k drain   # those whose name contains "drain"
    .venv/bin/python -m tests.mutants --scenarios  # killed by the fixed scenarios alone

Each mutant is one textual edit of the gateway (the fix undone, or the rule broken the
simplest way). It is applied to a copy of the working tree under a temporary directory
(never to this tree), and tests/unit/test_dispatcher_model.py runs there. A mutant the
tests do not kill is reported and the exit status is 1. An edit whose text is no longer
found fails loudly: the list must follow the code.

Not part of the test run (it takes minutes): run it after changing the scheduler.

Left out, because no run can tell them apart from the code (equivalent mutants):
- a stop marking the engine `stopping` only once it holds the model's lifecycle lock
  (not before waiting for it): the lock is held only by a start job or another stop,
  so the engine is never ready (never handed to a request) while a stop waits for it;
- `_forget` not failing leftover waiters: nobody can begin to wait once the stop has
  marked the engine (wait_ready refuses a stopping engine; signals do not move it out).
- a starting engine taking the creation's "inactive" as an exit: the signal guard keeps
  its slot until systemd confirms, and the "activating" that follows moves it back to
  starting (a moment of log noise and nothing else).
- the wait after an eviction measuring room without the loads in progress
  ("settle-ignores-loads"): since that wait also ends once the room the loader needs is
  there, ignoring loads can only end it early, and the scheduler's own ledger (net of
  loads) then decides again; at worst it evicts an idle engine it need not have, which no
  invariant of the model forbids (500 examples: survived).
They stay as cheap guards for code that changes around them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = "tests/unit/test_dispatcher_model.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str       # the rule the fix keeps
    path: str
    old: str
    new: str
    also: tuple[tuple[str, str, str], ...] = ()   # more edits: (path, old, new)

    def edits(self) -> list[tuple[str, str, str]]:
        return [(self.path, self.old, self.new), *self.also]


SIGNAL_GUARD_OFF = ("gatewayd/core/engines.py",
                    "                new = replace(new, exit_unconfirmed=True)",
                    "                pass")


MUTANTS = (
    Mutant("no-lifecycle-lock", "a start and a stop of one model never overlap",
           "gatewayd/service/engine_manager.py",
           "            async with self._locks.setdefault(model_id, asyncio.Lock()):\n"
           "                self._bump(model_id)\n                yield",
           "            if True:\n                self._bump(model_id)\n                yield"),
    Mutant("await-before-stop", "choosing a victim and stopping it are atomic",
           "gatewayd/service/loader.py",
           "        log.info(\"evicting %s (%s)\", victim, reason)\n",
           "        log.info(\"evicting %s (%s)\", victim, reason)\n"
           "        await asyncio.sleep(0)\n"),
    Mutant("restarting-frees-slot", "a failed engine that systemd restarts holds its slot "
           "(with the signal guard off too: alone, the guard keeps the slot until systemd "
           "confirms, and it says 'activating')",
           "gatewayd/core/engines.py",
           "            or (state is EngineState.FAILED and restarting))",
           "            )", also=(SIGNAL_GUARD_OFF,)),
    Mutant("signal-frees-slot", "a signal alone never frees a slot",
           "gatewayd/core/engines.py",
           "                new = replace(new, exit_unconfirmed=True)",
           "                pass"),
    Mutant("already-active-fails", "a unit systemd already runs is adopted, not failed",
           "gatewayd/service/engine_manager.py",
           "            except UnitAlreadyActive:\n",
           "            except UnitAlreadyActive if False else ():\n"),
    Mutant("no-reconciler", "the reconciler brings the views together again",
           "gatewayd/service/restore.py",
           "        self._task = asyncio.get_running_loop().create_task(self._loop())",
           "        self._task = None"),
    Mutant("vanished-load-waits", "whoever waits for an engine hears that it stopped "
           "outside the gateway",
           "gatewayd/service/engine_manager.py",
           "        elif new.state is EngineState.STOPPED:",
           "        elif False:"),
    Mutant("deactivating-listed-as-gone", "a unit found deactivating still holds its slot",
           "gatewayd/core/engines.py",
           '    if ev.active_state == "deactivating":\n',
           '    if False:\n'),
    Mutant("admit-ignores-loads", "an operator's start counts loads in progress against "
           "free memory",
           "gatewayd/service/engine_manager.py",
           "                pending_mib=budget.still_to_load_mib(engine.state, True, need, held),",
           "                pending_mib=0,"),
    Mutant("try-anyway-at-once", "'try anyway' waits while a stopped engine's memory may "
           "still be coming back",
           "gatewayd/service/loader.py",
           "                case scheduler.TryAnyway() if self._memory_coming_back():",
           "                case scheduler.TryAnyway() if False:"),
    Mutant("settle-waits-for-gone-memory", "an eviction does not wait for memory that "
           "showed as free before its stop, while room is there",
           "gatewayd/service/loader.py",
           "                        room_for is not None and now >= room_for):",
           "                        False):"),
    Mutant("stopping-holds-no-memory", "a stopping engine's memory counts until it is gone",
           "gatewayd/core/budget.py",
           "    if not holds_slot or state is EngineState.READY:",
           "    if not holds_slot or state not in (EngineState.STARTING, EngineState.LOADING):"),
    Mutant("failed-is-sticky", "a failed model is tried again by a later request",
           "gatewayd/service/loader.py",
           "            if (left := engines.backoff_left(model.id)) > 0:",
           "            if engine is not None and engine.state is EngineState.FAILED:\n"
           "                raise engines.failed_error(model.id)\n"
           "            if (left := engines.backoff_left(model.id)) > 0:"),
    Mutant("no-drain", "a model waiting under load on the others gets a slot (drain)",
           "gatewayd/service/loader.py",
           "                    self._slots.use(victim).draining_for = model.id",
           "                    await self._wait(deadline, model, reason)"),
    Mutant("no-fifo-line", "models get room in the order they asked",
           "gatewayd/service/loader.py",
           "ahead=self.ahead(model.id),",
           "ahead=0,"),
    Mutant("awaited-engine-drained", "an engine its woken waiters are about to use is not "
           "drained (livelock)",
           "gatewayd/core/scheduler.py",
           "        if self.queued and not self.draining:\n"
           "            # requests woken by its load",
           "        if False:\n            # requests woken by its load"),
    Mutant("silent-slot-free", "a slot freed without a change of state wakes the loaders",
           "gatewayd/service/dispatcher.py",
           "        if old.state is new.state and old.holds_slot == new.holds_slot:",
           "        if old.state is new.state:"),
)


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / os.fsdecode(name)
        if src.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    (dest / ".venv").symlink_to(ROOT / ".venv")


def run(mutant: Mutant, workdir: Path, select: list[str]) -> tuple[Mutant, bool, str, float]:
    tree = workdir / mutant.name
    copy_tree(tree)
    for name, old, new in mutant.edits():
        path = tree / name
        text = path.read_text()
        if text.count(old) != 1:
            return mutant, False, f"edit not applicable: {old!r} found " \
                                  f"{text.count(old)} times in {name}", 0.0
        path.write_text(text.replace(old, new))
    began = time.monotonic()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(ROOT / ".venv/bin/python"), "-c",
         "import gatewayd, sys; assert gatewayd.__file__.startswith(sys.argv[1]), "
         "gatewayd.__file__; import pytest; sys.exit(pytest.main(sys.argv[2:]))",
         str(tree), "-x", "-q", "-p", "no:cacheprovider", *select, TESTS],
        cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    took = time.monotonic() - began
    out = proc.stdout + proc.stderr
    if proc.returncode == 1:   # tests failed: killed
        failed = [line for line in out.splitlines() if line.startswith("FAILED")]
        return mutant, True, failed[0] if failed else "failed", took
    if proc.returncode == 0:
        return mutant, False, "survived: every test passed", took
    return mutant, False, f"pytest exit {proc.returncode}:\n{out[-2000:]}", took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this")
    parser.add_argument("-j", type=int, default=max(1, (os.cpu_count() or 2) // 2 + 1))
    parser.add_argument("--scenarios", action="store_true",
                        help="only the fixed scenarios (no random search): each mutant "
                             "must be killed by a scenario written for it")
    args = parser.parse_args()
    select = ["-k", "not TestDispatcherModel"] if args.scenarios else []
    chosen = [m for m in MUTANTS if args.k in m.name]
    survivors = 0
    with tempfile.TemporaryDirectory(prefix="gatewayd-mutants-") as tmp, \
            ThreadPoolExecutor(args.j) as pool:
        for mutant, killed, detail, took in pool.map(lambda m: run(m, Path(tmp), select), chosen):
            survivors += not killed
            print(f"{'killed  ' if killed else 'SURVIVED'} {mutant.name:24} {took:5.0f}s  "
                  f"({mutant.why})\n         {detail}", flush=True)
    print(f"{len(chosen) - survivors} of {len(chosen)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
