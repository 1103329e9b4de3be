"""The `llm-gateway` command line.

`serve` runs the gateway; the other commands talk to a running gateway's
admin API: over its admin socket where they find one (no configuration file or
key needed), else over the public port (the config's [listen], or --url).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import json
import os
import socket
import sys
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gatewayd import __version__, cli_play, cli_pull
from gatewayd.adapters.config_file import load_config
from gatewayd.core.budget import MIB
from gatewayd.core.errors import GatewayError
from gatewayd.core.figures import duration_text, latency_text, size_text
from gatewayd.core.series import DEFAULT_WINDOW, WINDOWS

API_KEY_ENV = "LLM_GATEWAY_API_KEY"
ADMIN_SOCKET_ENV = "LLM_GATEWAY_ADMIN_SOCKET"


class CliError(Exception):
    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-gateway",
        description="One OpenAI-compatible endpoint in front of local engines run as "
                    "systemd units.")
    parser.add_argument("--version", action="version", version=f"llm-gateway {__version__}")
    parser.add_argument("--config", type=Path, help="config file "
                        "(default: $LLM_GATEWAY_CONFIG or /etc/llm-gateway/gateway.toml)")
    parser.add_argument("--url", help="a running gateway's public address (default: its "
                                      "admin socket, else the config's [listen])")
    parser.add_argument("--admin-socket", type=Path,
                        help=f"a running gateway's admin socket (default: ${ADMIN_SOCKET_ENV},"
                             " the config's [admin] socket, /run/llm-gateway/admin.sock)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("serve", help="run the gateway")
    sub.add_parser("check", help="validate the configuration and the models it finds, "
                                 "touching nothing (exit status 1 if it is refused)")
    sub.add_parser("reload", help="re-read the configuration in place (as systemctl reload)")
    sub.add_parser("status", help="how the gateway runs engines, GPU, memory, counts")
    sub.add_parser("models", help="the models the gateway knows")
    sub.add_parser("engines", help="engines: state, PID, uptime, restarts, RAM, need; "
                                   "the memory budgets")
    p = sub.add_parser("top", help="engines, queues and traffic, refreshed (Ctrl-C ends)")
    p.add_argument("-d", "--delay", type=float, default=2.0, help="seconds between frames")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    for verb in ("start", "stop"):
        p = sub.add_parser(verb, help=f"{verb} a model's engine")
        p.add_argument("model")
    p = sub.add_parser("events", help="follow engine state changes, evictions, reloads and "
                                      "queue depths (Ctrl-C ends)")
    p.add_argument("--since", help="first the events the gateway kept since then (the last "
                                   "24 h at most): e.g. 30m, 2h, 1d, or epoch seconds")
    p.add_argument("--no-follow", action="store_true",
                   help="print the kept events (all of them without --since) and exit")
    p = sub.add_parser("stats", help="calls per model over the last 15m, 1h or 24h: errors, "
                                     "rejected, latency, time to first token, tokens/s")
    p.add_argument("--window", choices=list(WINDOWS), default=DEFAULT_WINDOW)
    p.add_argument("--model")
    p = sub.add_parser("records", help="call records, newest first")
    p.add_argument("--model")
    p.add_argument("--endpoint", help="e.g. /v1/messages")
    p.add_argument("--since", help="e.g. 30m, 2h, 1d, or epoch seconds")
    p.add_argument("--status", type=int)
    p.add_argument("--outcome", choices=["ok", "error", "disconnected", "engine_failed"])
    p.add_argument("-n", "--limit", type=int, default=50)
    p = sub.add_parser("batches", help="batch jobs (OpenAI's Batch API), newest first: "
                                       "progress; `batches cancel ID` stops one")
    p.add_argument("action", nargs="?", choices=["cancel"])
    p.add_argument("batch", nargs="?", help="the batch to cancel")
    p.add_argument("-n", "--limit", type=int, default=50)
    p.add_argument("-f", "--follow", action="store_true",
                   help="redrawn every 2 s until every batch listed has ended")
    p = sub.add_parser("logs", help="an engine's journal, or the gateway's own (--gateway)")
    p.add_argument("model", nargs="?")
    p.add_argument("--gateway", action="store_true", help="the gateway's own journal")
    p.add_argument("-n", "--lines", type=int, default=50)
    p.add_argument("-f", "--follow", action="store_true",
                   help="then each line as it is written (Ctrl-C ends)")
    p.add_argument("--grep", help="only lines that contain this text (any case)")
    cli_pull.add_commands(sub)
    cli_play.add_commands(sub)
    # (cli_fleet is imported when the command runs: not on `serve`'s start)
    p = sub.add_parser("endpoints", help="print llm-d's endpoints file (file-discovery) for "
                                         "a fleet of gateways: HOST[:PORT] ...")
    p.add_argument("hosts", nargs="+", metavar="HOST[:PORT]",
                   help="each gateway's address (port default 8080); a host name is "
                        "resolved here to its IPv4 address")
    p.add_argument("--no-check", action="store_true",
                   help="do not ask each gateway for /admin/metrics (by default one that "
                        "does not answer it keyless is named on stderr)")
    p = sub.add_parser("key", help="API keys ([auth] keys_file)")
    keys = p.add_subparsers(dest="key_command", metavar="KEY_COMMAND", required=True)
    p = keys.add_parser("new", help="make a key: prints it (once) and its [keys.NAME] table "
                                    "for the keys file")
    p.add_argument("name")
    p.add_argument("--models", default="*", help="comma-separated model names (default: *)")
    p.add_argument("--scopes", default="inference",
                   help="comma-separated: inference, admin (default: inference)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "key":
            return new_key(args)
        if args.command == "endpoints":   # a file about other gateways: none asked here
            from gatewayd import cli_fleet
            return cli_fleet.run_endpoints(args)
        if args.command not in ("serve", "check"):
            return run_command(args, gateway_address(args))
        config = load_config(args.config, required=args.config is not None)
        if args.command == "serve":
            # off for the start: it ran again and again over the imports' objects, on the
            # socket-activated start's path (docs/benchmarks.md, "Figures behind choices
            # in the code"); back on, the start's objects frozen, once the gateway serves
            # (app.settle_collector)
            gc.disable()
            from gatewayd.adapters.client_tls import deferred_ca_loading
            with deferred_ca_loading():   # the first import of aiohttp
                from gatewayd.app import serve
            serve(config)
            return 0
        return check(args, config)
    except GatewayError as e:
        print(f"llm-gateway: {e.message}", file=sys.stderr)
        return 1
    except CliError as e:
        print(f"llm-gateway: {e}", file=sys.stderr)
        if e.hint:
            print(f"  hint: {e.hint}", file=sys.stderr)
        return 1


def gateway_address(args: argparse.Namespace) -> str:
    """Where the client commands reach the gateway: --url; else its admin socket
    (--admin-socket, $LLM_GATEWAY_ADMIN_SOCKET, the one the config names, or, with no
    --config, the system service's or the user service's); else the config's [listen]
    address. The configuration is read only where it is needed and readable: a user
    in the admin group needs neither it (/etc/llm-gateway is not theirs to read) nor a key."""
    if args.url:
        return str(args.url)
    if explicit := args.admin_socket or os.environ.get(ADMIN_SOCKET_ENV):
        return f"unix:{explicit}"
    try:
        config = load_config(args.config, required=args.config is not None)
    except GatewayError:
        if args.config is not None:
            raise
        config = None
    from gatewayd.adapters.admin_socket import candidate_paths
    if config is not None and config.admin_socket is not None:
        candidates = [config.admin_socket]
    elif args.config is not None and config is not None and config.admin_public:
        candidates = []   # its public port: another gateway's socket must not answer for it
    else:   # the admin API is on the socket only: where that gateway binds it by default
        candidates = candidate_paths()
    for path in candidates:
        if path.is_socket():
            return f"unix:{path}"
    if config is None:
        raise CliError("no gateway admin socket found ("
                       + ", ".join(str(p) for p in candidate_paths())
                       + ") and the configuration is unreadable",
                       hint="pass --admin-socket PATH or --url http://HOST:PORT")
    return f"http://{config.listen_host}:{config.listen_port}"


def new_key(args: argparse.Namespace) -> int:
    """A new random key and the keys-file table that admits it (the file keeps only its
    SHA-256: the key itself is shown here once)."""
    import secrets

    from gatewayd.core.auth import KEY_PREFIX, SCOPES, digest
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
    if bad := set(scopes) - SCOPES:
        raise CliError(f"unknown scope(s) {', '.join(sorted(bad))}; scopes are "
                       f"{', '.join(sorted(SCOPES))}")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    table = (f"[keys.{json.dumps(args.name)}]\nsha256 = \"{digest(key)}\"\n"
             f"models = {json.dumps(models)}\nscopes = {json.dumps(scopes)}\n")
    if args.json:
        print(json.dumps({"name": args.name, "key": key, "sha256": digest(key),
                          "models": models, "scopes": scopes}))
        return 0
    print(f"API key for {args.name!r} (shown only now): {key}\n\n"
          "Add this to the keys file ([auth] keys_file), then `systemctl reload "
          f"llm-gateway`:\n\n{table}")
    return 0


def run_command(args: argparse.Namespace, url: str) -> int:
    if args.command == "status":
        out = call(url, "GET", "/admin/status")
        show(args, out, lambda: status_lines(out))
    elif args.command == "models":
        out = call(url, "GET", "/admin/models")
        show(args, out, lambda: model_lines(out["models"], out.get("variants", [])))
    elif args.command == "engines":
        out = call(url, "GET", "/admin/engines")
        show(args, out, lambda: [*engine_lines(out["engines"]), "",
                                 *memory_lines(call(url, "GET", "/admin/status"))])
    elif args.command == "top":
        top(url, delay=args.delay, once=args.once, as_json=args.json)
    elif args.command in ("start", "stop"):
        out = call(url, "POST", f"/admin/engines/{args.command}", {"model": args.model})
        engine = out["engine"]
        show(args, out, lambda: [f"{engine['model']}: {engine['state']} ({engine['unit']})"])
    elif args.command == "reload":
        out = call(url, "POST", "/admin/reload")
        show(args, out, lambda: reload_lines(out))
    elif args.command == "events":
        follow_events(url, as_json=args.json,
                      since=since_epoch(args.since) if args.since else None,
                      follow=not args.no_follow)
    elif args.command == "pull":
        return cli_pull.run_pull(args, lambda *a: call(url, *a), lambda: events(url))
    elif args.command == "pulls":
        out = call(url, "GET", "/admin/pulls")
        show(args, out, lambda: cli_pull.pulls_lines(out["pulls"]))
    elif args.command == "rm":
        out = call(url, "POST", "/admin/models/remove",
                   {"model": args.model, "force": args.force})
        show(args, out, lambda: [cli_pull.removed_line(out)])
    elif args.command == "records":
        params: dict[str, Any] = {"limit": args.limit}
        for key in ("model", "endpoint", "status", "outcome"):
            if getattr(args, key) is not None:
                params[key] = getattr(args, key)
        if args.since:
            params["since"] = since_epoch(args.since)
        out = call(url, "GET", "/admin/records?" + urllib.parse.urlencode(params))
        for row in out["records"]:
            row["time"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["ts"]))
            for key in ("latency_ms", "ttft_ms"):
                if row[key] is not None:
                    row[key] = round(row[key], 1)
        show(args, out, lambda: table(out["records"], [
            "time", "model", "endpoint", "status", "outcome", "prompt_tokens",
            "completion_tokens", "latency_ms", "ttft_ms", "stream"]))
    elif args.command == "batches":
        batches(url, args)
    elif args.command == "stats":
        params = {"window": args.window, **({"model": args.model} if args.model else {})}
        out = call(url, "GET", "/admin/series?" + urllib.parse.urlencode(params))
        show(args, out, lambda: stats_lines(out))
    elif args.command == "logs":
        logs(url, args)
    elif args.command in ("chat", "embed", "transcribe"):
        try:
            return cli_play.run(args, lambda method, path, data, kind: _exchange(
                url, method, path, data, timeout=600, content_type=kind))
        except cli_play.PlayError as e:
            raise CliError(str(e)) from None
    return 0


def batches(url: str, args: argparse.Namespace) -> None:
    """Every key's batches with their progress, or (cancel ID) one cancelled."""
    if args.action == "cancel":
        if not args.batch:
            raise CliError("give the batch to cancel: llm-gateway batches cancel BATCH_ID")
        out = call(url, "POST", "/admin/batches/cancel", {"batch": args.batch})
        show(args, out, lambda: [f"{out['id']}: {out['status']}"])
        return
    limit = max(1, min(args.limit, 1000))   # what /admin/batches takes
    bars = args.follow or (sys.stdout.isatty() and not args.json)
    try:
        while True:
            out = call(url, "GET", "/admin/batches?" + urllib.parse.urlencode({"limit": limit}))
            if args.follow and not args.json and sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")    # home, clear: a refreshed screen
            rows = out["data"]
            show(args, out, lambda rows=rows: batch_lines(rows, bars=bars))
            if not args.follow or all(b["status"] in BATCH_ENDED for b in rows):
                return
            sys.stdout.flush()
            time.sleep(2)
    except KeyboardInterrupt:
        pass


BATCH_ENDED = frozenset({"completed", "failed", "expired", "cancelled"})


def batch_lines(rows: list[dict[str, Any]], *, bars: bool = False) -> list[str]:
    """One line per batch: its id, key, status, lines done of all (bars: as a progress
    bar too), failed, created."""
    if not rows:
        return ["no batches"]
    shown = []
    for b in rows:
        counts = b["request_counts"]
        done, total = counts["completed"] + counts["failed"], counts["total"]
        shown.append({
            "id": b["id"], "key": b.get("owner") or "-", "status": b["status"],
            "done": f"{done}/{total}", "progress": progress_bar(done, total),
            "failed": counts["failed"], "endpoint": b["endpoint"],
            "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(b["created_at"]))})
    return table(shown, ["id", "key", "status", "done", *(["progress"] if bars else []),
                         "failed", "endpoint", "created"])


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """[#########-----------]  45%"""
    share = done / total if total else 1.0
    filled = min(width, int(share * width))
    return f"[{'#' * filled}{'-' * (width - filled)}] {int(share * 100):3d}%"


def logs(url: str, args: argparse.Namespace) -> None:
    """An engine's journal (MODEL) or the gateway's own (--gateway): the last lines, and with
    -f each new one as it is written (until Ctrl-C or the gateway stops)."""
    if (args.model is None) == (not args.gateway):
        raise CliError("give a model, or --gateway for the gateway's own journal")
    params: dict[str, Any] = {"lines": args.lines}
    if args.model is not None:
        params["model"] = args.model
    if args.grep:
        params["grep"] = args.grep
    path = "/admin/logs" if args.gateway else "/admin/engines/logs"
    if not args.follow:
        out = call(url, "GET", f"{path}?{urllib.parse.urlencode(params)}")
        show(args, out, lambda: out["lines"])
        return
    params["follow"] = 1
    with contextlib.suppress(KeyboardInterrupt):
        for event in sse(url, f"{path}?{urllib.parse.urlencode(params)}"):
            if "line" in event:
                print(json.dumps(event) if args.json else event["line"], flush=True)
            elif event.get("type") == "shutdown":
                print("llm-gateway: the gateway is stopping", file=sys.stderr)
            elif event.get("type") == "end":
                print(f"llm-gateway: {event.get('reason', 'the journal follow ended')}",
                      file=sys.stderr)


def stats_lines(out: dict[str, Any]) -> list[str]:
    """/admin/series's totals: a line for the window, then a row per model (the calls
    that named none last)."""
    totals = out["totals"]
    calls = sum(t["calls"] for t in totals)
    if not calls:
        return [f"no calls in the last {out['window']}"]
    errors, rejected = (sum(t[k] for t in totals) for k in ("errors", "rejected"))
    rows = [{"model": t["model"] or "(no model)", "calls": t["calls"], "errors": t["errors"],
             "rejected": t["rejected"],
             **{column: None if t[key] is None else latency_text(t[key]) for column, key in (
                 ("p50", "latency_p50_ms"), ("p95", "latency_p95_ms"),
                 ("ttft_p50", "ttft_p50_ms"))},
             "tokens/s": None if t["tokens_per_s"] is None else f"{t['tokens_per_s']:.1f}"}
            for t in totals]
    return [f"last {out['window']}: {calls} calls, {errors} errors, {rejected} rejected "
            "(429/503: not admitted)",
            *table(rows, ["model", "calls", "errors", "rejected", "p50", "p95", "ttft_p50",
                          "tokens/s"])]


UNIT_STOP_S = 45          # units/llm-gateway.service's TimeoutStopSec=
STOP_BUDGET_S = UNIT_STOP_S - 5.0   # the stop's own steps after the drain take a moment


def check(args: argparse.Namespace, config: Any) -> int:
    """The configuration parsed (main did that), then its models: names, files, headers.
    A missing engine server is reported but not fatal: the other models would serve."""
    from gatewayd.adapters.model_files import load_catalog
    from gatewayd.adapters.unit_control import manager_can_configure_networks, resolve_binary
    from gatewayd.core.engine_units import listens_on_tcp, server_binary
    from gatewayd.core.errors import EngineBinaryMissing

    catalog = load_catalog(config)
    warnings = []
    for binary in sorted({server_binary(m, config) for m in catalog}):
        try:
            resolve_binary(*binary)
        except EngineBinaryMissing as e:
            warnings.append(e.message)
    tcp = [m.id for m in catalog if listens_on_tcp(m)]
    if tcp and not manager_can_configure_networks():
        warnings.append(
            f"{', '.join(tcp)}: TCP engines (whisper, openai servers told {{port}}) get no "
            "private network namespace here: systemd (PID 1) lacks CAP_NET_ADMIN (a "
            "container sharing the host's network?). A root gateway's engines listen on a "
            "loopback port of this host (39000-39999), where any local user can reach "
            "them; llm-engine@ units (the package) refuse to start instead")
    warnings += [f"{m.id}: adapter {a.name!r}: no file {a.path} (its engine would not "
                 "start)" for m in catalog for a in m.config.adapters if not a.path.is_file()]
    stop_s = config.drain_notice_s + config.shutdown_timeout_s
    if stop_s > STOP_BUDGET_S:
        warnings.append(
            f"listen.drain_notice_s + shutdown_timeout_s = {stop_s:g} s: the packaged unit "
            f"gives a stop {UNIT_STOP_S} s (TimeoutStopSec=) and kills what is left; keep "
            f"them under {STOP_BUDGET_S:g} s or raise TimeoutStopSec= in a drop-in")
    variants = [v.id for v in catalog.variants]
    out = {"ok": True, "config": str(config.source) if config.source else None,
           "models": catalog.ids, "variants": variants, "warnings": warnings}
    show(args, out, lambda: [
        f"{out['config'] or 'defaults'}: ok, {len(catalog)} model(s): "
        f"{', '.join(catalog.ids) or 'none'}"
        + (f"; {len(variants)} variant(s): {', '.join(variants)}" if variants else ""),
        *(f"warning: {w}" for w in warnings)])
    return 0


def reload_lines(out: dict[str, Any]) -> list[str]:
    labels = (("added", "models added"), ("removed", "models removed"),
              ("restarting", "engines restarted once idle (settings changed)"),
              ("kept", "engines kept running"),
              ("needs_restart", "changed settings that wait for a gateway restart"))
    lines = [f"{label}: {', '.join(out[key])}" for key, label in labels if out.get(key)]
    return ["configuration reloaded", *lines]


def memory_lines(out: dict[str, Any]) -> list[str]:
    """Both memory budgets from /admin/status: the GPU's (each device where there are
    several) and the host RAM's."""
    gpu = out.get("gpu_memory_mib")
    memory = "-" if gpu is None else (
        f"{size(gpu['free'] * MIB)} free of {size(gpu['total'] * MIB)} (engines "
        f"{size(gpu['held_by_engines'] * MIB)}, loading {size(gpu['pending_loads'] * MIB)}, "
        f"other processes {size(gpu['external'] * MIB)})")
    if out.get("gpu_error"):
        memory = f"unreadable: {out['gpu_error']}"
    devices = out.get("gpu_devices") or []
    per_device = [f"  GPU {d['index']} ({d['name']}): {size(d['free'] * MIB)} free of "
                  f"{size(d['total'] * MIB)}; engines: {', '.join(d['engines']) or 'none'}"
                  for d in devices] if len(devices) > 1 else []
    ram = out.get("ram_memory_mib")
    # free: what a new engine may count on; engines: what the ledger counts for them (the
    # most of their need and what they hold), so free, engines and reserve add up
    ram_line = "-" if ram is None else (
        f"{size(ram['free_for_planning_mib'] * MIB)} free of {size(ram['total_mib'] * MIB)} "
        f"(engines {size(ram['claimed_mib'] * MIB)}, loading {size(ram['pending_mib'] * MIB)}"
        f", reserve {size(ram['reserve_mib'] * MIB)}"
        + (f", budget {size(ram['budget_mib'] * MIB)}" if ram["budget_mib"] is not None
           else "") + ")")
    return [f"GPU memory: {memory}", *per_device, f"RAM: {ram_line}"]


def status_lines(out: dict[str, Any]) -> list[str]:
    engines = ", ".join(f"{n} {state}" for state, n in out["engines"].items()) or "none"
    return [f"engines: {engines} (at most {out['max_engines']})",
            f"models: {out['models']}",
            f"systemd: {out['systemd_manager']} manager, {out['unit_mode']} units",
            f"GPU: {out['gpu']}",
            *memory_lines(out),
            f"restored after a reboot: {', '.join(out['desired']) or 'none'}",
            f"parked (their next start is fast): {', '.join(out.get('parked') or []) or 'none'}",
            f"config: {out['config'] or '-'}",
            f"records dropped: {out['records_dropped']}",
            *(upstream_line(u) for u in out.get("upstreams") or [])]


def upstream_line(u: dict[str, Any]) -> str:
    state = u["state"] + (f" ({u['last_error']}; next try in {u['next_probe_s']:g}s)"
                          if u["state"] == "down" else "")
    limit = f"/{u['max_concurrency']}" if u["max_concurrency"] else ""
    return (f"upstream {u['name']}: {u['url']} {state}; {u['in_flight']}{limit} in flight; "
            f"models: {', '.join(u['models']) or 'none'}")


def engine_lines(engines: list[dict[str, Any]]) -> list[str]:
    """The engines table, within 100 columns for names of a dozen characters: the unit is
    left out (the model's escaped name in llm-engine-….service; `--json` has it), and a
    failure's reason, a sentence, goes on its own line under its engine, with the unit
    whose journal says more."""
    gpu = any(e.get("vram_need_mib") is not None for e in engines)
    need = "need ram/vram" if gpu else "need ram"
    rows = [{**e, "uptime": duration(e["uptime_s"]), "ram": ram_text(e),
             need: need_text(e.get("ram_need_mib"), e.get("vram_need_mib"))}
            for e in engines]
    lines = table(rows, ["model", "state", "pid", "uptime", "restarts", "ram", need,
                         "in_flight", "queued"])
    out = lines[:1]
    for engine, line in zip(engines, lines[1:], strict=True):
        out.append(line)
        if reason := (engine.get("failure") or {}).get("reason"):
            # where its log is: the unit's name is escaped, not to be guessed
            out.append(f"  {reason} (journalctl -u '{engine['unit']}')")
    return out


def ram_text(engine: dict[str, Any]) -> str | None:
    """What the engine holds in RAM and who measured it: its cgroup or PSS (the gateway's
    meter), else systemd's MemoryCurrent."""
    if engine.get("ram_bytes") is not None:
        return f"{short_size(engine['ram_bytes'])} ({engine['ram_source']})"
    if engine.get("memory_bytes") is not None:
        return f"{short_size(engine['memory_bytes'])} (systemd)"
    return None


def need_text(ram_mib: int | None, vram_mib: int | None) -> str | None:
    """A need as one short cell: 4.5 GiB; with a GPU RAM/VRAM in one unit, 3.1/5.2 GiB."""
    if ram_mib is None:
        return None
    if vram_mib is None:
        return short_size(ram_mib * MIB)
    if max(ram_mib, vram_mib) >= 1024:
        return f"{ram_mib / 1024:.1f}/{vram_mib / 1024:.1f} GiB"
    return f"{ram_mib}/{vram_mib} MiB"



def size(value: int | None) -> str | None:
    """Bytes as people read them: 631 KiB, 1.2 GiB (None stays None: shown as '-')."""
    return None if value is None else size_text(value)


def short_size(value: int) -> str:
    """Memory in a table cell: whole MiB below a GiB (412 MiB), else 4.3 GiB."""
    if value < 1024 * MIB:
        return f"{-(-value // MIB)} MiB"
    return f"{value / (1024 * MIB):.1f} GiB"


def duration(seconds: float | None) -> str | None:
    """3m12s, 2h05m, 41s (None stays None)."""
    return None if seconds is None else duration_text(seconds)


def top(url: str, *, delay: float, once: bool, as_json: bool) -> None:
    """Frames of engines, queues and traffic until Ctrl-C; --once prints one."""
    try:
        while True:
            frame = top_frame(url)
            if as_json:
                print(json.dumps(frame), flush=True)
            else:
                if not once:
                    print("\x1b[H\x1b[2J", end="")    # home, clear: a refreshed screen
                print("\n".join(top_lines(frame)), flush=True)
            if once:
                return
            time.sleep(delay)
    except KeyboardInterrupt:
        pass


def top_frame(url: str) -> dict[str, Any]:
    return {"status": call(url, "GET", "/admin/status"),
            "engines": call(url, "GET", "/admin/engines")["engines"],
            "records": call(url, "GET", "/admin/records?limit=8")["records"],
            "traffic": traffic(call(url, "GET", "/admin/metrics", text=True))}


def traffic(metrics_text: str) -> dict[str, dict[str, float]]:
    """Per model: requests, errors (4xx/5xx), tokens in and out, from /admin/metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    per: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            model = s.labels.get("model")
            if not model:
                continue
            row = per.setdefault(model, dict.fromkeys(
                ("requests", "errors", "tokens_in", "tokens_out"), 0.0))
            if s.name == "llm_gateway_requests_total":
                row["requests"] += s.value
                if int(s.labels.get("status", "0")) >= 400:
                    row["errors"] += s.value
            elif s.name == "llm_gateway_tokens_total":
                row["tokens_in" if s.labels.get("kind") == "prompt" else "tokens_out"] += s.value
    return per


def top_lines(frame: dict[str, Any]) -> list[str]:
    status, traffic_ = frame["status"], frame["traffic"]
    lines = [f"llm-gateway  {time.strftime('%H:%M:%S')}  " + status_lines(status)[0],
             *memory_lines(status), ""]
    lines += engine_lines(frame["engines"])
    lines += line_lines(status.get("schedule"))
    rows = [{"model": m, **{k: int(v) for k, v in t.items()}} for m, t in sorted(
        traffic_.items())]
    lines += ["", *table(rows, ["model", "requests", "errors", "tokens_in", "tokens_out"])]
    calls = [{**r, "time": time.strftime("%H:%M:%S", time.localtime(r["ts"])),
              "latency": f"{r['latency_ms']:.0f} ms", "tokens": (
                  f"{r['prompt_tokens'] or 0}/{r['completion_tokens'] or 0}")}
             for r in frame["records"]]
    lines += ["", *table(calls, ["time", "model", "endpoint", "status", "latency", "tokens"])]
    return lines


def line_lines(schedule: dict[str, Any] | None) -> list[str]:
    """The models waiting for room, head first, and the rule that orders them."""
    if not schedule or not schedule.get("line"):
        return []
    rows = [{**w, "waited": duration(w["waited_s"]) if w["waited_s"] is not None else "",
             "overdue": "yes" if w["overdue"] else ""} for w in schedule["line"]]
    return ["", f"waiting for room ({schedule['order']}, max_wait_s "
                f"{schedule['max_wait_s']:g}):",
            *table(rows, ["model", "waiting", "waited", "priority", "overdue"])]


def model_lines(models: list[dict[str, Any]],
                variants: list[dict[str, Any]] | None = None) -> list[str]:
    """The models table, a line for each model whose GGUF header could not be read, then
    the variants (names for a model's engine: core/variants)."""
    rows = [{**m, "size": size(m["size_bytes"])} for m in models]
    shown = [{**v, "adapter": v["adapter"] or "",
              "changes": ", ".join([*v["defaults"], *(f"max {n}" for n in v["limits"])])
              + (", system prompt" if v["system_prompt"] else "")}
             for v in variants or ()]
    return [*table(rows, ["id", "kind", "backend", "quantization", "context_length", "size",
                          "path"]),
            *(f"{m['id']}: cannot read the GGUF header: {m['header_error']}"
              for m in models if m.get("header_error")),
            *(["", *table(shown, ["id", "variant_of", "adapter", "changes"])] if shown else [])]


def follow_events(url: str, *, as_json: bool, since: float | None = None,
                  follow: bool = True) -> None:
    """since: the kept events from then first; follow=False: the kept events only (all
    of them without since)."""
    def out(event: dict[str, Any]) -> None:
        print(json.dumps(event) if as_json else describe_event(event), flush=True)
    try:
        if not follow:
            for event in history(url, since):
                out(event)
            return
        live = events(url)
        # the feed is followed first (its snapshot came: the gateway holds its events for
        # us), then the history read: nothing falls between the two; what both have is
        # printed once
        first = next(live, None)
        last_ts = float("-inf")
        if since is not None:
            for event in history(url, since):
                out(event)
                last_ts = max(last_ts, event.get("ts", last_ts))
        if first is not None:
            out(first)
        for event in live:
            if event.get("ts", float("inf")) > last_ts:
                out(event)
    except KeyboardInterrupt:
        pass


def history(url: str, since: float | None) -> list[dict[str, Any]]:
    query = f"?{urllib.parse.urlencode({'since': since})}" if since is not None else ""
    out: list[dict[str, Any]] = call(url, "GET", f"/admin/events/history{query}")["events"]
    return out


def events(url: str) -> Iterator[dict[str, Any]]:
    """/admin/events as they come (the snapshot first); ends when the gateway stops."""
    return sse(url, "/admin/events")


def sse(url: str, path: str) -> Iterator[dict[str, Any]]:
    """An event stream of the admin API, each event's data as JSON, as they come."""
    with _exchange(url, "GET", path, timeout=3600) as resp:
        if resp.status != 200:
            _refused(resp, "GET", path)
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if line.startswith("data: "):
                yield json.loads(line[6:])


def describe_event(event: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event.get("ts", time.time())))
    if event["type"] == "engine":
        reason = f" ({event['reason']})" if event.get("reason") else ""
        if event.get("load_s") is not None:
            reason = f" (in {event['load_s']:.1f}s)"
        return f"{when} {event['model']}: {event['from']} -> {event['state']}{reason}"
    if event["type"] == "engine_failure":
        cause = (event.get("cause") or {}).get("text")
        last = (event.get("log_tail") or [""])[-1]
        return (f"{when} {event['model']}: {event['state']}: {event.get('reason')}"
                + (f" ({cause})" if cause else "") + (f"; its log ends: {last}" if last else ""))
    if event["type"] == "queue":
        return f"{when} {event['model']}: {event['depth']} waiting"
    if event["type"] == "snapshot":
        running = ", ".join(f"{e['model']} {e['state']}" for e in event["engines"]) or "none"
        return f"{when} engines: {running}"
    if event["type"] == "reload":
        if not event.get("ok"):
            return f"{when} reload refused: {event.get('error')}"
        changes = event.get("changes") or {}
        said = "; ".join(f"{k}: {', '.join(v)}" for k, v in changes.items() if v)
        return f"{when} reloaded: {said or 'nothing changed'}"
    if event["type"] == "pull" and event.get("state") in ("done", "failed", "cancelled"):
        error = (event.get("error") or {}).get("message")
        return f"{when} pull {event.get('model')}: {event['state']}" \
            + (f" ({error})" if error else "")
    return json.dumps(event)


def since_epoch(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1:] in units:
            return time.time() - float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise CliError(f"--since {text!r}: use e.g. 30m, 2h, 1d or epoch seconds") from None


def call(url: str, method: str, path: str, body: Any = None, *, text: bool = False) -> Any:
    """The admin API's JSON answer (text=True: the answer as text, e.g. /admin/metrics)."""
    data = json.dumps(body).encode() if body is not None else None
    with _exchange(url, method, path, data, timeout=600) as resp:
        if resp.status >= 400:
            _refused(resp, method, path)
        answer = resp.read()
    return answer.decode() if text else json.loads(answer)


@contextlib.contextmanager
def _exchange(url: str, method: str, path: str, data: bytes | None = None, *,
              timeout: float, content_type: str = "application/json"
              ) -> Iterator[http.client.HTTPResponse]:
    """One request to the gateway at url: http://HOST:PORT, or unix:PATH (its admin
    socket). Sends $LLM_GATEWAY_API_KEY (an admin key, where keys are on) if set."""
    headers = {"Content-Type": content_type}
    if key := os.environ.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {key}"
    conn: http.client.HTTPConnection
    if url.startswith("unix:"):
        headers["Host"] = "localhost"   # on TCP, http.client names the URL's host
        conn = _UnixConnection(url.removeprefix("unix:"), timeout)
    else:
        parsed = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80,
                                          timeout=timeout)
    try:
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
        except PermissionError:
            raise CliError(f"{url}: permission denied",
                           hint="the admin socket is for root, the gateway's user and the "
                                "[admin] group; or pass --url (the public port)") from None
        except OSError as e:
            raise CliError(f"cannot reach the gateway at {url}: {e.strerror or e}",
                           hint="is it running? (systemctl status llm-gateway, or "
                                "llm-gateway serve); else pass --url") from None
        yield resp
    finally:
        conn.close()


def _refused(resp: http.client.HTTPResponse, method: str, path: str) -> None:
    try:
        error = json.loads(resp.read())["error"]
    except (ValueError, KeyError, TypeError):
        raise CliError(f"{method} {path}: HTTP {resp.status}") from None
    if error.get("code") == "admin_not_public":
        raise CliError(f"{error.get('message')}", hint="run it where the admin socket is "
                       "(--admin-socket PATH, or [admin] socket in --config)") from None
    raise CliError(error.get("message", f"HTTP {resp.status}")) from None


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("llm-gateway", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def show(args: argparse.Namespace, out: Any, lines: Any) -> None:
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for line in lines():
            print(line)


def table(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*columns).upper().rstrip(),
            *(fmt.format(*row).rstrip() for row in cells)]
