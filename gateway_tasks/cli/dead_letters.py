"""`gateway dead-letters`: the messages workers took off the queues because they could
not be run (gateway_tasks.dispatch.dead_letters), newest first, as JSON.  The stored message
itself is left out unless --with-message is given (it may hold a prompt)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


from gateway_tasks.core.redis_client import data_client
from gateway_tasks.dispatch.dead_letters import dead_letters
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import get_settings


def _run(args: argparse.Namespace) -> int:
    settings = get_settings()
    client = data_client(settings, "`gateway dead-letters`")
    pools = [args.pool] if args.pool else [p.name for p in settings.pools]
    out = []
    for pool in pools:
        settings.pool(pool)   # ConfigError for an unknown pool
        for record in dead_letters(client, Keys(settings.key_prefix), pool, args.limit):
            if not args.with_message:
                record.pop("message", None)
            out.append({"pool": pool, **record})
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("dead-letters", help="list dead-lettered queue messages (JSON)",
                                   description=__doc__)
    parser.add_argument("--pool", default="", help="one pool (default: every pool)")
    parser.add_argument("--limit", type=int, default=100, help="newest N per pool (default %(default)s)")
    parser.add_argument("--with-message", action="store_true",
                        help="include the stored message (its first 64 KiB; it may hold a prompt)")
    parser.set_defaults(func=_run)
