"""The `llm-gateway` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gatewayd import __version__
from gatewayd.errors import GatewayError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-gateway",
        description="One OpenAI-compatible endpoint in front of local engines run as "
                    "systemd units.")
    parser.add_argument("--version", action="version", version=f"llm-gateway {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command is None:
            parser.print_help()
            return 0
        parser.error(f"unknown command {args.command!r}")
    except GatewayError as e:
        print(f"llm-gateway: {e.message}", file=sys.stderr)
        return 1
    return 0
