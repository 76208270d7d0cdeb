"""`gateway cron ...`: add, list, delete tenant crons.

    gateway cron add acme digest '0 7 * * *' --prompt 'Summarise yesterday' [--model M] [--max-tokens N]
    gateway cron list [--tenant acme] [--json]
    gateway cron delete acme digest

Each needs REDIS_URL (the gateway's Redis).  The scheduler's benchmark is a dev
tool: `gateway-dev cron-bench`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


from gateway_tasks.core.settings import Settings, load_settings
from gateway_tasks.core.redis_client import Client, data_client

from beat.api import ROW_FIELDS, delete_cron, list_crons, register_cron

TABLE_COLUMNS = (("tenant_id", "TENANT"), ("task_id", "TASK_ID"), ("cron", "CRON"),
                 ("tier", "TIER"), ("jitter_offset_s", "JITTER_S"),
                 ("nominal_next", "NOMINAL_NEXT"), ("actual_next", "ACTUAL_NEXT"),
                 ("last_fired", "LAST_FIRED"), ("last_status", "LAST_STATUS"))


TABLE_LEGEND = """\
NOMINAL_NEXT is when the cron expression next matches (UTC). JITTER_S is how many
seconds after it the run actually fires (ACTUAL_NEXT): sha256("<tenant>:<task_id>")
modulo the tier's jitter window (vip/enterprise 0 s, normal/pro 120 s, batch/free
600 s by default; capped below the cron's period). It is the same on every beat
replica and restart, and spreads crons that share a schedule over the window."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("cron", help="tenant crons: add, list, delete",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cron_command", required=True)

    add = sub.add_parser("add", help="register or update a tenant's cron")
    add.add_argument("tenant", help="tenant id (registered)")
    add.add_argument("task_id", help="the tenant's name for this cron: 1-128 of A-Z a-z 0-9 _ . -")
    add.add_argument("cron_expr", metavar="CRON",
                     help="5-field cron expression in UTC, quoted, e.g. '0 * * * *'")
    add.add_argument("--prompt", required=True, help="the user message each run submits")
    add.add_argument("--model", default=None, help="model (default: the first pool's)")
    add.add_argument("--max-tokens", type=int, default=None, help="completion token limit")
    add.add_argument("--json", action="store_true", help="print the entry as JSON")
    add.set_defaults(func=cmd_add)

    ls = sub.add_parser("list", help="list crons with their next nominal and actual fire times",
                        description=TABLE_LEGEND, formatter_class=argparse.RawDescriptionHelpFormatter)
    ls.add_argument("--tenant", default=None, help="only this tenant's crons")
    ls.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    ls.set_defaults(func=cmd_list)

    rm = sub.add_parser("delete", help="delete a tenant's cron")
    rm.add_argument("tenant")
    rm.add_argument("task_id")
    rm.set_defaults(func=cmd_delete)


def _connect() -> tuple[Settings, Client]:
    settings = load_settings()
    return settings, data_client(settings, "`gateway cron add/list/delete`")


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no crons"
    cells = [[title for _, title in TABLE_COLUMNS]]
    cells += [["-" if row.get(key) is None else str(row.get(key)) for key, _ in TABLE_COLUMNS]
              for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(TABLE_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def cmd_add(args: argparse.Namespace) -> int:
    settings, client = _connect()
    payload: dict[str, Any] = {"messages": [{"role": "user", "content": args.prompt}]}
    if args.model:
        payload["model"] = args.model
    if args.max_tokens is not None:
        payload["max_tokens"] = args.max_tokens
    row = register_cron(settings, client, args.tenant, args.task_id, args.cron_expr, payload)
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print(f"registered {row['tenant_id']}:{row['task_id']} cron {row['cron']!r} tier {row['tier']} "
              f"jitter {row['jitter_offset_s']} s: next nominal {row['nominal_next']}, "
              f"actual {row['actual_next']}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    settings, client = _connect()
    rows = list_crons(settings, client, args.tenant)
    if args.json:
        print(json.dumps([{k: row[k] for k in ROW_FIELDS} for row in rows], indent=2))
    else:
        print(format_table(rows))
        if rows:
            print("\n" + TABLE_LEGEND)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    settings, client = _connect()
    delete_cron(settings, client, args.tenant, args.task_id)
    print(f"deleted {args.tenant}:{args.task_id}")
    return 0
