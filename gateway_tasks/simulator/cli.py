"""``gateway simulate-upstream`` and ``python -m gateway_tasks.simulator.cli``:
serve the simulator in the foreground with the flags of ``flags.py``."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from gateway_tasks import simulator
from gateway_tasks.simulator.flags import add_arguments, config_from_args
from gateway_tasks.simulator.runner import ENTRY_MODULE, serve

SUMMARY = (simulator.__doc__ or "").split("\n\n")[0]


def _run(args: argparse.Namespace) -> int:
    serve(config_from_args(args), host=args.host, port=args.port)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``simulate-upstream`` command to the ``gateway`` CLI."""
    parser = subparsers.add_parser(
        "simulate-upstream", help="run a local OpenAI-compatible upstream with TPM/RPM limits",
        description=SUMMARY)
    add_arguments(parser)
    parser.set_defaults(func=_run)


def main(argv: Sequence[str] | None = None) -> int:
    from gateway_tasks.cli.main import run_standalone
    return run_standalone(f"python -m {ENTRY_MODULE}", SUMMARY, add_arguments, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
