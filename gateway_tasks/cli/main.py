"""The `gateway` command.  Each concept module registers its own sub-commands
through a ``register(subparsers)`` function; this module only wires them."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Sequence

from gateway_tasks.core.errors import GatewayError

DESCRIPTION = """\
gateway-tasks: a task queue in front of rate-limited OpenAI-compatible LLM APIs.

Every command reads the deployment from the environment: REDIS_URL (the Redis
holding queues, tenants and buckets), GATEWAY_CONFIG (a TOML settings file, see
gateway.example.toml) or GATEWAY_SETTINGS_JSON, and GATEWAY_POOLS_JSON (the
upstreams, each with its API key inline or named by api_key_env).  Only workers
need the upstream keys; every long-running process says at start which
configuration it loaded, and `gateway status` shows it."""

EPILOG = """\
examples:
  gateway tenant add acme --tier vip          register a tenant, print its API key
  gateway api --port 8080                     serve the REST API
  gateway task cancel TASK_ID                 cancel a queued or running task
  gateway flower                              Flower on 127.0.0.1, basic auth on
  gateway cron add acme digest '0 * * * *' --prompt 'Summarise the news'
  gateway simulate-upstream --port 8099       a local OpenAI-compatible upstream
  gateway demo                                the whole system on an embedded Redis
  gateway capacity --measure-s 30 --peak-qps 120   instances needed, from measured rates
  gateway capacity forecast                   token demand per pool from the cron schedule
  gateway status                              load level L0-L4, its reason, pools' circuits

workers and beat run under Celery:
  celery -A workers.app worker -Q gt.vip.default,gt.normal.default,gt.batch.default -P threads -c 32 -E
  celery -A beat.app beat

run `gateway COMMAND --help` for a command's options."""

# module path -> it defines register(subparsers) adding one or more commands
COMMAND_MODULES = (
    "gateway_tasks.devtools.simulator.cli",   # simulate-upstream
    "beat.cli",                  # cron add/list/delete/bench
    "gateway_tasks.devtools.demo",        # demo
    "gateway_tasks.rest.cli",         # api
    "gateway_tasks.cli.flower",       # flower
    "gateway_tasks.cli.tenant",  # tenant add/list/delete
    "gateway_tasks.cli.task",    # task cancel
    "gateway_tasks.metrics.exporter",     # metrics
    "gateway_tasks.devtools.bench.main",       # bench
    "gateway_tasks.devtools.bench.fairness",   # bench-fairness
    "gateway_tasks.devtools.bench.dispatch",   # bench-dispatch
    "gateway_tasks.devtools.bench.lifecycle",  # bench-lifecycle
    "gateway_tasks.devtools.redis_server",     # redis
    "gateway_tasks.cli.ready",                 # ready
    "gateway_tasks.cli.dead_letters",          # dead-letters
    "gateway_tasks.devtools.chaos.command",    # chaos
    "gateway_tasks.cli.capacity",              # capacity, capacity forecast
    "gateway_tasks.cli.status",                # status
    "gateway_tasks.devtools.bench.overload",   # bench-overload
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
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
