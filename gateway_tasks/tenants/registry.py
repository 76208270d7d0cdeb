"""Tenant registry in Redis: tenant id -> tier, hashed API key.

API keys are stored hashed, never in clear: HMAC-SHA256 keyed with
``settings.api_key_secret`` (``GATEWAY_API_KEY_SECRET``, kept outside Redis, so a
copy of the database alone cannot be used to test guesses of operator-chosen
keys) when one is set, else plain SHA-256 (the generated keys carry 192 random
bits, which no dictionary reaches).  The stored form names its scheme,
``hmac-sha256:<hex>`` or ``sha256:<hex>``.

Registrations written before the scheme was recorded (a bare SHA-256 hex digest
in the ``api_key_sha256`` field), or under plain SHA-256 before a secret was
configured, keep working: ``authenticate`` accepts them once and rewrites them
in the current scheme.  To rotate the secret, set the new one as
``api_key_secret`` and the old one as ``api_key_secret_previous``
(``GATEWAY_API_KEY_SECRET_PREVIOUS``): keys hashed with the old secret still
authenticate and are rehashed with the new one on first use.  Without it, a new
secret invalidates every key hashed with the old one.

A tenant id is a name; what a tenant owns belongs to one *generation* of it.  The first
registration of an id (none stored) draws a random ``gen`` and notes ``since_ms``;
updates keep both; deleting the tenant drops them, so the id registered again is a new
generation.  Owned objects record the generation with the id (``Tenant.owner_tag``,
'<id>/<gen>': a task's ``Keys.task_owner``), so a new generation answers an old
generation's task ids exactly like unknown ones.  Registrations from before generations
have none (``gen`` ""): their tag is the bare id until the id is deleted.
"""

from __future__ import annotations

import dataclasses
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
HMAC_SCHEME = "hmac-sha256"
SHA256_SCHEME = "sha256"
HASH_FIELD = "api_key_hash"          # '<scheme>:<hex>'
LEGACY_HASH_FIELD = "api_key_sha256"  # bare SHA-256 hex (registrations before schemes)
MAX_API_KEY_CHARS = 512


def _sha256_hex(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def hash_api_key(api_key: str, secret: str = "") -> str:
    """The stored form of an API key: ``hmac-sha256:<hex>`` keyed with ``secret``, or
    ``sha256:<hex>`` when no secret is configured."""
    if secret:
        mac = hmac.new(secret.encode("utf-8"), api_key.encode("utf-8"), hashlib.sha256)
        return f"{HMAC_SCHEME}:{mac.hexdigest()}"
    return f"{SHA256_SCHEME}:{_sha256_hex(api_key)}"


def _normalised(stored: str) -> str:
    """A stored digest in '<scheme>:<hex>' form (a legacy bare hex is SHA-256)."""
    return stored if ":" in stored or not stored else f"{SHA256_SCHEME}:{stored}"


def _index_fields(stored: str) -> list[str]:
    """Every api_keys index field a stored digest may sit under (legacy: the bare hex)."""
    stored = _normalised(stored)
    if not stored:
        return []
    scheme, _, hex_ = stored.partition(":")
    return [stored, hex_] if scheme == SHA256_SCHEME else [stored]


def new_api_key() -> str:
    return f"gt-{secrets.token_urlsafe(24)}"


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    tier: str
    api_key_hash: str = ""
    created_ms: int = 0
    weight: float = 1.0   # share of its tier against the tier's other tenants (fair queuing)
    tpm: int = 0          # its own TPM quota (0: its tier's tenant_tpm)
    gen: str = ""         # the generation of this id (random, drawn at its first registration)
    since_ms: int = 0     # when that generation was registered

    @property
    def owner_tag(self) -> str:
        """What this generation's owned objects record as their owner."""
        return owner_tag(self.tenant_id, self.gen)


def owner_tag(tenant_id: str, gen: str) -> str:
    """'<tenant id>/<gen>' ('/' is in no tenant id); the bare id for a tenant without a generation."""
    return f"{tenant_id}/{gen}" if gen else tenant_id


def tenant_of_tag(tag: str) -> str:
    """The tenant id an owner tag names."""
    return tag.partition("/")[0]


class TenantRegistry:
    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix)

    def register(self, tenant_id: str, tier: str, api_key: str | None = None,
                 weight: float = 1.0, tpm: int = 0) -> tuple[Tenant, str]:
        """Create or update a tenant; returns it and its API key (generated if not given).
        ``weight`` is its share inside its tier: a tenant of weight 2 gets twice the
        tokens of a weight-1 tenant of the same tier while both have work queued."""
        if not isinstance(tenant_id, str) or not TENANT_ID_RE.match(tenant_id):
            raise InvalidRequest(f"tenant id {tenant_id!r} is invalid: use 1-128 of A-Z a-z 0-9 _ . - "
                                 "starting with a letter or digit")
        tier_name = self.settings.tier(tier).name
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1000:
            raise InvalidRequest(f"tenant weight {weight!r} is invalid; expected a number in (0, 1000]")
        if isinstance(tpm, bool) or not isinstance(tpm, int) or tpm < 0:
            raise InvalidRequest(f"tenant tpm {tpm!r} is invalid; expected a whole number of tokens "
                                 "per minute >= 0 (0: the tier's tenant_tpm)")
        api_key = new_api_key() if api_key is None else _checked_api_key(api_key)
        digest = self._hash(api_key)
        tenant = Tenant(tenant_id, tier_name, digest, int(time.time() * 1000), float(weight), tpm)
        key = self.keys.tenant(tenant_id)
        old = [v.decode() for v in self.r.hmget(key, HASH_FIELD, LEGACY_HASH_FIELD) if v]
        stale = {f for o in old for f in _index_fields(o)} - {digest}
        # three single-slot steps, each trusted only once the one before it is written
        # (Keys.tenant): the record (in its tenant's slot: one transaction), listed, its
        # key published -- the digest of a key it replaces withdrawn in the same step
        fresh = not self.r.exists(key)    # a registration from before generations keeps none
        with self.r.pipeline(transaction=True) as pipe:
            pipe.hdel(key, LEGACY_HASH_FIELD)
            if fresh:
                pipe.hsetnx(key, "gen", secrets.token_hex(8))
                pipe.hsetnx(key, "since_ms", tenant.created_ms)
            pipe.hset(key, mapping={"tier": tier_name, HASH_FIELD: digest,
                                    "created_ms": tenant.created_ms, "weight": tenant.weight,
                                    "tpm": tenant.tpm})
            pipe.hmget(key, "gen", "since_ms")
            gen, since = pipe.execute()[-1]
        self.r.sadd(self.keys.tenants, tenant_id)
        with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.api_keys, digest, tenant_id)
            if stale:
                pipe.hdel(self.keys.api_keys, *stale)
            pipe.execute()
        self._announce(tenant_id)
        return dataclasses.replace(tenant, gen=(gen or b"").decode(), since_ms=int(since or 0)), api_key

    def _hash(self, api_key: str) -> str:
        return hash_api_key(api_key, self.settings.api_key_secret)

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
        stored = _normalised(d.get(HASH_FIELD) or d.get(LEGACY_HASH_FIELD, ""))
        return Tenant(tenant_id, d["tier"], stored, int(d.get("created_ms", 0)),
                      float(d.get("weight", 1.0)), int(d.get("tpm", 0)), d.get("gen", ""),
                      int(d.get("since_ms", 0)))

    def authenticate(self, api_key: str) -> Tenant:
        """The tenant of an API key, else UnknownTenant("invalid API key").

        Only digests of the key are looked up (never the key), and the tenant's
        stored digest is compared with hmac.compare_digest, so the answer's timing
        says nothing about how close a guess was; a stale index entry never
        authenticates.  A key stored in an older scheme (bare SHA-256, or SHA-256
        before api_key_secret was set) is accepted and rehashed in the current one."""
        if not isinstance(api_key, str) or not api_key or len(api_key) > MAX_API_KEY_CHARS:
            raise UnknownTenant("invalid API key")
        current = self._hash(api_key)
        plain = hash_api_key(api_key)
        # (index field, the stored digest it must match): the current scheme first, then
        # the secret before a rotation, plain SHA-256, and the legacy bare SHA-256 hex
        candidates = [(current, current)]
        previous = self.settings.api_key_secret_previous
        if previous and previous != self.settings.api_key_secret:
            old = hash_api_key(api_key, previous)
            candidates.append((old, old))
        if plain != current:
            candidates.append((plain, plain))
        candidates.append((plain.partition(":")[2], plain))
        found = self.r.hmget(self.keys.api_keys, [f for f, _ in candidates])
        for (index_field, expected), tenant_id in zip(candidates, found):
            if not tenant_id:
                continue
            try:
                tenant = self.get(tenant_id.decode())
            except UnknownTenant:
                continue
            if hmac.compare_digest(tenant.api_key_hash, expected):
                return tenant if expected == current else self._rehash(tenant, index_field, current)
        raise UnknownTenant("invalid API key")

    def _rehash(self, tenant: Tenant, old_field: str, digest: str) -> Tenant:
        """Move a tenant's key from an older hashing scheme to the current one."""
        key = self.keys.tenant(tenant.tenant_id)
        # the new digest published beside the old ones, then the record moved to it, then the
        # old ones withdrawn: whichever step a crash stops at, one of them authenticates
        self.r.hset(self.keys.api_keys, digest, tenant.tenant_id)
        with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(key, HASH_FIELD, digest)
            pipe.hdel(key, LEGACY_HASH_FIELD)
            pipe.execute()
        self.r.hdel(self.keys.api_keys, *(set(_index_fields(tenant.api_key_hash)) | {old_field}) - {digest})
        return dataclasses.replace(tenant, api_key_hash=digest)

    def delete(self, tenant_id: str) -> bool:
        """Drop the registration: its key stops working, and its generation ends (the id
        registered again is a new one).  What it owned is removed by the callers that know
        it (``beat.api.delete_tenant``: crons and tasks)."""
        tenant = self.get(tenant_id)
        fields = _index_fields(tenant.api_key_hash)
        # registration's steps in reverse: its key withdrawn first (it stops working), then
        # unlisted, then the record
        if fields:
            self.r.hdel(self.keys.api_keys, *fields)
        self.r.srem(self.keys.tenants, tenant_id)
        self.r.delete(self.keys.tenant(tenant_id))
        self._announce(tenant_id)
        return True

    def _announce(self, tenant_id: str) -> None:
        """Tell the API processes' auth caches that the tenant changed (written already): they
        drop what they kept of it (gateway_tasks.tenants.auth_cache)."""
        self.r.publish(self.keys.tenants_changed, tenant_id)

    def list(self) -> list[Tenant]:
        """Every registered tenant, by id (a listed id whose record is gone -- a deletion cut
        short -- is not one)."""
        ids = sorted(m.decode() for m in self.r.smembers(self.keys.tenants))
        with self.r.pipeline(transaction=False) as pipe:
            for t in ids:
                pipe.hgetall(self.keys.tenant(t))
            records = pipe.execute()
        return [self.from_record(t, raw) for t, raw in zip(ids, records) if raw]


def _checked_api_key(api_key: object) -> str:
    """An operator-chosen API key: 8-512 visible ASCII characters (it travels in a header)."""
    if not isinstance(api_key, str) or not 8 <= len(api_key) <= MAX_API_KEY_CHARS \
            or not all("!" <= ch <= "~" for ch in api_key):
        raise InvalidRequest("an API key must be 8-512 visible ASCII characters without spaces")
    return api_key
