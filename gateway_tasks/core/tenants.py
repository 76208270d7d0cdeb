"""Tenant registry in Redis: tenant id -> tier, hashed API key."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

import redis

from gateway_tasks.core.errors import InvalidRequest, UnknownTenant
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Settings

TENANT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def hash_api_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    tier: str
    api_key_sha256: str = ""
    created_ms: int = 0
    weight: float = 1.0   # share of its tier against the tier's other tenants (fair queuing)


class TenantRegistry:
    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix)

    def register(self, tenant_id: str, tier: str, api_key: str | None = None,
                 weight: float = 1.0) -> tuple[Tenant, str]:
        """Create or update a tenant; returns it and its API key (generated if not given).
        ``weight`` is its share inside its tier: a tenant of weight 2 gets twice the
        tokens of a weight-1 tenant of the same tier while both have work queued."""
        if not isinstance(tenant_id, str) or not TENANT_ID_RE.match(tenant_id):
            raise InvalidRequest(f"tenant id {tenant_id!r} is invalid: use 1-128 of A-Z a-z 0-9 _ . - "
                                 "starting with a letter or digit")
        tier_name = self.settings.tier(tier).name
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1000:
            raise InvalidRequest(f"tenant weight {weight!r} is invalid; expected a number in (0, 1000]")
        api_key = api_key or f"gt-{secrets.token_urlsafe(24)}"
        digest = hash_api_key(api_key)
        tenant = Tenant(tenant_id, tier_name, digest, int(time.time() * 1000), float(weight))
        old = self.r.hget(self.keys.tenant(tenant_id), "api_key_sha256")
        with self.r.pipeline() as pipe:
            if old and old.decode() != digest:
                pipe.hdel(self.keys.api_keys, old)
            pipe.hset(self.keys.tenant(tenant_id), mapping={
                "tier": tier_name, "api_key_sha256": digest, "created_ms": tenant.created_ms,
                "weight": tenant.weight})
            pipe.hset(self.keys.api_keys, digest, tenant_id)
            pipe.sadd(self.keys.tenants, tenant_id)
            pipe.execute()
        return tenant, api_key

    def get(self, tenant_id: str) -> Tenant:
        raw = self.r.hgetall(self.keys.tenant(tenant_id)) if isinstance(tenant_id, str) else {}
        return self.from_record(tenant_id, raw)

    @staticmethod
    def from_record(tenant_id: str, raw: dict[bytes, bytes]) -> Tenant:
        """A tenant from its registry hash as read (HGETALL, e.g. in a caller's pipeline)."""
        if not raw or not isinstance(tenant_id, str):
            raise UnknownTenant(f"unknown tenant {tenant_id!r}; register it first "
                                "(gateway tenant add TENANT --tier TIER)")
        d = {k.decode(): v.decode() for k, v in raw.items()}
        return Tenant(tenant_id, d["tier"], d.get("api_key_sha256", ""), int(d.get("created_ms", 0)),
                      float(d.get("weight", 1.0)))

    def authenticate(self, api_key: str) -> Tenant:
        """The tenant of an API key, else UnknownTenant("invalid API key").

        Constant-time w.r.t. the key: only its SHA-256 is looked up, and the
        tenant's stored digest is compared with hmac.compare_digest (a stale
        index entry never authenticates)."""
        digest = hash_api_key(api_key or "")
        tenant_id = self.r.hget(self.keys.api_keys, digest)
        try:
            tenant = self.get(tenant_id.decode()) if tenant_id else None
        except UnknownTenant:
            tenant = None
        if tenant is None or not hmac.compare_digest(tenant.api_key_sha256, digest):
            raise UnknownTenant("invalid API key")
        return tenant

    def delete(self, tenant_id: str) -> bool:
        tenant = self.get(tenant_id)
        with self.r.pipeline() as pipe:
            pipe.delete(self.keys.tenant(tenant_id))
            pipe.hdel(self.keys.api_keys, tenant.api_key_sha256)
            pipe.srem(self.keys.tenants, tenant_id)
            pipe.execute()
        return True

    def list(self) -> list[Tenant]:
        ids = sorted(m.decode() for m in self.r.smembers(self.keys.tenants))
        return [self.get(t) for t in ids]
