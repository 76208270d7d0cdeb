"""Every Redis key name gateway-tasks uses, in one place.

All keys start with the settings' key_prefix, which is also kombu's
``global_keyprefix``: Celery's queue lists and its unacked hash live beside
ours, so one prefix isolates one deployment (or one test) completely.

On Redis Cluster a key's hash slot is that of its ``{hash tag}``.  Every Lua script and
every MULTI transaction touches the keys of one tag only, and no fixed tag gathers every
tenant's or every task's keys: a pool's dispatch state is under ``{p:<pool>}``, a tenant's
own records under ``{t:<tenant>}``, a task's lifecycle records under ``{task:<id>}``, the
cron schedule under ``{beat}``, the load level under ``{overload}``.  What spans tags runs
as ordered single-slot steps (each section below says which); tests/test_cluster_slots.py
runs every script and transaction on a real cluster.  A tag is the first ``{...}`` of a
key, so the prefix holds no ``{``.
"""

from __future__ import annotations

from dataclasses import dataclass

QUEUE_PREFIX = "gt."  # every gateway Celery queue is gt.<tier>.<pool>

# The bells: Redis lists of wake-up tokens (``Keys.bell``, ``Keys.tier_bell``, ...).
#
# Every enqueue pushes one on its tier's bell (lua/dispatch/enqueue.lua), as does a release
# that puts a task back or unparks its tenant (lua/dispatch/release.lua); every token refund
# pushes one on the pool's (lua/bucket/settle.lua) while a dispatcher waits for the pool's
# bucket (lua/dispatch/pick.lua records until when); an idle dispatcher BLPOPs the bells of
# the tiers it serves and of their pools (``gateway_tasks.dispatch.transport``).  A list is
# trimmed to ``BELL_MAX`` tokens: one is enough to wake a dispatcher, and a bell nobody
# waits on must not grow without bound.
BELL_MAX = 1024  # wake-up tokens kept on the bell list


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


# Demand history (``Keys.demand``): per pool, tier and clock hour, what was enqueued in each
# minute; kept 7 days and an hour (the forecast looks 7 days back, 10 minutes ahead)
DEMAND_RETENTION_S = 7 * 86_400 + 3_600


def demand_fields(minute_of_hour: int) -> tuple[str, str]:
    """The fields of ``Keys.demand`` holding one minute's requests and estimated tokens
    (lua/dispatch/enqueue.lua names them the same way)."""
    return f"r{minute_of_hour}", f"t{minute_of_hour}"


def learned_field(tenant: str, model: str) -> str:
    """The field of ``Keys.learned(pool)`` holding one tenant's completion length on a model."""
    return f"{tenant}|{model}"


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
    # A tenant's record sits under its tenant tag (``tenant_tag``, with its quotas, usage and
    # batches); the two global indexes below are written in their own single-key steps,
    # ordered so that a crash between steps leaves nothing a reader trusts half-written
    # (gateway_tasks/tenants/registry.py): the record first, listed next, its API key
    # published last; deleted in the reverse order.
    def tenant(self, tenant_id: str) -> str:
        """Hash: tier, api key hash, created_ms, weight, tpm, gen, since_ms."""
        return f"{self.tenant_tag(tenant_id)}tenant"

    @property
    def tenants(self) -> str:
        """Set of every registered tenant id (global index: a member without a record is
        not listed)."""
        return f"{self.prefix}tenants"

    @property
    def api_keys(self) -> str:
        """Hash: digest of an API key -> tenant id (global index: an entry authenticates only
        when the tenant's record holds the same digest)."""
        return f"{self.prefix}apikeys"

    # -- one pool's dispatch state -------------------------------------------
    # Every key a dispatch touches (enqueue, pick, ack/requeue, settle, drain)
    # lives under the pool's Redis Cluster hash tag, ``<prefix>{p:<pool>}:``, so
    # a pool's state sits in one hash slot: pools spread over Cluster shards and
    # no script call ever crosses slots.
    def pool_tag(self, pool: str) -> str:
        """The common start of a pool's keys, hash tag included: 'gt:{p:default}:'."""
        return f"{self.prefix}{{p:{pool}}}:"

    def bucket(self, pool: str) -> str:
        """Hash: tokens, requests, ts_ms, blocked_until_ms, debited_tokens, dispatches of one
        pool's bucket, wait_until_ms (until when a dispatcher waits for it: lua/dispatch/pick.lua;
        refunds ring the pool's ``bell`` only until then), and beside them the pool's
        fair-queuing state (``fair``)."""
        return f"{self.pool_tag(pool)}bucket"

    def fair(self, pool: str) -> str:
        """The pool's fair-queuing state: tier WFQ virtual time 'v', per-tier finish tags
        'f:<tier>', tenant virtual times 'tv:<tier>', empty flags 'e:<tier>' (until when
        pick.lua, which found the tier's active set empty, skips it; 0 once a tenant joins)
        and the lifecycle lines 'b:', 'd:', 'dn:<tier>'.  It lives in the bucket hash, beside
        the bucket's fields, so a pick reads a pool's whole state with one HMGET and writes it
        with one HSET."""
        return self.bucket(pool)

    def stats(self, pool: str) -> str:
        """Hash: counters (dispatched, tokens per tier, drops...) of one pool."""
        return f"{self.pool_tag(pool)}stats"

    def demand(self, pool: str, tier: str, hour: int) -> str:
        """Hash (TTL ``DEMAND_RETENTION_S``): one tier's demand on a pool in one clock hour
        (hour = epoch seconds // 3600): ``demand_fields(m)`` = requests and estimated tokens
        enqueued in minute m of it (written with each enqueue: lua/dispatch/enqueue.lua;
        read by gateway_tasks/capacity/history.py).  At most 120 small fields: a listpack."""
        return f"{self.pool_tag(pool)}demand:{tier}:{hour}"

    def bell(self, pool: str) -> str:
        """List: wake-up tokens for a pool's idle dispatchers, one per token refund
        (lua/bucket/settle.lua) while a dispatcher waits for the bucket (``wait_until_ms`` in the
        bucket hash, written by lua/dispatch/pick.lua): tokens concern every tier.  Work that becomes
        dispatchable -- an enqueue, a task put back, a tenant unparked -- rings its tier's
        ``tier_bell`` instead."""
        return f"{self.pool_tag(pool)}bell"

    def tier_bell(self, pool: str, tier: str) -> str:
        """List: wake-up tokens for the dispatchers that serve one tier of a pool, one per
        enqueue into it (lua/dispatch/enqueue.lua).  Apart from the pool's ``bell`` so that an arrival
        wakes a dispatcher that can pick it: with per-tier workers (deploy/k8s) a batch-only
        dispatcher took a vip arrival's token from the pool bell and the vip one slept until
        its poll timeout (up to 1 s).  A dispatcher waits on the bells of the tiers it serves
        and on the pool's bell, which token refunds ring; a release that puts a task back or
        unparks its tenant (lua/dispatch/release.lua) rings the task's tier's bell."""
        return f"{self.pool_tag(pool)}tbell:{tier}"

    def reserved_bell(self, pool: str) -> str:
        """List: wake-up tokens for a pool's dispatchers whose only free slots are kept for
        reserved tiers' interactive work: rung (besides ``tier_bell``) by lua/dispatch/enqueue.lua for such
        a task, so they wake for it and leave other arrivals' tokens to dispatchers that can
        take them (gateway_tasks/dispatch/transport.py)."""
        return f"{self.pool_tag(pool)}bell:reserved"

    def dispatcher_bell(self, pool: str, dispatcher: str) -> str:
        """List: the wake-up of one dispatcher waiting while only its kept slots (for reserved
        tiers' interactive work) are free: pushed by lua/dispatch/release.lua when one of its own tasks
        ends, so it picks other work again at once (gateway_tasks/dispatch/transport.py).  Expires by itself."""
        return f"{self.pool_tag(pool)}bell:{dispatcher}"

    def messages(self, pool: str) -> str:
        """Hash: delivery tag -> the Celery message (JSON) of every queued or dispatched
        task of one pool; the router never decodes it, it only hands it over."""
        return f"{self.pool_tag(pool)}messages"

    def index(self, pool: str, tier: str) -> str:
        """Sorted set (every score 0, ordered by member): one small entry per queued task
        of a tier, '<tenant>|<seq>|<tag>|<est>|<enq_ms>|<weight>'; each tenant's own
        FIFO is a lexicographic range of it (``gateway_tasks.dispatch.index_entry``)."""
        return f"{self.pool_tag(pool)}index:{tier}"

    def active(self, pool: str, tier: str) -> str:
        """Sorted set: tenant -> virtual start tag, for the tier's tenants that have
        queued work and are under their concurrency cap (tenant fair queuing)."""
        return f"{self.pool_tag(pool)}active:{tier}"

    def finish(self, pool: str) -> str:
        """Hash: tenant -> virtual finish tag of its last dispatched task."""
        return f"{self.pool_tag(pool)}finish"

    def parked(self, pool: str) -> str:
        """Hash: tenant -> tier, for tenants with queued work held out of their tier's
        active set because they are at their concurrency cap."""
        return f"{self.pool_tag(pool)}parked"

    def inflight(self, pool: str) -> str:
        """Hash: tenant id -> tasks dispatched to this pool, not yet acked (concurrency cap)."""
        return f"{self.pool_tag(pool)}inflight"

    def dispatched(self, pool: str) -> str:
        """Hash: delivery tag -> '<tier>|<index entry>' of every dispatched, unacked task."""
        return f"{self.pool_tag(pool)}dispatched"

    def dispatched_at(self, pool: str) -> str:
        """Sorted set: delivery tag -> lease expiry (ms, Redis clock); the lease sweep scans it."""
        return f"{self.pool_tag(pool)}dispatched-at"

    def seq(self, pool: str) -> str:
        """Integer: the pool's enqueue sequence (orders each tenant's FIFO)."""
        return f"{self.pool_tag(pool)}seq"

    def dead_letters(self, pool: str) -> str:
        """List (newest first, capped): JSON records of the pool's dead-lettered messages."""
        return f"{self.pool_tag(pool)}dead-letters"

    def learned(self, pool: str) -> str:
        """Hash: '<tenant>|<model>' -> learned completion length (EWMA) on one pool."""
        return f"{self.pool_tag(pool)}learned"

    def circuit(self, pool: str) -> str:
        """Hash: the pool's circuit breaker (state, failures, open_until_ms, probe_until_ms,
        opens, closes) -- lua/upstream/circuit.lua."""
        return f"{self.pool_tag(pool)}circuit"

    def moving(self, pool: str) -> str:
        """Hash: delivery tag -> JSON {tier, entry, message, ts_ms} of a reserved-tier task
        withdrawn from this pool (drained / circuit open) and being moved to a backup pool:
        the journal that puts it back if the mover dies (gateway_tasks/upstream/rescue.py)."""
        return f"{self.pool_tag(pool)}moving"

    def deferred(self, pool: str, tier: str) -> str:
        """Sorted set: task id -> deferred_until_ms of a tier's tasks for this pool that the load
        level deferred and holds (each one's ``held`` record says how to send it;
        lua/overload/defer_hold.lua).  Under the pool's tag: a deferral takes the place of the
        enqueue it puts off, on the same shard, so a storm deferred spreads as its pools do."""
        return f"{self.pool_tag(pool)}deferred:{tier}"

    # -- overload: one load level for the deployment (one hash tag, one slot) --
    @property
    def overload_state(self) -> str:
        """Hash: level, version, ts_ms, since_ms, reason, seen:<k> (last time the signal
        asked for level k), changes -- lua/overload/commit.lua."""
        return f"{self.prefix}{{overload}}:state"

    @property
    def overload_history(self) -> str:
        """List (newest first, trimmed): JSON {ts_ms, from, to, reason} of every level change."""
        return f"{self.prefix}{{overload}}:history"

    @property
    def overload_samples(self) -> str:
        """List (newest first, trimmed): JSON counter samples the controller's rates come from."""
        return f"{self.prefix}{{overload}}:samples"

    @property
    def overload_held(self) -> str:
        """Hash: tenant -> JSON {level, until_ms, reason} of the tenants held at the level they
        cause (gateway_tasks/overload/attribution.py) -- lua/overload/commit.lua."""
        return f"{self.prefix}{{overload}}:held"

    @property
    def dispatch_stats(self) -> str:
        """Hash: dispatcher round trips (picks, waits, dispatched), flushed by every worker."""
        return f"{self.prefix}dispatch"

    # -- results ------------------------------------------------------------
    def result(self, task_id: str) -> str:
        """String (JSON, TTL): Celery's stored result of a task (its Redis backend's own name,
        under global_keyprefix)."""
        return f"{self.prefix}celery-task-meta-{task_id}"

    def meta(self, task_id: str) -> str:
        """String (TTL): idempotency marker of a task submitted with a key: 'submitted', or for
        a cron run 'cron:<entry id>:<nominal ms>' (which run it is)."""
        return f"{self.prefix}meta:{task_id}"

    def task_owner(self, task_id: str) -> str:
        """String (TTL): tenant id that submitted a task (written by every submit path;
        the REST API shows a task to its owner only)."""
        return f"{self.prefix}task-owner:{task_id}"

    def chunks(self, task_id: str) -> str:
        """Stream (TTL): a streaming task's upstream chunks, then 'done' or 'error', for the
        API process waiting on them (``gateway_tasks.upstream.chunks``)."""
        return f"{self.prefix}chunks:{task_id}"
    def task_ref(self, task_id: str) -> str:
        """String (TTL): where a queued task sits, as ``task_ref_in`` -- the key of producers
        before the ref moved under its pool's tag (still read: ``lifecycle.cancel.read_refs``)."""
        return f"{self.prefix}task-ref:{task_id}"

    def task_ref_in(self, pool: str, task_id: str) -> str:
        """String (TTL): where a task queued on ``pool`` sits, '<pool>|<tier>|<tenant>|<delivery
        tag>|<index entry>' (lifecycle.cancel.TaskRef), written by lua/dispatch/enqueue.lua as it queues it;
        cancel and priority inheritance find the task by it."""
        return f"{self.pool_tag(pool)}ref:{task_id}"

    # -- one tenant's own records: one hash tag per tenant, so they stay in one slot
    def tenant_tag(self, tenant_id: str) -> str:
        """The common start of a tenant's own keys, hash tag included: 'gt:{t:acme}:'."""
        return f"{self.prefix}{{t:{tenant_id}}}:"

    def tenant_tasks(self, tenant_id: str) -> str:
        """Sorted set: task id -> submit time (ms) of the tenant's tasks, kept for the result
        TTL (``gateway task list``, gateway_tasks.producer.where.list_tasks)."""
        return f"{self.tenant_tag(tenant_id)}tasks"

    def tenant_usage(self, tenant_id: str, hour: int) -> str:
        """Hash (expires after the retention): the tenant's usage counters of one clock hour
        (hour = epoch s // 3600; gateway_tasks.usage.counters)."""
        return f"{self.tenant_tag(tenant_id)}usage:{hour}"

    # -- the Batch API (gateway_tasks.batches): only the index; the files are on disk
    def batch_file(self, tenant_id: str, file_id: str) -> str:
        """Hash: one of the tenant's files (id, filename, purpose, bytes, created_at, path)."""
        return f"{self.tenant_tag(tenant_id)}file:{file_id}"

    def batch_files(self, tenant_id: str) -> str:
        """Sorted set: file id -> created (s) of the tenant's files."""
        return f"{self.tenant_tag(tenant_id)}files"

    def batch_file_bytes(self, tenant_id: str) -> str:
        """Integer: bytes of the tenant's stored files (its cap: batch_max_tenant_bytes)."""
        return f"{self.tenant_tag(tenant_id)}file-bytes"

    def batch(self, tenant_id: str, batch_id: str) -> str:
        """Hash: one of the tenant's batches (its OpenAI fields, counts, input cursor)."""
        return f"{self.tenant_tag(tenant_id)}batch:{batch_id}"

    def batches(self, tenant_id: str) -> str:
        """Sorted set: batch id -> created (s) of the tenant's batches."""
        return f"{self.tenant_tag(tenant_id)}batches"

    def batch_inflight(self, tenant_id: str, batch_id: str) -> str:
        """Hash: line number -> JSON {task, custom_id} of a batch's lines submitted, not collected."""
        return f"{self.tenant_tag(tenant_id)}batch-inflight:{batch_id}"

    def batch_lock(self, tenant_id: str, batch_id: str) -> str:
        """String (short TTL): the runner advancing a batch now (one at a time)."""
        return f"{self.tenant_tag(tenant_id)}batch-lock:{batch_id}"

    @property
    def batches_active(self) -> str:
        """Set: '<tenant>|<batch id>' of every batch not finished yet (the runners' work)."""
        return f"{self.prefix}{{batches}}:active"

    def tenant_bucket(self, tenant_id: str) -> str:
        """Hash: tokens, ts_ms of one tenant's own TPM bucket (lua/tenants/quota_take.lua)."""
        return f"{self.tenant_tag(tenant_id)}tpm-bucket"

    def quota(self, tenant_id: str, hour: int) -> str:
        """Integer (TTL): tasks one tenant submitted in one clock hour, every path together
        (Python API, REST and cron fires: lua/tenants/quota_take.lua) (hour = epoch seconds //
        3600); the limit is the tier's max_tasks_per_hour.  Beside the tenant's TPM bucket,
        under its tag: one script takes both."""
        return f"{self.tenant_tag(tenant_id)}quota:{hour}"

    # -- one task's lifecycle records (depends_on, inheritance, cancel): one hash tag per task,
    # ``<prefix>{task:<id>}:``, so every script on one task's records stays in one slot and the
    # tasks spread over every shard.  An operation across tasks (a dependent and its
    # dependencies, a finishing task and its waiters, a chain of lenders) is a sequence of
    # single-slot scripts: gateway_tasks/lifecycle/depends.py says how it stays exact.
    def task_tag(self, task_id: str) -> str:
        """The common start of a task's lifecycle keys, hash tag included: 'gt:{task:<id>}:'."""
        return f"{self.prefix}{{task:{task_id}}}:"

    def held(self, task_id: str) -> str:
        """Hash (TTL): a task held until its dependencies finish -- pending (how many are still
        running, plus one while its submit registers it: the guard), send (how to send it,
        JSON), failed (a dependency that did not succeed), tier (the tier it waits at: its
        effective tier), deps (the ids it still waits on, one a line), c:<id> (that dependency
        is counted down: a release is counted once) -- or held deferred by the load level
        (lua/overload/defer_hold.lua)."""
        return f"{self.task_tag(task_id)}held"

    def waiters(self, task_id: str) -> str:
        """Set (TTL): ids of the held tasks that depend on this task."""
        return f"{self.task_tag(task_id)}waiters"

    def done(self, task_id: str) -> str:
        """String (short TTL): this task finished, 'ok' (succeeded) or 'failed' (any other end);
        bridges the moment until its result is stored (a later dependent reads the result)."""
        return f"{self.task_tag(task_id)}done"

    def lift(self, task_id: str) -> str:
        """Hash (TTL): priority inheritance of one task -- origin task id -> the tier it lends:
        each live higher-tier task that waits on this one, directly or down a chain of held
        tasks, or that it was submitted on behalf of (gateway_tasks.lifecycle.inherit)."""
        return f"{self.task_tag(task_id)}lift"

    def lifted(self, task_id: str) -> str:
        """Set (TTL): the tasks this task lends its tier to (its ``lift`` entries, taken back
        when it ends)."""
        return f"{self.task_tag(task_id)}lifted"

    def shared(self, task_id: str) -> str:
        """String (TTL): the tenant a task was submitted on behalf of (its ``on_behalf_of``
        task's owner), which may then name it in ``depends_on`` besides its own owner."""
        return f"{self.task_tag(task_id)}shared"

    def cancelled(self, task_id: str) -> str:
        """String (TTL): a cancelled task's reason ('queued' | 'running' | 'waiting' | 'deferred'
        | 'gone'); the worker, the lease sweep and a requeue check it, so a cancelled task never
        runs or comes back, and lua/lifecycle/deps_done.lua reads it beside the task's done mark."""
        return f"{self.task_tag(task_id)}cancelled"

    def attempts(self, task_id: str) -> str:
        """Integer (TTL): upstream attempts of one task (retry budget)."""
        return f"{self.prefix}attempts:{task_id}"

    # -- beat (tenant crons): the schedule under one hash tag, ``<prefix>{beat}:``, one slot --
    # one leader beat works it (beat.lock), every script and transaction on it stays in that
    # slot.  Registration's transaction (beat.store.CronStore.add) checks a tenant's crons
    # against its tier's limits atomically with writing the entry, so the tenant's cron id set
    # is a schedule key too (here, not under the tenant's tag): it is touched only when a cron
    # is registered, deleted or listed, never by a submit or a fire.  The hourly quota a fire
    # takes is the tenant's (``quota``, its tag): beat takes it in its own step.
    @property
    def beat_tag(self) -> str:
        """The common start of the schedule's keys, hash tag included: 'gt:{beat}:'."""
        return f"{self.prefix}{{beat}}:"

    def cron(self, entry_id: str) -> str:
        """Hash: one cron definition."""
        return f"{self.beat_tag}cron:{entry_id}"

    @property
    def cron_due(self) -> str:
        """Sorted set: entry id -> next actual fire time (ms since epoch)."""
        return f"{self.beat_tag}due"

    @property
    def cron_retry(self) -> str:
        """Sorted set: '<entry id>|<nominal ms>' of a run the load level deferred -> when beat
        tries it again (ms since epoch; beat.engine, beat.schedule.deferred_retry_ms)."""
        return f"{self.beat_tag}retry"

    def cron_tenant(self, tenant_id: str) -> str:
        """Set: entry ids of one tenant."""
        return f"{self.beat_tag}tenant-crons:{tenant_id}"

    @property
    def beat_lock(self) -> str:
        """String: the id of the active beat process (short TTL)."""
        return f"{self.beat_tag}lock"

    def cron_fired(self, entry_id: str, nominal_ms: int) -> str:
        """String (TTL): idempotency key of one (entry, nominal time) firing."""
        return f"{self.beat_tag}fired:{entry_id}:{nominal_ms}"

    @property
    def cron_stats(self) -> str:
        """Hash: beat outcome counters (fired, quota, misfire, duplicate, ...)."""
        return f"{self.beat_tag}stats"

    def cron_payload(self, entry_id: str) -> str:
        """String: JSON payload (messages, model, max_tokens) of one cron, kept out
        of its hash so the hash stays a compact listpack."""
        return f"{self.beat_tag}payload:{entry_id}"

    @property
    def cron_forecast(self) -> str:
        """String (TTL): JSON token-demand forecast of the cron schedule per pool and tier,
        published by the leader beat (``gateway_tasks.capacity.forecast``)."""
        return f"{self.beat_tag}forecast"

    # -- pub/sub channels of the API processes (not keys: no slot; named here with the keys)
    @property
    def tenants_changed(self) -> str:
        """A tenant's key or registration changed: API processes drop what their auth cache
        kept of it (gateway_tasks.tenants.auth_cache; the message is the tenant id)."""
        return f"{self.prefix}tenants-changed"

    def reply_channel(self, waiter_id: str) -> str:
        """One API process's result waiter: its tasks' final metas are published there too
        (gateway_tasks.rest.result_waiter, lua/core/result_store.lua)."""
        return f"{self.prefix}reply:{waiter_id}"
