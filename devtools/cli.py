"""The `gateway-dev` command (also ``python -m devtools``): the demo, the benchmarks and
the chaos suite.  Each module registers its own sub-command through a
``register(subparsers)`` function, as the `gateway` command's modules do; errors end
a command the same way (``gateway_tasks.cli.main.run_command``)."""

from __future__ import annotations

import argparse
import importlib
import sys

from gateway_tasks.cli.main import run_command

PROG = "gateway-dev"

DESCRIPTION = """\
gateway-dev: the development tools of gateway-tasks -- a local demo, the benchmarks
and the fault suite.  Each starts what it needs: an embedded Redis when REDIS_URL is
unset, the upstream simulator, Celery workers."""

EPILOG = """\
examples:
  gateway-dev demo                      the whole system on an embedded Redis (make demo)
  gateway-dev bench --quick             the router benchmark at small sizes (make bench: full)
  gateway-dev bench-fairness --check    the noisy-neighbour bench, exit 1 on a missed target
  gateway-dev bench-fairness --scenario zipf   10,000 Zipf tenants vs 10: small tenants' waits per quartile of ids
  gateway-dev bench-cluster             6 pools' dispatch on 1 and on 3 Redis Cluster masters (make bench-cluster)
  gateway-dev cron-bench --storm        the cron storm end to end (make bench-beat)
  gateway-dev bench-abuse --quick       one tenant flooding beside a victim of each tier
  gateway-dev chaos --quick             the fault suite at test sizes (make chaos: full)

run `gateway-dev COMMAND --help` for a command's options."""

# module path -> it defines register(subparsers) adding one command
COMMAND_MODULES = (
    "devtools.demo",             # demo
    "devtools.bench.main",       # bench
    "devtools.bench.fairness",   # bench-fairness
    "devtools.bench.dispatch",   # bench-dispatch
    "devtools.bench.cluster",    # bench-cluster
    "devtools.bench.lifecycle",  # bench-lifecycle
    "devtools.bench.inherit",    # bench-inherit
    "devtools.bench.overload",   # bench-overload
    "devtools.bench.abuse",      # bench-abuse
    "devtools.bench.strict",     # bench-strict
    "devtools.bench.beat",       # cron-bench
    "devtools.bench.demand",     # bench-demand
    "devtools.chaos.command",    # chaos
    "devtools.bench.overhead",   # bench-overhead
    "devtools.bench.docs_tables",  # bench-docs
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args, PROG)


if __name__ == "__main__":
    sys.exit(main())
