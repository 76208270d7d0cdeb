"""Every Redis key name gateway-tasks uses, in one place.

All keys start with the settings' key_prefix, which is also kombu's
``global_keyprefix``: Celery's queue lists and its unacked hash live beside
ours, so one prefix isolates one deployment (or one test) completely.
"""

from __future__ import annotations

from dataclasses import dataclass

QUEUE_PREFIX = "gt."  # every gateway Celery queue is gt.<tier>.<pool>


def queue_name(tier: str, pool: str) -> str:
    """The Celery queue of one tier's traffic to one pool: gt.<tier>.<pool>."""
    return f"{QUEUE_PREFIX}{tier}.{pool}"


def split_queue_name(name: str) -> tuple[str, str] | None:
    """gt.<tier>.<pool> -> (tier, pool); None for any other queue name."""
    if not name.startswith(QUEUE_PREFIX):
        return None
    parts = name[len(QUEUE_PREFIX):].split(".", 1)
    if len(parts) != 2 or not all(parts):
        return None
    return parts[0], parts[1]


@dataclass(frozen=True)
class Keys:
    prefix: str = "gt:"

    # -- Celery / kombu (names kombu itself uses, prefixed by global_keyprefix)
    def queue(self, queue_name: str) -> str:
        """The Redis list behind a Celery queue."""
        return f"{self.prefix}{queue_name}"

    @property
    def unacked(self) -> str:
        return f"{self.prefix}unacked"

    @property
    def unacked_index(self) -> str:
        return f"{self.prefix}unacked_index"

    # -- tenants ------------------------------------------------------------
    def tenant(self, tenant_id: str) -> str:
        """Hash: tier, api key hash, created_ms."""
        return f"{self.prefix}tenant:{tenant_id}"

    @property
    def tenants(self) -> str:
        """Set of every registered tenant id."""
        return f"{self.prefix}tenants"

    @property
    def api_keys(self) -> str:
        """Hash: sha256(api key) -> tenant id."""
        return f"{self.prefix}apikeys"

    def learned(self, tenant_id: str) -> str:
        """Hash: learned completion length (EWMA) of a tenant, per model."""
        return f"{self.prefix}learned:{tenant_id}"

    @property
    def inflight(self) -> str:
        """Hash: tenant id -> tasks dispatched and not yet acked (concurrency cap)."""
        return f"{self.prefix}inflight"

    # -- router and upstream buckets ---------------------------------------
    def bucket(self, pool: str) -> str:
        """Hash: tokens, requests, ts_ms, blocked_until_ms of one pool."""
        return f"{self.prefix}bucket:{pool}"

    def fair(self, pool: str) -> str:
        """Hash: WFQ virtual time and per-tier finish tags of one pool."""
        return f"{self.prefix}fair:{pool}"

    @property
    def bell(self) -> str:
        """List: wake-up tokens for idle dispatchers (one per enqueue/refund)."""
        return f"{self.prefix}bell"

    def stats(self, pool: str) -> str:
        """Hash: counters (dispatched, tokens per tier, drops...) of one pool."""
        return f"{self.prefix}stats:{pool}"

    @property
    def dispatch_stats(self) -> str:
        """Hash: dispatcher round trips (picks, waits, dispatched), flushed by every worker."""
        return f"{self.prefix}dispatch"

    # -- results ------------------------------------------------------------
    def meta(self, task_id: str) -> str:
        """String (TTL): idempotency marker of a submitted task id."""
        return f"{self.prefix}meta:{task_id}"

    def task_owner(self, task_id: str) -> str:
        """String (TTL): tenant id that submitted a task (written by every submit path;
        the REST API shows a task to its owner only)."""
        return f"{self.prefix}task-owner:{task_id}"

    def attempts(self, task_id: str) -> str:
        """Integer (TTL): upstream attempts of one task (retry budget)."""
        return f"{self.prefix}attempts:{task_id}"

    # -- beat (tenant crons) ------------------------------------------------
    def cron(self, entry_id: str) -> str:
        """Hash: one cron definition."""
        return f"{self.prefix}cron:{entry_id}"

    @property
    def cron_due(self) -> str:
        """Sorted set: entry id -> next actual fire time (ms since epoch)."""
        return f"{self.prefix}cron:due"

    def cron_tenant(self, tenant_id: str) -> str:
        """Set: entry ids of one tenant."""
        return f"{self.prefix}cron-tenant:{tenant_id}"

    @property
    def beat_lock(self) -> str:
        """String: the id of the active beat process (short TTL)."""
        return f"{self.prefix}beat:lock"

    def cron_fired(self, entry_id: str, nominal_ms: int) -> str:
        """String (TTL): idempotency key of one (entry, nominal time) firing."""
        return f"{self.prefix}cron:fired:{entry_id}:{nominal_ms}"

    def quota(self, tenant_id: str, hour: int) -> str:
        """Integer (TTL): tasks one tenant's crons fired in one clock hour
        (hour = epoch seconds // 3600); the limit is the tier's max_tasks_per_hour."""
        return f"{self.prefix}quota:{tenant_id}:{hour}"

    @property
    def cron_stats(self) -> str:
        """Hash: beat outcome counters (fired, quota, misfire, duplicate, ...)."""
        return f"{self.prefix}cron:stats"

    def cron_payload(self, entry_id: str) -> str:
        """String: JSON payload (messages, model, max_tokens) of one cron, kept out
        of its hash so the hash stays a compact listpack."""
        return f"{self.prefix}cron:payload:{entry_id}"
