"""`gateway tenant add|list|delete|usage`: manage tenants and their API keys; a tenant's usage.

Output is JSON.  The API key is printed once, by ``add``; Redis keeps only its
hash (HMAC-SHA256 keyed with GATEWAY_API_KEY_SECRET when set: gateway_tasks.tenants.registry).
The REST admin routes (POST /v1/admin/tenants, ...) do the same over HTTP.  Running ``add`` again for an existing tenant changes its tier and
rotates its key (the old key stops working).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


from gateway_tasks.core.redis_client import data_client
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Settings, get_settings
from gateway_tasks.usage.counters import usage_report
from gateway_tasks.tenants.registry import Tenant, TenantRegistry

from beat.api import delete_tenant


def registry_from_env(settings: Settings | None = None) -> TenantRegistry:
    settings = settings or get_settings()
    return TenantRegistry(data_client(settings, "`gateway tenant`"), settings)


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {"tenant_id": tenant.tenant_id, "tier": tenant.tier, "weight": tenant.weight,
            "tpm": tenant.tpm, "created_ms": tenant.created_ms}


def _print(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _add(args: argparse.Namespace) -> int:
    tenant, api_key = registry_from_env().register(args.tenant, args.tier, args.api_key, args.weight,
                                                   args.tpm)
    _print({**tenant_json(tenant), "api_key": api_key})
    return 0


def _list(args: argparse.Namespace) -> int:
    _print([tenant_json(t) for t in registry_from_env().list()])
    return 0


def _delete(args: argparse.Namespace) -> int:
    registry = registry_from_env()
    _print(delete_tenant(registry.settings, registry.r, args.tenant))
    return 0


def _usage(args: argparse.Namespace) -> int:
    settings = get_settings()
    registry = registry_from_env(settings)
    registry.get(args.tenant)            # UnknownTenant (exit 2) for a tenant not registered
    _print(usage_report(registry.r, Keys(settings.key_prefix), args.tenant, int(time.time() * 1000),
                        args.hours, args.days, settings.usage_retention_days))
    return 0


def register(subparsers: Any) -> None:
    """Add the ``tenant`` command (add / list / delete) to the ``gateway`` CLI."""
    parser = subparsers.add_parser("tenant", help="manage tenants and their API keys",
                                   description=__doc__)
    sub = parser.add_subparsers(dest="tenant_command", required=True)

    add = sub.add_parser("add", help="register a tenant (or change its tier and rotate its key)")
    add.add_argument("tenant", metavar="TENANT", help="tenant id (A-Z a-z 0-9 _ . -)")
    add.add_argument("--tier", required=True, help="tier name or alias, e.g. vip, normal, batch")
    add.add_argument("--weight", type=float, default=1.0,
                     help="share against the tier's other tenants while both have work queued "
                          "(default %(default)s)")
    add.add_argument("--tpm", type=int, default=0,
                     help="the tenant's own tokens-per-minute quota, checked at submit "
                          "(default 0: its tier's tenant_tpm, 0 there = none)")
    add.add_argument("--api-key", default=None,
                     help="use this API key instead of generating one")
    add.set_defaults(func=_add)

    lst = sub.add_parser("list", help="list tenants (JSON)")
    lst.set_defaults(func=_list)

    use = sub.add_parser("usage", help="a tenant's usage per hour and per day (JSON, as GET /v1/usage)")
    use.add_argument("tenant", metavar="TENANT")
    use.add_argument("--hours", type=int, default=24, help="the last N clock hours (default 24)")
    use.add_argument("--days", type=int, default=7, help="the last N UTC days (default 7)")
    use.set_defaults(func=_usage)

    delete = sub.add_parser("delete", help="delete a tenant: its API key stops working, its crons "
                                           "go and its unfinished tasks are cancelled")
    delete.add_argument("tenant", metavar="TENANT")
    delete.set_defaults(func=_delete)
