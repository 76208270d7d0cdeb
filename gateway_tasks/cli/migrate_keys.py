"""`gateway migrate-keys`: move a deployment's data from the key names of the releases before
the Redis Cluster layout to today's (gateway_tasks.core.keys), on the standalone Redis that
holds it.  A dry run by default: prints, as JSON, what it would move; ``--apply`` moves it.

What moves (under the deployment's key prefix; nothing else is touched):

* a tenant's record, hourly quota counters and TPM bucket: ``tenant:<id>``,
  ``quota:<id>:<hour>``, ``tenant-bucket:<id>`` -> under the tenant's tag ``{t:<id>}``;
* the cron schedule: ``cron:<entry>``, ``cron:payload:<entry>``, ``cron:due``, ``cron:retry``,
  ``cron:stats``, ``cron:fired:<entry>:<nominal>``, ``cron-tenant:<id>`` -> under ``{beat}``;
* each task's lifecycle records: ``{deps}:held|waiters|done|lift|lifted|shared:<id>`` and
  ``cancelled:<id>`` -> under the task's tag ``{task:<id>}``; a tier's deferred set
  ``{deps}:deferred:<tier>`` -> one per pool, ``{p:<pool>}:deferred:<tier>`` (each task's
  pool read from its held record).

Each key is renamed with RENAMENX, keeping its value and TTL, never over a key of the new
name that exists already: such a conflict is left in place and listed (exit status 1), for
the operator to look at.  Idempotent: run again, it finds only what it did not move.  The
tenants set and the API-key index keep their names.  Short-lived state is left to expire
(the beat's leader lock, the published cron forecast).  Stop every gateway process of the
old release first, migrate, then start the new one; to move to a Redis Cluster, migrate on
the standalone Redis first, then import the data into the cluster (the new names hash to
their slots).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import get_settings

TASK_RECORDS = ("held", "waiters", "done", "lift", "lifted", "shared")   # {deps}:<kind>:<task id>
SCAN_COUNT = 1000


@dataclass(frozen=True)
class Legacy:
    """The key names of the releases before the cluster layout (only this module reads them)."""

    prefix: str

    def tenant(self, tenant_id: str) -> str:
        return f"{self.prefix}tenant:{tenant_id}"

    def quota(self, tenant_id: str, hour: int) -> str:
        return f"{self.prefix}quota:{tenant_id}:{hour}"

    def tenant_bucket(self, tenant_id: str) -> str:
        return f"{self.prefix}tenant-bucket:{tenant_id}"

    def cron(self, entry_id: str) -> str:
        return f"{self.prefix}cron:{entry_id}"

    def cron_payload(self, entry_id: str) -> str:
        return f"{self.prefix}cron:payload:{entry_id}"

    def cron_fired(self, entry_id: str, nominal_ms: int) -> str:
        return f"{self.prefix}cron:fired:{entry_id}:{nominal_ms}"

    def cron_tenant(self, tenant_id: str) -> str:
        return f"{self.prefix}cron-tenant:{tenant_id}"

    @property
    def cron_due(self) -> str:
        return f"{self.prefix}cron:due"

    @property
    def cron_retry(self) -> str:
        return f"{self.prefix}cron:retry"

    @property
    def cron_stats(self) -> str:
        return f"{self.prefix}cron:stats"

    def task_record(self, kind: str, task_id: str) -> str:
        return f"{self.prefix}{{deps}}:{kind}:{task_id}"

    def deferred(self, tier: str) -> str:
        return f"{self.prefix}{{deps}}:deferred:{tier}"

    def cancelled(self, task_id: str) -> str:
        return f"{self.prefix}cancelled:{task_id}"


@dataclass(frozen=True)
class Move:
    kind: str
    old: str
    new: str


@dataclass
class Report:
    applied: bool
    moves: Counter = field(default_factory=Counter)      # kind -> keys moved (or to move)
    deferred: int = 0                                   # deferred tasks placed in their pool's set
    conflicts: list[str] = field(default_factory=list)  # old names left: the new name exists

    def to_json(self) -> dict[str, Any]:
        return {"applied": self.applied, "moved" if self.applied else "to_move": dict(sorted(self.moves.items())),
                "deferred_tasks": self.deferred, "conflicts": sorted(self.conflicts)}


def _names(client: redis.Redis, pattern: str) -> Iterator[str]:
    for key in client.scan_iter(match=pattern, count=SCAN_COUNT):
        yield key.decode() if isinstance(key, bytes) else key


def _rest(key: str, start: str) -> str:
    return key[len(start):]


def plan(client: redis.Redis, keys: Keys) -> list[Move]:
    """Every key of the old layout found, and its new name."""
    old, p = Legacy(keys.prefix), keys.prefix
    moves: list[Move] = []
    for key in _names(client, f"{p}tenant:*"):
        moves.append(Move("tenant", key, keys.tenant(_rest(key, f"{p}tenant:"))))
    for key in _names(client, f"{p}quota:*"):
        tenant, _, hour = _rest(key, f"{p}quota:").rpartition(":")
        if tenant and hour.isdigit():
            moves.append(Move("quota", key, keys.quota(tenant, int(hour))))
    for key in _names(client, f"{p}tenant-bucket:*"):
        moves.append(Move("tpm_bucket", key, keys.tenant_bucket(_rest(key, f"{p}tenant-bucket:"))))
    for key in _names(client, f"{p}cron-tenant:*"):
        moves.append(Move("tenant_crons", key, keys.cron_tenant(_rest(key, f"{p}cron-tenant:"))))
    # entries by the due index (every entry is in it), old or already moved
    entries = {m.decode() for name in (old.cron_due, keys.cron_due) for m in client.zrange(name, 0, -1)}
    for eid in sorted(entries):
        moves.append(Move("cron", old.cron(eid), keys.cron(eid)))
        moves.append(Move("cron_payload", old.cron_payload(eid), keys.cron_payload(eid)))
    for key in _names(client, f"{p}cron:fired:*"):
        eid, _, nominal = _rest(key, f"{p}cron:fired:").rpartition(":")
        if eid and nominal.isdigit():
            moves.append(Move("cron_fired", key, keys.cron_fired(eid, int(nominal))))
    moves += [Move("cron_due", old.cron_due, keys.cron_due), Move("cron_retry", old.cron_retry, keys.cron_retry),
              Move("cron_stats", old.cron_stats, keys.cron_stats)]
    for kind in TASK_RECORDS:
        start = f"{p}{{deps}}:{kind}:"
        for key in _names(client, f"{start}*"):
            moves.append(Move(kind, key, getattr(keys, kind)(_rest(key, start))))
    for key in _names(client, f"{p}cancelled:*"):
        moves.append(Move("cancelled", key, keys.cancelled(_rest(key, f"{p}cancelled:"))))
    with client.pipeline(transaction=False) as pipe:
        for move in moves:
            pipe.exists(move.old)
        found = pipe.execute()
    return [m for m, there in zip(moves, found) if there]


def migrate(client: redis.Redis, keys: Keys, apply: bool) -> Report:
    """Find (and with ``apply``, move) the old layout's keys: see the module's docstring."""
    report = Report(apply)
    moves = plan(client, keys)
    for move in moves:
        if not apply:
            report.moves[move.kind] += 1
            if client.exists(move.new):
                report.conflicts.append(move.old)
            continue
        try:
            moved = client.renamenx(move.old, move.new)
        except redis.ResponseError:      # gone since it was found (expired)
            continue
        if moved:
            report.moves[move.kind] += 1
        else:
            report.conflicts.append(move.old)
    report.deferred = _deferred_sets(client, keys, apply)
    return report


def _deferred_sets(client: redis.Redis, keys: Keys, apply: bool) -> int:
    """Each task of the old per-tier deferred sets into its pool's set of its tier (its pool
    read from its held record, moved first); an id whose record is gone was nobody's to
    release.  Returns how many tasks were (or would be) placed."""
    old, start, placed = Legacy(keys.prefix), f"{keys.prefix}{{deps}}:deferred:", 0
    for key in list(_names(client, f"{start}*")):
        tier = _rest(key, start)
        for member, score in client.zrange(key, 0, -1, withscores=True):
            task_id = member.decode()
            raw = client.hget(keys.held(task_id), "send") or client.hget(old.task_record("held", task_id), "send")
            try:
                pool = json.loads(raw)["body"]["pool"] if raw else ""
            except (ValueError, KeyError, TypeError):
                pool = ""
            if pool:
                placed += 1
                if apply:
                    client.zadd(keys.deferred(pool, tier), {task_id: score}, nx=True)
            if apply:
                client.zrem(key, task_id)
    return placed


def _run(args: argparse.Namespace) -> int:
    settings = get_settings()
    client = redis.Redis.from_url(settings.require_redis_url("`gateway migrate-keys`"))
    try:
        report = migrate(client, Keys(settings.key_prefix), apply=args.apply)
    finally:
        client.close()
    json.dump(report.to_json(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 1 if report.conflicts else 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "migrate-keys", help="move data from the key names of releases before the cluster layout (dry run)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status 1: some old keys were left because a key of their new name exists (listed "
               "under conflicts)")
    parser.add_argument("--apply", action="store_true", help="move the keys (default: only say what would move)")
    parser.set_defaults(func=_run)
