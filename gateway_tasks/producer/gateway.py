"""The producer API: validate, estimate tokens, route to the tier's queue.

    gw = Gateway(settings)
    handle = gw.submit("acme", [{"role": "user", "content": "hi"}], max_tokens=64)
    handle.get(timeout=30)   # {'response': ..., 'timing': ..., 'tokens': ..., 'tier': ...}

Nothing is enqueued unless every check passes; each failure is a subclass of
GatewayError saying what was wrong.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Sequence

import redis
from celery import Celery, states
from celery.result import AsyncResult

from gateway_tasks.core.celery_app import TASK_NAME, make_app
from gateway_tasks.core import depends
from gateway_tasks.core.cancel import GONE, QUEUED, RUNNING, CancelCall, find_entry, read_refs
from gateway_tasks.core.errors import (DependencyFailed, Evicted, InvalidRequest, PromptTooLarge, QueueFull,
                                       TaskCancelled, UnknownTask)
from gateway_tasks.core.evict import (EVICTED_BY_HIGHER_TIER, POOL_FULL, EvictCall, throttle_retry_after_s,
                                      tiers_below)
from gateway_tasks.core.health import choose_pool, read_health
from gateway_tasks.core.keys import Keys, learned_field
from gateway_tasks.core.lanes import INTERACTIVE, lane_for
from gateway_tasks.core.overload_actions import degrade, deferral
from gateway_tasks.core.quota import QuotaRefundCall, QuotaTakeCall, effective_tpm
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.stats import CANCELLED, EVICTED, tier_field
from gateway_tasks.core.request import MAX_DEADLINE_S, InferenceRequest
from gateway_tasks.core.settings import Pool, Settings, Tier, get_settings
from gateway_tasks.core.tenants import Tenant, TenantRegistry
from gateway_tasks.core.tokens import count_prompt_tokens, validate_messages
from gateway_tasks.core.packer import connection_kwargs
from gateway_tasks.core.redis_failures import redis_errors
from gateway_tasks.producer.memory_guard import MIB, MemoryGuard, submit_bytes

IDEMPOTENCY_NAMESPACE = uuid.UUID("6f1d3c1e-4b7a-4d55-9a51-2b8c9e1f0a77")
LEARNED_MARGIN = 1.2  # learned completion estimates are padded by 20%
CANCEL_TRIES = 3      # a task caught between dispatch and requeue is looked for again
EVICT_TRIES = 3       # evictions one arrival may make (parallel arrivals can take the room freed)
ALREADY_CANCELLED, FINISHED, WAITING = "already_cancelled", "finished", "waiting"


@dataclass(frozen=True)
class Cancelled:
    """What ``Gateway.cancel`` did: ``was`` is 'queued' (removed: it never reaches the
    upstream), 'waiting' (held on its depends_on: dropped), 'running' (revoked: a call in
    flight finishes and its result is discarded),
    'gone' (neither queued nor running yet -- being published, or lost -- marked so it never
    runs), 'already_cancelled', or 'finished' (nothing to cancel: ``status`` says how it ended)."""

    task_id: str
    was: str
    status: str

    @property
    def cancelled(self) -> bool:
        return self.was != FINISHED


@dataclass(frozen=True)
class TaskHandle:
    id: str
    tenant_id: str
    tier: str
    queue: str
    model: str
    prompt_tokens: int
    est_tokens: int
    app: Celery
    lane: str = INTERACTIVE   # interactive | scheduled (gateway_tasks.core.lanes)

    @property
    def async_result(self) -> AsyncResult:
        return AsyncResult(self.id, app=self.app)

    @property
    def status(self) -> str:
        return self.async_result.status

    def get(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the result; re-raises the task's error if it failed."""
        return self.async_result.get(timeout=timeout, interval=0.05)


class Gateway:
    """Producer side of one deployment (one Redis, one key prefix)."""

    def __init__(self, settings: Settings | None = None, *, app: Celery | None = None,
                 client: redis.Redis | None = None):
        self.settings = settings or get_settings()
        self.app = app or make_app(self.settings)
        self.r = client or redis.Redis.from_url(self.app.conf.broker_url, **connection_kwargs())
        self.keys = Keys(self.settings.key_prefix)
        self._pool_names = tuple(p.name for p in self.settings.pools)
        self.tenants = TenantRegistry(self.r, self.settings)
        self.memory = MemoryGuard(self.r, self.settings.redis_memory_refuse_ratio,
                                  reserve_bytes=int(self.settings.redis_memory_reserve_mib * MIB))

    def register_tenant(self, tenant_id: str, tier: str, api_key: str | None = None,
                        weight: float = 1.0, tpm: int = 0) -> str:
        """Register (or update) a tenant; returns its API key.  ``weight``: its share
        against the other tenants of its tier (default 1); ``tpm``: its own tokens-per-
        minute quota (default 0: its tier's ``tenant_tpm``)."""
        return self.tenants.register(tenant_id, tier, api_key, weight, tpm)[1]

    def load_level(self) -> tuple[int, str]:
        """The deployment's load level now and why (L0 when no controller ran)."""
        return self._level_of(self.r.hmget(self.keys.overload_state, "level", "reason"))

    def _level_of(self, raw: list[bytes | None]) -> tuple[int, str]:
        if not self.settings.overload.enabled:
            return 0, ""
        level, reason = raw
        return (int(level) if level else 0), (reason or b"").decode()

    def _overload(self, tier: Tier, pool: Pool, model: str, max_tokens: int, level: int,
                  reason: str) -> tuple[Pool, str, int, dict[str, Any]]:
        """The level's actions on a valid request: deferral (raises), max_tokens cap and model
        fallback of degradable tiers; a reserved tier goes to a backup pool while its pool is
        unavailable.  Returns (pool, model, max_tokens, what changed)."""
        refused = deferral(tier, level, reason)
        if refused is not None:
            raise refused
        served = {m for p in self.settings.pools for m in p.models}
        d = degrade(self.settings.overload, tier, level, model, max_tokens,
                    lambda m: self.settings.overload.fallback_for(m, pool.fallback_model),
                    lambda m: m in served)
        changes: dict[str, Any] = {}
        if d.changed:
            changes = {"level": level, "requested_max_tokens": max_tokens, "requested_model": model}
            if d.substituted:
                pool = self.settings.pool_for_model(d.model)
        return pool, d.model, d.max_tokens, changes

    def _route(self, tier: Tier, pool: Pool, model: str, est_tokens: int) -> tuple[Pool, str, str]:
        """A reserved tier's pool: a backup while its own is unavailable (circuit open,
        drained by a 429, or its bucket cannot admit within the tier's max wait).
        Returns (pool, model, reason); reason "" = no failover."""
        if tier.reserved_share <= 0 or not pool.backup_pools:
            return pool, model, ""
        backups = [self.settings.pool(n) for n in pool.backup_pools]
        health = read_health(self.r, self.keys, [pool, *backups])
        route = choose_pool(pool, backups, health, est_tokens, tier.max_wait_ms)
        if not route.reason:
            return pool, model, ""
        target = route.pool
        return target, (model if model in target.models else target.model), route.reason

    def estimate(self, tenant_id: str, messages: Any, model: str | None = None,
                 max_tokens: int | None = None, *, tenant: Tenant | None = None,
                 level: int | None = None, reason: str = "") -> InferenceRequest:
        """Validate a request and compute its routing and token estimate (enqueues nothing).
        ``tenant``: the tenant's record when the caller read it already.  ``level``: the load
        level to apply, ``reason`` its cause (None: the deployment's now); a tier deferred at
        that level raises ``Deferred``."""
        tenant = tenant or self.tenants.get(tenant_id)
        tier = self.settings.tier(tenant.tier)
        msgs = validate_messages(messages)
        if max_tokens is None:
            max_tokens = self.settings.default_max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
        try:
            pool = self.settings.pool_for_model(model)
        except Exception as exc:  # ConfigError -> the caller's mistake here
            raise InvalidRequest(str(exc)) from None
        model = model or pool.model
        if level is None:
            level, reason = self.load_level()
        pool, model, max_tokens, changes = self._overload(tier, pool, model, max_tokens, level, reason)
        prompt_tokens = count_prompt_tokens(msgs)
        total = prompt_tokens + max_tokens
        if total > self.settings.max_prompt_tokens:
            raise PromptTooLarge(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"the limit of {self.settings.max_prompt_tokens} tokens")
        if total > pool.token_capacity:
            raise PromptTooLarge(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"pool {pool.name!r}'s bucket capacity of {int(pool.token_capacity)} tokens "
                f"(TPM {pool.tpm}); it could never be admitted")
        requested_pool, requested_model = pool.name, model
        pool, model, failover = self._route(tier, pool, model, total)
        if failover:
            changes = {"level": level, "requested_max_tokens": max_tokens,
                       "requested_model": changes.get("requested_model", requested_model), **changes,
                       "requested_pool": requested_pool, "failover": failover}
        completion_est = max_tokens
        if pool.charge == "actual":
            learned = self.r.hget(self.keys.learned(pool.name), learned_field(tenant_id, model))
            if learned is not None:
                completion_est = min(max_tokens, max(1, math.ceil(float(learned) * LEARNED_MARGIN)))
        return InferenceRequest(tenant_id=tenant_id, tier=tier.name, pool=pool.name, model=model,
                                messages=msgs, max_tokens=max_tokens, prompt_tokens=prompt_tokens,
                                est_tokens=prompt_tokens + completion_est, tenant_weight=tenant.weight,
                                tenant_tpm=effective_tpm(tenant.tpm, tier.tenant_tpm),
                                degradation=changes)

    def submit(self, tenant_id: str, messages: Sequence[dict[str, Any]] | str, *,
               model: str | None = None, max_tokens: int | None = None,
               deadline_s: float | None = None, source: str = "api",
               idempotency_key: str | None = None,
               extra_body: dict[str, Any] | None = None, stream: bool = False,
               count_quota: bool = True, depends_on: Sequence[str] | None = None,
               lane: str | None = None) -> TaskHandle:
        """Validate, estimate and enqueue one inference task on its tier's queue
        (``stream``: the worker publishes the upstream's chunks, ``gateway_tasks.core.chunks``).

        ``lane``: "interactive" (someone waits) or "scheduled" (it tolerates seconds of delay:
        inside its tier it yields to interactive work by the tier's ``scheduled_lag_tokens``,
        ``gateway_tasks.core.lanes``); None: scheduled for ``source="cron"``, else interactive.
        Redis down or full: RedisUnavailable / RedisFull, and nothing is enqueued.

        The tenant's quotas are taken first, atomically (``gateway_tasks.core.quota``):
        ``QuotaExceeded`` (reason, retry_after_s) when its tier's ``max_tasks_per_hour``
        or its TPM quota is spent.  ``count_quota=False``: the hourly count was taken
        elsewhere (a cron fire, counted by cron_fire.lua); the TPM quota still applies.

        ``depends_on``: ids of tasks (any tenant's: ids are unguessable) that must finish
        first; the task is held, taking no queue space, until they have, then queued
        (``gateway_tasks.core.depends``).  An unknown id is ``UnknownTask``; a dependency
        that did not succeed fails it with ``DependencyFailed``."""
        with redis_errors("submit", "nothing was enqueued"):
            return self._submit(tenant_id, messages, model=model, max_tokens=max_tokens,
                                deadline_s=deadline_s, source=source, idempotency_key=idempotency_key,
                                extra_body=extra_body, stream=stream, count_quota=count_quota,
                                depends_on=depends_on, lane=lane)

    def _submit(self, tenant_id: str, messages: Sequence[dict[str, Any]] | str, *,
                model: str | None, max_tokens: int | None, deadline_s: float | None, source: str,
                idempotency_key: str | None, extra_body: dict[str, Any] | None,
                stream: bool = False, count_quota: bool = True,
                depends_on: Sequence[str] | None = None, lane: str | None = None) -> TaskHandle:
        if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                       or not 0 < deadline_s <= MAX_DEADLINE_S):
            raise InvalidRequest(f"deadline_s must be a positive number of seconds up to {MAX_DEADLINE_S} "
                                 f"(7 days), got {deadline_s!r}")
        if extra_body is not None:
            if not isinstance(extra_body, dict):
                raise InvalidRequest("extra_body must be an object of upstream parameters")
            clash = set(extra_body) & {"model", "messages", "max_tokens", "stream", "stream_options"}
            if clash:
                raise InvalidRequest(f"extra_body may not set {sorted(clash)}; use the arguments")
        lane = lane_for(source, lane)
        self.memory.check()
        task_id = str(uuid.uuid4())
        if idempotency_key is not None:
            task_id = str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, f"{tenant_id}:{idempotency_key}"))
        # one round trip: the tenant's record, and the task's owner written ahead (a
        # request found invalid below takes it back)
        record, owned, level = {}, False, [None, None]
        if isinstance(tenant_id, str):   # and the load level (overload), in the same round trip
            with self.r.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.keys.tenant(tenant_id))
                pipe.set(self.keys.task_owner(task_id), tenant_id, ex=self.settings.result_ttl_s, nx=True)
                pipe.hmget(self.keys.overload_state, "level", "reason")
                record, owned, level = pipe.execute()
        level_now, reason = self._level_of(level)
        try:
            req = replace(self.estimate(tenant_id, messages, model, max_tokens,
                                        tenant=TenantRegistry.from_record(tenant_id, record),
                                        level=level_now, reason=reason),
                          deadline_s=deadline_s, source=source, extra_body=extra_body or {},
                          stream=bool(stream), lane=lane)
            deps = self._dependencies(depends_on)
        except Exception:
            if owned:
                with contextlib.suppress(redis.RedisError):
                    self.r.delete(self.keys.task_owner(task_id))
            raise
        if idempotency_key is not None:
            first = self.r.set(self.keys.meta(task_id), "submitted", nx=True,
                               ex=self.settings.result_ttl_s)
            if not first:
                return self._handle(task_id, req)
        try:
            take = self._take_quota(req, count_quota)
        except Exception:
            with contextlib.suppress(redis.RedisError):   # Redis may be what failed
                if owned:
                    self.r.delete(self.keys.task_owner(task_id))
                if idempotency_key is not None:
                    self.r.delete(self.keys.meta(task_id))
            raise
        try:
            if not deps or not self._hold(req, task_id, deps):
                self._send(req, task_id)
        except Exception:
            with contextlib.suppress(redis.RedisError):   # Redis may be what failed
                scripts_for(self.r).run(QuotaRefundCall(take, counted=count_quota))
                self.r.delete(self.keys.task_owner(task_id))
                if idempotency_key is not None:
                    self.r.delete(self.keys.meta(task_id))
            raise
        # counted against the memory limit until the guard's next INFO read sees it
        self.memory.charge(submit_bytes(len(json.dumps(req.messages)) + len(json.dumps(req.extra_body))))
        return self._handle(task_id, req)

    def _dependencies(self, depends_on: Sequence[str] | None) -> tuple[str, ...]:
        if depends_on is None:
            return ()
        try:
            deps = depends.dependency_ids(depends_on)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        with self.r.pipeline(transaction=False) as pipe:
            for dep in deps:
                pipe.exists(self.keys.task_owner(dep))
            known = pipe.execute()
        unknown = [d for d, ok in zip(deps, known) if not ok]
        if unknown:
            raise UnknownTask(f"depends_on names unknown tasks: {unknown}")
        return deps

    def _hold(self, req: InferenceRequest, task_id: str, deps: tuple[str, ...]) -> bool:
        """Hold the task on its dependencies; False when none is running any more (send it now)."""
        finished = depends.finished_outcomes(self.app, self.r, deps)
        failed = next((d for d, outcome in finished.items() if outcome != depends.OK), "")
        if failed:
            raise DependencyFailed(f"task {failed} (in depends_on) did not succeed; this task "
                                   f"was not queued", None, "dependency_failed")
        running = tuple(d for d in deps if d not in finished)
        if not running:
            return False
        spec = depends.send_spec(task_id, self._queue(req), req.to_body(), req.routing_headers(), req.argsrepr())
        held = scripts_for(self.r).run(depends.DependCall(self.keys, task_id, running, spec,
                                                          self.settings.result_ttl_s * 1000))
        if held.pending == 0 and held.failed:
            raise DependencyFailed(f"task {held.failed} (in depends_on) did not succeed; this task "
                                   f"was not queued", None, "dependency_failed")
        if held.pending > 0:
            self._inherit(req, running)
        return held.pending > 0

    def _inherit(self, req: InferenceRequest, deps: tuple[str, ...]) -> None:
        """Priority inheritance: each dependency queued in a lower tier than this task is
        dispatched at this task's tier's priority (lua/boost.lua, then lua/pick.lua)."""
        rank = self.settings.tier_rank(req.tier)
        for ref in read_refs(self.r, self.keys, self._pool_names, deps).values():
            if ref.entry and self.settings.tier_rank(ref.tier) > rank:
                scripts_for(self.r).run(depends.BoostCall(self.keys, ref.pool, ref.tier, req.tier, ref.entry))

    def _send(self, req: InferenceRequest, task_id: str) -> None:
        """Publish the task; when its pool's shared queue capacity is full, evict the newest
        queued task of the lowest tier below it and try again (``gateway_tasks.core.evict``)."""
        below = tiers_below(self.settings, req.tier)
        lower = tuple(t.name for t in below)
        lags = tuple(t.scheduled_lag_tokens for t in below)
        for attempt in range(EVICT_TRIES + 1):
            try:
                self.app.send_task(
                    TASK_NAME, args=[req.to_body()], task_id=task_id, queue=self._queue(req),
                    headers=req.routing_headers(), argsrepr=req.argsrepr(), kwargsrepr="{}")
                return
            except QueueFull as exc:
                if exc.reason != POOL_FULL or not lower or attempt == EVICT_TRIES:
                    raise
                victim = scripts_for(self.r).run(EvictCall(self.keys, req.pool, lower, lags))
                if victim is None:      # nothing below it queued: only its peers (or higher) fill the pool
                    raise QueueFull(f"{exc}; no lower-tier task is queued to make room for this "
                                    f"{req.tier} request", exc.retry_after_s, POOL_FULL) from None
                self._fail_evicted(victim, req)

    def _fail_evicted(self, victim: Any, by: InferenceRequest) -> None:
        """The evicted task's result: Evicted, with a throttle reason and when to retry."""
        self.r.hincrby(self.keys.stats(by.pool), tier_field(EVICTED, victim.tier), 1)
        if victim.task_id is None:
            return
        self._finished(victim.task_id)
        retry_s = throttle_retry_after_s(self.settings.tier(victim.tier))
        self.app.backend.store_result(victim.task_id, Evicted(
            f"task {victim.task_id} ({victim.tier}) was evicted from the full queue of pool "
            f"{by.pool!r} to make room for a {by.tier} request; it never reached the upstream; "
            f"retry in {retry_s:g} s", retry_s, EVICTED_BY_HIGHER_TIER), states.FAILURE)

    def _take_quota(self, req: InferenceRequest, count_quota: bool) -> QuotaTakeCall:
        """Take the task from its tenant's hourly and TPM quotas (both or neither), or raise
        QuotaExceeded saying which, its limit and when to retry."""
        tier = self.settings.tier(req.tier)
        take = QuotaTakeCall(self.keys, req.tenant_id, int(time.time() * 1000),   # the hour, as beat names it
                             tier.max_tasks_per_hour if count_quota else 0, req.est_tokens, req.tenant_tpm)
        take.check_fits()
        taken = scripts_for(self.r).run(take)
        if not taken.ok:
            raise take.refusal(taken)
        return take

    def _queue(self, req: InferenceRequest) -> str:
        return self.settings.queue_name(req.tier, req.pool)

    def _handle(self, task_id: str, req: InferenceRequest) -> TaskHandle:
        return TaskHandle(task_id, req.tenant_id, req.tier, self._queue(req), req.model,
                          req.prompt_tokens, req.est_tokens, self.app, req.lane)

    def result(self, task_id: str) -> AsyncResult:
        return AsyncResult(task_id, app=self.app)

    def owner(self, task_id: str) -> str | None:
        """The tenant that submitted a task (None: unknown id, or its record expired)."""
        owner = self.r.get(self.keys.task_owner(task_id))
        return owner.decode() if owner else None

    def cancel(self, task_id: str, tenant_id: str | None = None) -> Cancelled:
        """Cancel a task.  Queued: its index entry and message go together (lua/cancel.lua),
        so it never reaches the upstream.  Running: revoked, and marked so the worker
        discards its result and no requeue or lease sweep puts it back.  Its result becomes
        ``TaskCancelled`` (reason 'queued' | 'running').  ``tenant_id``: only that tenant's
        task (anyone else's id is ``UnknownTask``, as if it did not exist)."""
        owner = self.owner(task_id)
        if owner is None or (tenant_id is not None and owner != tenant_id):
            raise UnknownTask(f"no task {task_id!r}" + (f" for tenant {tenant_id!r}" if tenant_id else ""))
        if self.r.exists(self.keys.cancelled(task_id)):
            return Cancelled(task_id, ALREADY_CANCELLED, states.FAILURE)
        status = self._status(task_id)
        if status in states.READY_STATES:
            return Cancelled(task_id, FINISHED, status)
        if self.r.delete(self.keys.held(task_id)):     # held on its depends_on: never queued
            self.r.set(self.keys.cancelled(task_id), WAITING, ex=self.settings.result_ttl_s)
            self._store_cancelled(task_id, WAITING, "cancelled while it waited on its depends_on; "
                                                    "it was never queued")
            return Cancelled(task_id, WAITING, states.FAILURE)
        ref = read_refs(self.r, self.keys, self._pool_names, [task_id]).get(task_id)
        was = GONE
        if ref is not None:
            lag = next((t.scheduled_lag_tokens for t in self.settings.tiers if t.name == ref.tier), 0)
            for _ in range(CANCEL_TRIES):
                was = scripts_for(self.r).run(CancelCall(self.keys, task_id, ref, find_entry(self.r, self.keys, ref),
                                                         self.settings.result_ttl_s * 1000, lag))
                if was != GONE or self._status(task_id) in states.READY_STATES:
                    break
        if was == GONE:
            status = self._status(task_id)
            if status in states.READY_STATES:
                return Cancelled(task_id, FINISHED, status)
            self.r.set(self.keys.cancelled(task_id), GONE, ex=self.settings.result_ttl_s)
        if was in (QUEUED, RUNNING):
            self.r.hincrby(self.keys.stats(ref.pool), tier_field(CANCELLED, ref.tier), 1)
        if was == RUNNING:
            self.app.control.revoke(task_id)
        message = {QUEUED: "cancelled while queued; it never reached the upstream",
                   RUNNING: "cancelled while running; it was revoked and its result is discarded",
                   GONE: "cancelled before it was queued or after it was lost; it will not run"}[was]
        self._store_cancelled(task_id, was, message)
        return Cancelled(task_id, was, states.FAILURE)

    def _store_cancelled(self, task_id: str, was: str, message: str) -> None:
        self.app.backend.store_result(task_id, TaskCancelled(f"task {task_id} {message}", None, was),
                                      states.FAILURE)
        self._finished(task_id)

    def _finished(self, task_id: str) -> None:
        """A task ended here (cancelled, evicted): release what waits on it."""
        depends.finish(self.app, self.r, self.keys, self.settings.result_ttl_s, task_id, ok=False)

    def _status(self, task_id: str) -> str:
        return str(self.app.backend.get_task_meta(task_id).get("status") or states.PENDING)


@lru_cache(maxsize=1)
def default_gateway() -> Gateway:
    return Gateway(get_settings())


def submit(tenant_id: str, messages: Sequence[dict[str, Any]] | str, *, model: str | None = None,
           max_tokens: int | None = None, deadline_s: float | None = None) -> TaskHandle:
    """Submit through the process-wide gateway configured from the environment."""
    return default_gateway().submit(tenant_id, messages, model=model, max_tokens=max_tokens,
                                    deadline_s=deadline_s)
