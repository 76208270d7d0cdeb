"""The `gateway` command.  Each concept module registers its own sub-commands
through a ``register(subparsers)`` function; this module only wires them."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Sequence

from gateway_tasks.core.errors import GatewayError

# module path -> it defines register(subparsers) adding one or more commands
COMMAND_MODULES = (
    "gateway_tasks.devtools.simulator.cli",   # simulate-upstream
    "beat.cli",                  # cron add/list/delete/bench
    "gateway_tasks.devtools.demo",        # demo
    "gateway_tasks.rest.app",         # api
    "gateway_tasks.cli.tenant",  # tenant add/list/delete
    "gateway_tasks.metrics.exporter",     # metrics
    "gateway_tasks.devtools.bench.main",       # bench
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        module = importlib.import_module(module_name)
        module.register(sub)
    return parser


def run_standalone(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                   run: Callable[[argparse.Namespace], int],
                   argv: Sequence[str] | None = None) -> int:
    """`python -m <module>` entry for a command module: parse, run, GatewayError -> exit 2."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return int(run(args) or 0)
    except GatewayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except GatewayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
