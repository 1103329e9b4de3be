"""`llm-gateway pull` and `llm-gateway rm`: the gateway downloads (it owns models_dir);
this follows its `pull` events and draws the progress: a bar on a terminal, a plain
line every tenth (and at each change of state) otherwise, for logs and scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from gatewayd.core.figures import duration_text, size_text

PLAIN_EVERY_S = 10.0     # a non-terminal's progress line at least this often
BAR_WIDTH = 24
FINAL = ("done", "failed", "cancelled")


def add_commands(sub: Any) -> None:
    p = sub.add_parser("pull", help="download a model from Hugging Face into models_dir "
                                    "(REPO, REPO:QUANT or REPO:FILE.gguf)")
    p.add_argument("source", help="e.g. bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M")
    p.add_argument("--name", help="the model's name here (default: its file's)")
    p.add_argument("--mmproj", action="store_true",
                   help="with the repository's projector (images/audio for the model)")
    p.add_argument("--detach", action="store_true",
                   help="start it and return; follow it with `llm-gateway pulls`")
    sub.add_parser("pulls", help="downloads running and the last finished")
    p = sub.add_parser("rm", help="delete a model from models_dir (its files, KV cache "
                                  "and learned memory); stops a running pull of it")
    p.add_argument("model")
    p.add_argument("--force", action="store_true", help="stop its engine first")


ApiCall = Callable[..., Any]
Follow = Callable[[], Iterator[dict[str, Any]]]


def run_pull(args: argparse.Namespace, call: ApiCall, follow: Follow,
             out: TextIO = sys.stdout) -> int:
    """Start the pull and draw it until it ends; 0 when the model is here."""
    body = {"source": args.source, "mmproj": args.mmproj,
            **({"name": args.name} if args.name else {})}
    if args.detach:
        pull = call("POST", "/admin/models/pull", body)["pull"]
        print(json.dumps(pull) if args.json else start_line(pull), file=out)
        return 0
    events = follow()   # before the POST: no event of this pull can be missed
    next(events, None)  # the snapshot: the subscription is in place
    pull = call("POST", "/admin/models/pull", body)["pull"]
    drawer = Drawer(out, as_json=args.json, tty=out.isatty() and not args.json)
    drawer.show(pull)
    try:
        for event in events:
            if event.get("type") == "pull" and event.get("model") == pull["model"]:
                pull = event
                drawer.show(pull)
                if pull["state"] in FINAL:
                    break
    except KeyboardInterrupt:
        drawer.end()
        print(f"\nstill pulling in the gateway: `llm-gateway pulls` follows it, "
              f"`llm-gateway rm {pull['model']}` stops it", file=sys.stderr)
        return 130
    drawer.end()
    if pull["state"] not in FINAL:   # the feed ended: the gateway stopped
        print(f"llm-gateway: the gateway stopped while pulling {pull['model']}: it goes on "
              "from the bytes it has when the gateway starts again (`llm-gateway pulls`)",
              file=sys.stderr)
        return 1
    if pull["state"] != "done":
        error = pull.get("error") or {}
        print(f"llm-gateway: pulling {pull['model']} {pull['state']}: "
              f"{error.get('message', '')}", file=sys.stderr)
        return 1
    return 0


def start_line(pull: dict[str, Any]) -> str:
    files = ", ".join(f["path"] for f in pull["files"])
    if pull["state"] == "done":
        return f"{pull['model']}: already here ({pull['repo']} at {pull['commit'][:12]})"
    resumed = (f", resuming at {size_text(pull['resumed_bytes'])}"
               if pull.get("resumed_bytes") else "")
    return (f"pulling {pull['model']} from {pull['repo']} at {pull['commit'][:12]}: {files} "
            f"({size_text(pull['total_bytes'])}{resumed})")


def progress_line(pull: dict[str, Any]) -> str:
    total, done = pull["total_bytes"], pull["done_bytes"]
    share = done / total if total else 1.0
    filled = round(share * BAR_WIDTH)
    rate = f"{size_text(pull['rate_bps'])}/s" if pull.get("rate_bps") else "-"
    eta = duration_text(pull["eta_s"]) if pull.get("eta_s") is not None else "-"
    state = "" if pull["state"] == "downloading" else f" {pull['state']}"
    return (f"{pull['model']} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {share:4.0%} "
            f"{size_text(done)}/{size_text(total)} {rate} ETA {eta}{state}")


class Drawer:
    """A terminal gets one line redrawn in place; anything else a line per tenth done
    and per change of state (and at least every PLAIN_EVERY_S)."""

    def __init__(self, out: TextIO, *, as_json: bool, tty: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._out, self._json, self._tty, self._clock = out, as_json, tty, clock
        self._last: tuple[str, int] | None = None
        self._last_at = 0.0
        self._started = False

    def show(self, pull: dict[str, Any]) -> None:
        if self._json:
            print(json.dumps(pull), file=self._out, flush=True)
            return
        if not self._started:
            self._started = True
            print(start_line(pull), file=self._out, flush=True)
            if pull["state"] == "done":
                return
        if pull["state"] in ("failed", "cancelled"):
            return   # run_pull says why, on stderr
        if self._tty:
            print(f"\r{progress_line(pull)}\x1b[K", end="", file=self._out, flush=True)
            return
        tenth = int(10 * pull["done_bytes"] / pull["total_bytes"]) if pull["total_bytes"] else 10
        mark = (pull["state"], tenth)
        now = self._clock()
        if mark != self._last or now - self._last_at >= PLAIN_EVERY_S:
            self._last, self._last_at = mark, now
            print(progress_line(pull), file=self._out, flush=True)

    def end(self) -> None:
        if self._tty and not self._json:
            print(file=self._out, flush=True)


def pulls_lines(pulls: list[dict[str, Any]]) -> list[str]:
    if not pulls:
        return ["no pulls"]
    lines = []
    for p in pulls:
        line = progress_line(p)
        if p.get("error"):
            line += f": {p['error']['message']}"
        lines.append(line)
    return lines


def removed_line(out: dict[str, Any]) -> str:
    if out.get("cancelled_pull"):
        return f"{out['removed']}: its pull stopped, its partial download deleted"
    stopped = " (its engine stopped)" if out.get("stopped_engine") else ""
    return f"removed {out['removed']}{stopped}: {size_text(out['freed_bytes'])} freed"
