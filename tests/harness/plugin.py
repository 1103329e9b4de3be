"""pytest glue: tests marked `systemd` run inside a throwaway systemd container.

On the host, every `systemd` test is replaced by a stand-in item. When the first
stand-in runs, one container is booted (repo bind-mounted at the same path),
and one pytest inside it runs all of them as a transient service of the
container's PID 1 (own cgroup, journal, system bus). Each stand-in then reports
its own test's outcome, with the inside traceback. Inside the container
(LLMGW_IN_CONTAINER=1) the tests run normally and a report is written.

Tests marked `container` stay on the host and drive a container from outside
(reboots, leftovers), through the `systemd_container` fixture.

Where the container cannot boot, tests skip with the reason, except under
CI=true, where they fail: CI must never go green by skipping the real thing.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.harness.container import ContainerError, SystemdContainer, why_unavailable

REPO = Path(__file__).resolve().parents[2]
IN_CONTAINER = os.environ.get("LLMGW_IN_CONTAINER") == "1"
REPORT_PATH = os.environ.get("LLMGW_REPORT")
ENGINE_BUILDERS = {"LLAMA_SERVER": "get_llama_server.sh", "WHISPER_SERVER": "get_whisper_server.sh",
                   "LLAMA_CPP_PYTHON": "get_llama_cpp_python.sh"}  # the last: its venv's python
ENGINE_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-gateway"
INSIDE_TIMEOUT_S = 1800


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(reason: str) -> NoReturn:
    """Skip for a reason outside the test's control, but fail under CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: this test must run, not skip)", pytrace=False)
    pytest.skip(reason)


def engine_binary(env_name: str) -> Path:
    """A built engine binary: from the environment, else the builder's cache."""
    if path := os.environ.get(env_name):
        return Path(path)
    script = REPO / "scripts" / ENGINE_BUILDERS[env_name]
    proc = subprocess.run(["bash", str(script), "--cached-only"], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        unavailable(f"{env_name.lower().replace('_', '-')} is not built: run {script}")
    return Path(proc.stdout.strip())


# -- on the host: stand-ins for tests that run inside --------------------------------


class InsideFailure(Exception):
    pass


class InsideSkip(Exception):
    pass


@dataclass
class InsideRun:
    """One pytest run inside one container, shared by all stand-ins."""

    nodeids: list[str]
    results: dict[str, dict[str, Any]] | None = None
    output: str = ""
    error: str | None = None
    seconds: float = 0.0
    env: dict[str, str] = field(default_factory=dict)

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            self._run()
        finally:
            self.seconds = time.monotonic() - t0

    def _run(self) -> None:
        if reason := why_unavailable():
            self.error = reason
            return
        env = {"LLMGW_IN_CONTAINER": "1", "CI": os.environ.get("CI", ""),
               "PYTHONDONTWRITEBYTECODE": "1"}
        for name in ENGINE_BUILDERS:
            # not built: the tests that need it say so themselves, inside
            with contextlib.suppress(pytest.skip.Exception, pytest.fail.Exception):
                env[name] = str(engine_binary(name))
        outdir = Path(tempfile.mkdtemp(prefix="llmgw-inside-", dir="/var/tmp"))
        report = outdir / "report.json"
        env["LLMGW_REPORT"] = str(report)
        self.env = env
        ro = [ENGINE_CACHE] if ENGINE_CACHE.is_dir() else []
        box = SystemdContainer(f"pytest-{os.getpid()}", binds=[REPO, outdir], binds_ro=ro)
        try:
            box.start()
        except ContainerError as e:
            self.error = f"the systemd test container did not boot: {e}"
            _rmtree(outdir)
            return
        try:
            proc = box.run(sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-o", "addopts=", "-q", "-rfEs", "--color=no",
                           f"--basetemp={INSIDE_BASETEMP}", *self.nodeids,
                           properties={"WorkingDirectory": str(REPO)}, env=env, check=False,
                           timeout=INSIDE_TIMEOUT_S)
            self.output = proc.stdout + proc.stderr
            if report.exists():
                self.results = json.loads(report.read_text())
            else:
                self.error = (f"pytest inside the container wrote no report (exit "
                              f"{proc.returncode}); its output ends:\n{self.output[-3000:]}")
        except ContainerError as e:
            self.error = f"running pytest inside the container failed: {e}"
        finally:
            try:
                box.stop()
            finally:
                _rmtree(outdir)

    def outcome(self, nodeid: str) -> None:
        if self.error:
            unavailable(self.error)
        assert self.results is not None
        result = self.results.get(nodeid)
        if result is None:
            raise InsideFailure(f"{nodeid} did not run inside the container; its output:\n"
                                + self.output[-4000:])
        if result["outcome"] == "failed":
            raise InsideFailure(f"[inside the systemd container, {result['when']}]\n"
                                + result["longrepr"])
        if result["outcome"] == "skipped":
            raise InsideSkip(result["longrepr"])


def _rmtree(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    path.rmdir()


INSIDE_RUN = pytest.StashKey[InsideRun]()


class InsideItem(pytest.Item):
    """Host-side stand-in for a test that runs inside the container."""

    def runtest(self) -> None:
        run = self.config.stash.get(INSIDE_RUN, None)
        if run is None:
            nodeids = [i.nodeid for i in self.session.items if isinstance(i, InsideItem)]
            run = InsideRun(nodeids)
            self.config.stash[INSIDE_RUN] = run
            run.run()
        try:
            run.outcome(self.nodeid)
        except InsideSkip as e:
            unavailable(f"skipped inside the container: {e}")   # under CI=true: a failure

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        if isinstance(excinfo.value, InsideFailure):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name


@pytest.hookimpl(trylast=True)  # after -m/-k deselection
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    if IN_CONTAINER:
        return
    for n, item in enumerate(items):
        if item.get_closest_marker("systemd") is None:
            continue
        assert item.parent is not None
        stand_in = InsideItem.from_parent(item.parent, name=item.name)
        stand_in.own_markers = list(item.own_markers)
        stand_in.keywords.update(item.keywords)
        # the first stand-in to run waits for the whole inside session (each test in it
        # has the usual per-test timeout there)
        stand_in.add_marker(pytest.mark.timeout(INSIDE_TIMEOUT_S + 120), append=False)
        items[n] = stand_in


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    run = config.stash.get(INSIDE_RUN, None)
    if run is None:
        return
    terminalreporter.section(
        f"inside the systemd container: {len(run.nodeids)} tests, {run.seconds:.1f}s")
    terminalreporter.write(run.error + "\n" if run.error else run.output)


# -- inside the container: what the engines' user may read ---------------------------
#
# Inside, engines run as their own user (llm-engine, a dynamic one here) with a private
# /tmp and /var/tmp, as in production. So the test session is laid out the way a user's
# models would be: its temporary directories outside /tmp and passable by others (0711;
# pytest makes them 0700); the engine builds under /root are made reachable when the
# container starts (SystemdContainer.start). The sandbox itself is never relaxed.
INSIDE_BASETEMP = "/srv/llmgw-pytest"   # given to the inside pytest as --basetemp


def _passable_temp_dirs() -> None:
    mktemp = pytest.TempPathFactory.mktemp

    def passable(self: pytest.TempPathFactory, basename: str,
                 numbered: bool = True) -> Path:
        path = mktemp(self, basename, numbered)
        for directory in (self.getbasetemp(), path):
            os.chmod(directory, 0o711)
        return path

    pytest.TempPathFactory.mktemp = passable   # type: ignore[method-assign]


if IN_CONTAINER:
    _passable_temp_dirs()


# -- inside the container: the report the host reads -------------------------------

_results: dict[str, dict[str, Any]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not REPORT_PATH:
        return
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "when": "", "longrepr": ""})
    if report.failed:
        text = str(report.longrepr)
        if entry["outcome"] == "failed":  # e.g. teardown failing after the call did
            text = entry["longrepr"] + "\n\n" + text
        entry.update(outcome="failed", when=report.when, longrepr=text)
    elif report.skipped and entry["outcome"] == "passed":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry.update(outcome="skipped", when=report.when, longrepr=reason)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if REPORT_PATH:
        Path(REPORT_PATH).write_text(json.dumps(_results))
