"""The `llm-gateway` command line.

`serve` runs the gateway; the other commands talk to a running gateway's
admin API (the address from the config's [listen] table, or --url).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gatewayd import __version__
from gatewayd.adapters.config_file import load_config
from gatewayd.core.errors import GatewayError


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
    parser.add_argument("--url", help="a running gateway (default: from the config)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("serve", help="run the gateway")
    sub.add_parser("status", help="how the gateway runs engines, GPU, counts")
    sub.add_parser("models", help="the models the gateway knows")
    sub.add_parser("engines", help="engines: state, unit, PID, memory, restarts, uptime")
    for verb in ("start", "stop"):
        p = sub.add_parser(verb, help=f"{verb} a model's engine")
        p.add_argument("model")
    sub.add_parser("events", help="follow engine state changes and queue depths (Ctrl-C ends)")
    p = sub.add_parser("records", help="call records, newest first")
    p.add_argument("--model")
    p.add_argument("--endpoint", help="e.g. /v1/messages")
    p.add_argument("--since", help="e.g. 30m, 2h, 1d, or epoch seconds")
    p.add_argument("--status", type=int)
    p.add_argument("--outcome", choices=["ok", "error", "disconnected", "engine_failed"])
    p.add_argument("-n", "--limit", type=int, default=50)
    p = sub.add_parser("logs", help="an engine's journal")
    p.add_argument("model")
    p.add_argument("-n", "--lines", type=int, default=50)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        config = load_config(args.config, required=args.config is not None)
        if args.command == "serve":
            from gatewayd.app import serve
            serve(config)
            return 0
        url = args.url or f"http://{config.listen_host}:{config.listen_port}"
        return run_command(args, url)
    except GatewayError as e:
        print(f"llm-gateway: {e.message}", file=sys.stderr)
        return 1
    except CliError as e:
        print(f"llm-gateway: {e}", file=sys.stderr)
        if e.hint:
            print(f"  hint: {e.hint}", file=sys.stderr)
        return 1


def run_command(args: argparse.Namespace, url: str) -> int:
    if args.command == "status":
        out = call(url, "GET", "/admin/status")
        show(args, out, lambda: [f"{k}: {v}" for k, v in out.items()])
    elif args.command == "models":
        out = call(url, "GET", "/admin/models")
        show(args, out, lambda: model_lines(out["models"]))
    elif args.command == "engines":
        out = call(url, "GET", "/admin/engines")
        show(args, out, lambda: table(out["engines"], ["model", "state", "unit", "pid",
                                                       "restarts", "uptime_s", "memory_bytes"]))
    elif args.command in ("start", "stop"):
        out = call(url, "POST", f"/admin/engines/{args.command}", {"model": args.model})
        engine = out["engine"]
        show(args, out, lambda: [f"{engine['model']}: {engine['state']} ({engine['unit']})"])
    elif args.command == "events":
        follow_events(url, as_json=args.json)
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
    elif args.command == "logs":
        query = urllib.parse.urlencode({"model": args.model, "lines": args.lines})
        out = call(url, "GET", f"/admin/engines/logs?{query}")
        show(args, out, lambda: out["lines"])
    return 0


def model_lines(models: list[dict[str, Any]]) -> list[str]:
    """The models table, then a line for each model whose GGUF header could not be read."""
    return [*table(models, ["id", "backend", "quantization", "context_length", "size_bytes",
                            "path"]),
            *(f"{m['id']}: cannot read the GGUF header: {m['header_error']}"
              for m in models if m.get("header_error"))]


def follow_events(url: str, *, as_json: bool) -> None:
    try:
        with urllib.request.urlopen(url + "/admin/events", timeout=3600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                print(json.dumps(event) if as_json else describe_event(event), flush=True)
    except urllib.error.URLError as e:
        raise CliError(f"cannot reach the gateway at {url}: {e.reason}") from None
    except KeyboardInterrupt:
        pass


def describe_event(event: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event.get("ts", time.time())))
    if event["type"] == "engine":
        reason = f" ({event['reason']})" if event.get("reason") else ""
        return f"{when} {event['model']}: {event['from']} -> {event['state']}{reason}"
    if event["type"] == "queue":
        return f"{when} {event['model']}: {event['depth']} waiting"
    if event["type"] == "snapshot":
        running = ", ".join(f"{e['model']} {e['state']}" for e in event["engines"]) or "none"
        return f"{when} engines: {running}"
    return json.dumps(event)


def since_epoch(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1:] in units:
            return time.time() - float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise CliError(f"--since {text!r}: use e.g. 30m, 2h, 1d or epoch seconds") from None


def call(url: str, method: str, path: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            error = json.loads(e.read())["error"]
        except (ValueError, KeyError, TypeError):
            raise CliError(f"{method} {path}: HTTP {e.code}") from None
        raise CliError(error.get("message", f"HTTP {e.code}")) from None
    except urllib.error.URLError as e:
        raise CliError(f"cannot reach the gateway at {url}: {e.reason}",
                       hint="is it running? (systemctl status llm-gateway, or "
                            "llm-gateway serve); else pass --url") from None


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
