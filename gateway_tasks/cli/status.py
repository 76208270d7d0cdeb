"""``gateway status``: the configuration it loaded (source, pools), the deployment's load
level, its reason and history, what each tier gets now, and each pool's circuit breaker --
read from Redis, no Flower needed."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


from gateway_tasks.core.redis_client import data_client
from gateway_tasks.core.config_report import config_summary, format_config
from gateway_tasks.core.settings import get_settings
from gateway_tasks.overload.status import deployment_status, format_status


def _run(args: argparse.Namespace) -> int:
    settings = get_settings()
    client = data_client(settings, "`gateway status`")
    try:   # Redis down: one line and its exit status (gateway_tasks.cli.main)
        status = deployment_status(client, settings, history=args.history)
    finally:
        client.close()
    summary = config_summary(settings)
    if args.json:
        text = json.dumps({"configuration": summary, **status}, indent=2)
    else:
        text = "\n".join([*format_config(summary), format_status(status)])
    sys.stdout.write(text + "\n")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status", help="print the configuration, the load level (L0-L4), its reason and history, "
                       "and the pools' circuits",
        description="Where this command's settings were loaded from (GATEWAY_CONFIG, GATEWAY_SETTINGS_JSON "
                    "or the built-in defaults; GATEWAY_POOLS_JSON) and the pools' base URLs, then the "
                    "overload controller's decision as the workers committed it in Redis: "
                    "level, reason, signals, level changes, tier actions, circuit breakers.")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    parser.add_argument("--history", type=int, default=20, help="level changes shown (default %(default)s)")
    parser.set_defaults(func=_run)
