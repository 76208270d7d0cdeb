"""What every router-v2 bench command shares: the --quick/--json/--log-dir/--check
flags, its log folder and progress lines, printing the result (text or JSON)
and the exit status, registering the sub-command and running it standalone."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Callable, Mapping

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a short run at smaller sizes")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--log-dir", default="", help="where worker logs go (default: a temp dir)")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 when a target fails")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def log_dir_of(args: argparse.Namespace, name: str) -> str:
    """--log-dir, else a new temporary folder; it exists when this returns."""
    path = args.log_dir or tempfile.mkdtemp(prefix=f"gateway-{name}-")
    os.makedirs(path, exist_ok=True)
    return path


def finish(args: argparse.Namespace, result: Mapping[str, Any],
           format_report: Callable[[Mapping[str, Any]], str]) -> int:
    """Print the result; the exit status (1 under --check when a target failed)."""
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 1 if args.check and not result["all_targets_pass"] else 0


def register(subparsers: Any, name: str, help_text: str, doc: str, add_arguments: AddArguments,
             run: Run) -> None:
    p = subparsers.add_parser(name, help=help_text, description=doc.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)


def standalone(module: str, doc: str, add_arguments: AddArguments, run: Run,
               argv: list[str] | None) -> int:
    from gateway_tasks.cli.main import run_standalone
    return run_standalone(f"python -m {module}", doc.split("\n\n")[0], add_arguments, run, argv)
