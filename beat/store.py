"""Tenant crons in Redis.

* ``keys.cron(entry_id)``: hash, one definition plus its last outcome;
* ``keys.cron_payload(entry_id)``: string, the JSON payload (apart, so the
  hash stays a small listpack whatever the prompt's length);
* ``keys.cron_due``: sorted set, entry id -> next *actual* fire time (ms);
  every entry is in it, so it is also the index for listing all entries;
* ``keys.cron_tenant(tenant)``: set of one tenant's entry ids.

The scheduler reads only the due head of the sorted set (ZRANGEBYSCORE with
LIMIT), so a tick costs O(log N + due), never O(N).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Sequence

import redis

from gateway_tasks.core.errors import ConfigError, CronError, UnknownTenant
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Settings, Tier
from gateway_tasks.tenants.registry import Tenant, TenantRegistry

from beat.admission import check_cron_set
from beat.entry import TIMEZONE, CronEntry, entry_id, new_run_secret, validate_ids, validate_payload
from beat.jitter import jitter_offset_s
from beat.schedule import actual_ms, cron_period_s, first_nominal_ms, validate_cron

if TYPE_CHECKING:
    from gateway_tasks.producer.gateway import Gateway

LIST_CHUNK = 1000


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class CronSpec:
    """One cron to register in bulk (``CronStore.add_many``)."""

    tenant_id: str
    task_id: str
    cron: str
    payload: dict[str, Any]


class Due(NamedTuple):
    """A due entry: its id and the actual fire time it is due at (its score)."""

    entry_id: str
    fire_ms: int


class CronStore:
    def __init__(self, client: redis.Redis, settings: Settings, gateway: "Gateway | None" = None):
        self.r = client
        self.settings = settings
        self._gateway = gateway
        self.keys = Keys(settings.key_prefix)
        self.tenants = TenantRegistry(client, settings)

    # -- building ------------------------------------------------------------
    def build(self, tenant_id: str, task_id: str, cron_expr: str, payload: Any, tier: str,
              at_ms: int, settled_ms: int | None = None, created_ms: int | None = None,
              timezone: str = TIMEZONE) -> CronEntry:
        """A validated entry whose next run is computed for time ``at_ms``."""
        validate_ids(tenant_id, task_id)
        if timezone != TIMEZONE:
            raise CronError(f"cron timezone {timezone!r} is not supported; only {TIMEZONE!r}")
        cron = validate_cron(cron_expr)
        clean = validate_payload(payload)
        try:
            tier_cfg = self.settings.tier(tier)
        except ConfigError as exc:
            raise CronError(f"tenant {tenant_id!r}: {exc}") from None
        period_s = cron_period_s(cron)
        offset_s = jitter_offset_s(tenant_id, task_id, tier_cfg.jitter_window_s, period_s)
        nominal = first_nominal_ms(cron, offset_s, at_ms, settled_ms)
        return CronEntry(
            tenant_id=tenant_id, task_id=task_id, cron=cron, payload=clean, tier=tier_cfg.name,
            window_s=tier_cfg.jitter_window_s, period_s=period_s, jitter_offset_s=offset_s,
            next_nominal_ms=nominal, next_fire_ms=actual_ms(nominal, offset_s),
            created_ms=at_ms if created_ms is None else created_ms, updated_ms=at_ms,
            settled_nominal_ms=settled_ms)

    # -- writing -------------------------------------------------------------
    def add(self, tenant_id: str, task_id: str, cron_expr: str, payload: Any,
            timezone: str = TIMEZONE, now: int | None = None) -> CronEntry:
        """Register or update (upsert) one cron.  An update keeps the entry's
        history and never re-fires a nominal time already fired or skipped.

        Admitted first (``beat.admission``): the payload exactly as a submit of it would
        be (``Gateway.admit``), the tenant's cron set against its tier's cron count and
        hourly fires -- checked in the same transaction that writes the entry, so two
        registrations at once cannot both pass on the same room."""
        validate_ids(tenant_id, task_id)
        cron = validate_cron(cron_expr)
        clean = validate_payload(payload)
        tenant = self.tenants.get(tenant_id)        # UnknownTenant if not registered
        tier_cfg = self._tier_cfg(tenant)
        self.gateway().admit(tenant, clean["messages"], model=clean.get("model"),
                             max_tokens=clean.get("max_tokens"))
        at_ms = now_ms() if now is None else now
        eid = entry_id(tenant_id, task_id)
        key, own = self.keys.cron(eid), self.keys.cron_tenant(tenant_id)
        earlier = self.r.hget(key, "tenant_gen")
        if earlier and tenant.gen and earlier.decode() != tenant.gen:
            self.delete(tenant_id, task_id)   # an earlier generation's cron of this id: its history too
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key, own)
                    others = sorted(m.decode() for m in pipe.smembers(own) if m.decode() != eid)
                    if others:
                        pipe.watch(*(self.keys.cron(o) for o in others))
                    rows = [pipe.hmget(self.keys.cron(o), "cron", "tenant_gen") for o in others]
                    crons = {o.partition(":")[2]: c.decode() for o, (c, g) in zip(others, rows)
                             if c and (not g or not tenant.gen or g.decode() == tenant.gen)}
                    check_cron_set(tier_cfg, tenant_id, {**crons, task_id: cron})
                    settled, created, secret, gen = pipe.hmget(key, "settled_nominal_ms", "created_ms",
                                                               "run_secret", "tenant_gen")
                    if gen and tenant.gen and gen.decode() != tenant.gen:
                        settled = created = secret = None     # an earlier generation's: a new cron
                    entry = self.build(tenant_id, task_id, cron_expr, payload, tenant.tier, at_ms,
                                       settled_ms=int(settled) if settled else None,
                                       created_ms=int(created) if created else None,
                                       timezone=timezone)
                    entry.run_secret = secret.decode() if secret else new_run_secret()
                    entry.tenant_gen = tenant.gen
                    pipe.multi()
                    pipe.hset(key, mapping=entry.definition_fields())
                    pipe.set(self.keys.cron_payload(eid), entry.payload_json())
                    pipe.zadd(self.keys.cron_due, {eid: entry.next_fire_ms})
                    pipe.sadd(own, eid)
                    pipe.execute()
                    self.gateway().memory.charge(len(entry.payload_json()))
                    return entry
                except redis.WatchError:
                    continue

    def _tier_cfg(self, tenant: Tenant) -> Tier:
        try:
            return self.settings.tier(tenant.tier)
        except ConfigError as exc:
            raise CronError(f"tenant {tenant.tenant_id!r}: {exc}") from None

    def gateway(self) -> "Gateway":
        """The producer a registration is admitted through (built on first use)."""
        if self._gateway is None:
            from gateway_tasks.producer.gateway import Gateway   # lazy: listing needs no Celery app
            self._gateway = Gateway(self.settings, client=self.r)
        return self._gateway

    def add_many(self, specs: Iterable[CronSpec], now: int | None = None,
                 chunk: int = 2000) -> int:
        """Bulk load for operators and benches (new entries; no upsert history check),
        pipelined: shape-checked only, without ``add``'s admission (payload, tier limits) --
        no tenant reaches it (REST, ``gateway cron add`` and ``beat.api`` use ``add``)."""
        at_ms = now_ms() if now is None else now
        tiers: dict[str, str] = {}
        gens: dict[str, str] = {}
        count = 0
        batch: list[CronSpec] = []

        def flush() -> None:
            missing = sorted({s.tenant_id for s in batch} - set(tiers))
            if missing:
                with self.r.pipeline(transaction=False) as pipe:
                    for t in missing:
                        pipe.hmget(self.keys.tenant(t), "tier", "gen")
                    for t, (tier, gen) in zip(missing, pipe.execute()):
                        if tier is None:
                            raise UnknownTenant(f"unknown tenant {t!r}; register it first "
                                                "(gateway tenant add TENANT --tier TIER)")
                        tiers[t], gens[t] = tier.decode(), (gen or b"").decode()
            with self.r.pipeline(transaction=False) as pipe:
                for s in batch:
                    e = self.build(s.tenant_id, s.task_id, s.cron, s.payload, tiers[s.tenant_id], at_ms)
                    e.run_secret, e.tenant_gen = new_run_secret(), gens[s.tenant_id]
                    pipe.hset(self.keys.cron(e.entry_id), mapping=e.definition_fields())
                    pipe.set(self.keys.cron_payload(e.entry_id), e.payload_json())
                    pipe.zadd(self.keys.cron_due, {e.entry_id: e.next_fire_ms})
                    pipe.sadd(self.keys.cron_tenant(e.tenant_id), e.entry_id)
                pipe.execute()
            batch.clear()

        for spec in specs:
            batch.append(spec)
            count += 1
            if len(batch) >= chunk:
                flush()
        if batch:
            flush()
        return count

    def delete(self, tenant_id: str, task_id: str) -> bool:
        """Remove one cron, and a deferred run of it waiting to be tried again (beat.engine's
        ``cron_retry`` member ``<entry id>|<nominal ms>``: ids hold no glob character or
        '|'): a cron added again under the same id must not fire the old one's run.
        False if it did not exist."""
        validate_ids(tenant_id, task_id)
        eid = entry_id(tenant_id, task_id)
        pending = [m for m, _ in self.r.zscan_iter(self.keys.cron_retry, match=f"{eid}|*", count=1000)]
        with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.cron(eid), self.keys.cron_payload(eid))
            pipe.zrem(self.keys.cron_due, eid)
            pipe.srem(self.keys.cron_tenant(tenant_id), eid)
            if pending:
                pipe.zrem(self.keys.cron_retry, *pending)
            deleted, removed, *_ = pipe.execute()
        return bool(deleted or removed)

    def run_secret(self, eid: str) -> str:
        """An entry's run secret, stored now if it has none (an entry registered before
        entries had one).  A deleted entry gets a random one, stored nowhere."""
        key = self.keys.cron(eid)
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    if not pipe.exists(key):
                        return new_run_secret()
                    secret = pipe.hget(key, "run_secret")
                    if secret:
                        return secret.decode()
                    fresh = new_run_secret()
                    pipe.multi()
                    pipe.hset(key, "run_secret", fresh)
                    pipe.execute()
                    return fresh
                except redis.WatchError:
                    continue

    def delete_tenant(self, tenant_id: str) -> int:
        """Remove every cron of a tenant (its tenant is being deleted); how many."""
        return sum(self.delete(tenant_id, eid.partition(":")[2]) for eid in self.entry_ids(tenant_id))

    # -- reading -------------------------------------------------------------
    def get(self, tenant_id: str, task_id: str) -> CronEntry | None:
        """One cron of the tenant's current generation (None: none of that id)."""
        validate_ids(tenant_id, task_id)
        entry = self.load([entry_id(tenant_id, task_id)])[0]
        return entry if entry is not None and entry.of_generation(self._gen(tenant_id)) else None

    def load(self, entry_ids: Sequence[str]) -> list[CronEntry | None]:
        out: list[CronEntry | None] = []
        for start in range(0, len(entry_ids), LIST_CHUNK):
            with self.r.pipeline(transaction=False) as pipe:
                for eid in entry_ids[start:start + LIST_CHUNK]:
                    pipe.hgetall(self.keys.cron(eid))
                    pipe.get(self.keys.cron_payload(eid))
                replies = pipe.execute()
                out.extend(CronEntry.from_hash(raw, payload) if raw else None
                           for raw, payload in zip(replies[0::2], replies[1::2]))
        return out

    def entry_ids(self, tenant_id: str | None = None) -> list[str]:
        if tenant_id is not None:
            return sorted(m.decode() for m in self.r.smembers(self.keys.cron_tenant(tenant_id)))
        return sorted(m.decode() for m in self.r.zrange(self.keys.cron_due, 0, -1))

    def list(self, tenant_id: str | None = None) -> list[CronEntry]:
        """Every entry (or one tenant's: its generation's only), sorted by tenant then task id."""
        entries = [e for e in self.load(self.entry_ids(tenant_id)) if e is not None]
        if tenant_id is not None:
            gen = self._gen(tenant_id)
            entries = [e for e in entries if e.of_generation(gen)]
        return sorted(entries, key=lambda e: (e.tenant_id, e.task_id))

    def _gen(self, tenant_id: str) -> str:
        gen = self.r.hget(self.keys.tenant(tenant_id), "gen")
        return gen.decode() if gen else ""

    def due(self, now: int, limit: int) -> list[Due]:
        """Up to ``limit`` entries with fire time <= now, earliest first."""
        rows = self.r.zrangebyscore(self.keys.cron_due, "-inf", now, start=0, num=limit,
                                    withscores=True)
        return [Due(m.decode(), int(score)) for m, score in rows]

    def next_fire_ms(self) -> int | None:
        head = self.r.zrange(self.keys.cron_due, 0, 0, withscores=True)
        return int(head[0][1]) if head else None

    def count(self) -> int:
        return int(self.r.zcard(self.keys.cron_due))
