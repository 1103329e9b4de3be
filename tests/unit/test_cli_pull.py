"""`llm-gateway pull` and `rm` as people see them: the progress drawn from the gateway's
`pull` events (a bar on a terminal, plain lines otherwise), the exit status."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest

from gatewayd import cli, cli_pull

MIB = 1024 * 1024


def pull(state: str, done: int, **kw: Any) -> dict[str, Any]:
    return {"type": "pull", "model": "M-Q4_K_M", "source": "org/M:Q4_K_M", "repo": "org/M",
            "commit": "c0ffee" * 7, "state": state, "files": [{"path": "M-Q4_K_M.gguf"}],
            "total_bytes": 100 * MIB, "done_bytes": done, "resumed_bytes": 0,
            "rate_bps": 10 * MIB if state == "downloading" else None,
            "eta_s": (100 * MIB - done) / (10 * MIB) if state == "downloading" else None,
            "error": None, **kw}


def args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"source": "org/M:Q4_K_M", "name": None, "mmproj": False,
                                 "detach": False, "json": False, **kw})


class Gateway:
    """The admin API as run_pull sees it: a POST, and the events after the snapshot."""

    def __init__(self, answer: dict[str, Any], events: list[dict[str, Any]]) -> None:
        self.answer, self.events = answer, events
        self.calls: list[tuple[str, str, Any]] = []
        self.followed_before_post: bool | None = None

    def call(self, method: str, path: str, body: Any = None) -> Any:
        self.calls.append((method, path, body))
        return {"pull": self.answer}

    def follow(self) -> Iterator[dict[str, Any]]:
        self.followed_before_post = not self.calls
        yield {"type": "snapshot", "engines": []}
        yield {"type": "engine", "model": "other", "state": "ready"}
        yield from self.events


def test_a_pull_is_followed_to_its_end_in_plain_lines_off_a_terminal() -> None:
    events = [pull("downloading", d * MIB) for d in (5, 12, 18, 35, 36, 90)]
    events += [pull("verifying", 100 * MIB, rate_bps=None), pull("done", 100 * MIB)]
    gw = Gateway(pull("downloading", 0), events)
    out = io.StringIO()
    assert cli_pull.run_pull(args(name="mine", mmproj=True), gw.call, gw.follow, out) == 0
    assert gw.followed_before_post      # no event can slip between the POST and following
    assert gw.calls == [("POST", "/admin/models/pull",
                         {"source": "org/M:Q4_K_M", "mmproj": True, "name": "mine"})]
    lines = out.getvalue().splitlines()
    assert lines[0] == ("pulling M-Q4_K_M from org/M at c0ffeec0ffee: M-Q4_K_M.gguf "
                        "(100.0 MiB)")
    # one line per tenth reached (0 and 5 % are both the first, 12 and 18 the second), one
    # per change of state
    assert [line.split("]")[1].split()[0] for line in lines[1:]] == [
        "0%", "12%", "35%", "90%", "100%", "100%"]
    assert lines[3].endswith("35% 35.0 MiB/100.0 MiB 10.0 MiB/s ETA 6s")
    assert lines[-2].endswith("verifying") and lines[-1].endswith("done")


def test_a_terminal_gets_one_line_redrawn() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True
    gw = Gateway(pull("downloading", 0), [pull("downloading", 50 * MIB),
                                           pull("done", 100 * MIB)])
    out = Tty()
    assert cli_pull.run_pull(args(), gw.call, gw.follow, out) == 0
    text = out.getvalue()
    assert text.count("\n") == 2 and text.count("\r") == 3   # the first line, then one bar
    assert "[############............]  50%" in text


def test_a_failed_pull_says_why_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    error = {"message": "the disk filled", "code": "insufficient_storage"}
    gw = Gateway(pull("downloading", 0), [pull("failed", 3 * MIB, error=error)])
    assert cli_pull.run_pull(args(), gw.call, gw.follow, io.StringIO()) == 1
    assert "pulling M-Q4_K_M failed: the disk filled" in capsys.readouterr().err


def test_detach_and_json() -> None:
    gw = Gateway(pull("downloading", 0), [])
    out = io.StringIO()
    assert cli_pull.run_pull(args(detach=True), gw.call, gw.follow, out) == 0
    assert out.getvalue().startswith("pulling M-Q4_K_M") and gw.followed_before_post is None
    gw = Gateway(pull("downloading", 0), [pull("done", 100 * MIB)])
    out = io.StringIO()
    assert cli_pull.run_pull(args(json=True), gw.call, gw.follow, out) == 0
    assert [json.loads(line)["state"] for line in out.getvalue().splitlines()] == [
        "downloading", "done"]


def test_already_here_is_said_once() -> None:
    gw = Gateway(pull("done", 100 * MIB), [])
    out = io.StringIO()
    assert cli_pull.run_pull(args(), gw.call, gw.follow, out) == 0
    assert out.getvalue() == "M-Q4_K_M: already here (org/M at c0ffeec0ffee)\n"


def test_rm_and_pulls_through_the_cli(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    seen: list[tuple[str, str, Any]] = []

    def call(url: str, method: str, path: str, body: Any = None) -> Any:
        seen.append((method, path, body))
        if path == "/admin/pulls":
            return {"pulls": [pull("failed", MIB, error={"message": "gone"})]}
        return {"removed": "M", "paths": ["/m/M"], "freed_bytes": 5 * MIB,
                "stopped_engine": True, "cancelled_pull": False}
    monkeypatch.setattr(cli, "call", call)
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
    assert cli.main(["--url", "http://gw", "rm", "M", "--force"]) == 0
    assert cli.main(["--url", "http://gw", "pulls"]) == 0
    assert seen[0] == ("POST", "/admin/models/remove", {"model": "M", "force": True})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "removed M (its engine stopped): 5.0 MiB freed"
    assert out[1].endswith("failed: gone")


def test_a_gateway_that_stops_mid_pull_is_said_so(capsys: pytest.CaptureFixture[str]) -> None:
    gw = Gateway(pull("downloading", 0), [pull("downloading", 30 * MIB),
                                           {"type": "shutdown"}])
    assert cli_pull.run_pull(args(), gw.call, gw.follow, io.StringIO()) == 1
    assert "the gateway stopped while pulling M-Q4_K_M" in capsys.readouterr().err
