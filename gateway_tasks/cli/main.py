"""The `gateway` command.  Each concept module registers its own sub-commands
through a ``register(subparsers)`` function; this module only wires them."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Sequence

from gateway_tasks.core.errors import (EXIT_CONFIG, EXIT_FAILED, EXIT_REDIS_UNAVAILABLE, ConfigError,
                                       GatewayError, RedisUnavailable, exit_status)
from gateway_tasks.core.redis_failures import CLIENT_ERRORS, as_unavailable, is_outage, unavailable_line
from gateway_tasks.core.settings import get_settings

DESCRIPTION = """\
gateway-tasks: a task queue in front of rate-limited OpenAI-compatible LLM APIs.

Every command reads the deployment from the environment: REDIS_URL (the Redis
holding queues, tenants and buckets), GATEWAY_CONFIG (a TOML settings file, see
gateway.example.toml) or GATEWAY_SETTINGS_JSON, and GATEWAY_POOLS_JSON (the
upstreams, each with its API key inline or named by api_key_env).  Only workers
need the upstream keys; every long-running process says at start which
configuration it loaded, and `gateway status` shows it."""

EPILOG = f"""\
examples:
  gateway tenant add acme --tier vip          register a tenant, print its API key
  gateway api --port 8080                     serve the REST API
  gateway task show TASK_ID                   state, place in line, expected start, why it waits
  gateway task cancel TASK_ID                 cancel a queued or running task
  gateway tenant usage acme --days 7          a tenant's usage per hour and day
  gateway flower                              Flower on 127.0.0.1, basic auth on
  gateway cron add acme digest '0 * * * *' --prompt 'Summarise the news'
  gateway simulate-upstream --port 8099       a local OpenAI-compatible upstream
  gateway redis --dir .redis-data             a local Redis to keep (gateway-tasks[embedded])
  gateway capacity --measure-s 30 --peak-qps 120   instances needed, from measured rates
  gateway capacity forecast                   token demand per pool from the cron schedule
  gateway status                              load level L0-L4, its reason, pools' circuits
  gateway migrate-keys --apply                after an upgrade: data under the old key names moved

workers and beat run under Celery:
  celery -A workers.app worker -Q gt.vip.default,gt.normal.default,gt.batch.default -P threads -c 16 -E
  celery -A beat.app beat
  a bad configuration stops either at start with one line, `gateway worker: configuration
  error: ...` (or `gateway beat: ...`), and exit status {EXIT_CONFIG}, as `gateway flower` does

exit status:
  0   done
  1   the command's own "no" (its --help says when: a task already finished, not ready in time)
  {EXIT_FAILED}   a bad command line, or a refused request (an unknown tenant, a malformed cron)
  {EXIT_REDIS_UNAVAILABLE}  the deployment's Redis is unreachable, refuses the credentials, or is full
  {EXIT_CONFIG}  a configuration error (REDIS_URL unset, GATEWAY_CONFIG missing or invalid, ...)
  On {EXIT_FAILED}, {EXIT_REDIS_UNAVAILABLE} and {EXIT_CONFIG} the command prints one line to stderr, `gateway: ...`, and
  nothing to stdout: `KEY=$(gateway tenant add ...)` gets an empty string.

run `gateway COMMAND --help` for a command's options.  The demo, the benchmarks and
the fault suite are dev tools, in the source tree's gateway-tasks-devtools: `gateway-dev`."""

# module path -> it defines register(subparsers) adding one or more commands
COMMAND_MODULES = (
    "gateway_tasks.simulator.cli",        # simulate-upstream
    "beat.cli",                           # cron add/list/delete
    "gateway_tasks.rest.cli",             # api
    "gateway_tasks.cli.flower",           # flower
    "gateway_tasks.cli.tenant",           # tenant add/list/delete
    "gateway_tasks.cli.task",             # task show, list, result, cancel
    "gateway_tasks.metrics.exporter",     # metrics
    "gateway_tasks.local.redis_server",   # redis
    "gateway_tasks.cli.ready",            # ready
    "gateway_tasks.cli.dead_letters",     # dead-letters
    "gateway_tasks.cli.capacity",         # capacity, capacity forecast
    "gateway_tasks.cli.status",           # status
    "gateway_tasks.cli.migrate_keys",     # migrate-keys
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


def _redis_url() -> str:
    """The deployment's Redis URL, for an error line (credentials are stripped there)."""
    try:
        return get_settings().redis_url
    except ConfigError:
        return os.environ.get("REDIS_URL", "")


def error_line(exc: GatewayError) -> str:
    """The one line a command prints when it stops on ``exc``."""
    if isinstance(exc, RedisUnavailable):
        return unavailable_line(exc, _redis_url())
    return str(exc)


def run_command(run: Callable[[argparse.Namespace], int | None], args: argparse.Namespace,
                prog: str = "gateway") -> int:
    """Run a command; a GatewayError, or Redis down or full, ends it with one line on stderr
    (``<prog>: ...``), nothing more on stdout, and its exit status (core.errors.exit_status)."""
    try:
        return int(run(args) or 0)
    except GatewayError as exc:
        failure = exc
    except CLIENT_ERRORS as exc:
        if not is_outage(exc):
            raise
        failure = as_unavailable(exc)
    print(f"{prog}: {error_line(failure)}", file=sys.stderr)
    return exit_status(failure)


def run_standalone(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                   run: Callable[[argparse.Namespace], int],
                   argv: Sequence[str] | None = None) -> int:
    """`python -m <module>` entry for a command module: parse, run (as ``run_command``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    return run_command(run, parser.parse_args(argv), prog)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
