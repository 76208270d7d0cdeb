"""The producer API: validate, estimate tokens, route to the tier's queue.

    gw = Gateway(settings)
    handle = gw.submit("acme", [{"role": "user", "content": "hi"}], max_tokens=64)
    handle.get(timeout=30)   # {'response': ..., 'timing': ..., 'tokens': ..., 'tier': ...}

Nothing is enqueued unless every check passes; each failure is a subclass of
GatewayError saying what was wrong.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Sequence

import redis
from celery import Celery
from celery.result import AsyncResult

from gateway_tasks.core.celery_app import TASK_NAME, make_app
from gateway_tasks.core.errors import InvalidRequest, PromptTooLarge
from gateway_tasks.core.health import choose_pool, read_health
from gateway_tasks.core.keys import Keys, learned_field
from gateway_tasks.core.overload_actions import degrade, deferral
from gateway_tasks.core.request import InferenceRequest
from gateway_tasks.core.settings import Pool, Settings, Tier, get_settings
from gateway_tasks.core.tenants import Tenant, TenantRegistry
from gateway_tasks.core.tokens import count_prompt_tokens, validate_messages

IDEMPOTENCY_NAMESPACE = uuid.UUID("6f1d3c1e-4b7a-4d55-9a51-2b8c9e1f0a77")
LEARNED_MARGIN = 1.2  # learned completion estimates are padded by 20%


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
        self.r = client or redis.Redis.from_url(self.app.conf.broker_url)
        self.keys = Keys(self.settings.key_prefix)
        self.tenants = TenantRegistry(self.r, self.settings)

    def register_tenant(self, tenant_id: str, tier: str, api_key: str | None = None,
                        weight: float = 1.0) -> str:
        """Register (or update) a tenant; returns its API key.  ``weight``: its share
        against the other tenants of its tier (default 1)."""
        return self.tenants.register(tenant_id, tier, api_key, weight)[1]

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
                                degradation=changes)

    def submit(self, tenant_id: str, messages: Sequence[dict[str, Any]] | str, *,
               model: str | None = None, max_tokens: int | None = None,
               deadline_s: float | None = None, source: str = "api",
               idempotency_key: str | None = None,
               extra_body: dict[str, Any] | None = None) -> TaskHandle:
        """Validate, estimate and enqueue one inference task on its tier's queue."""
        if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                       or not deadline_s > 0):
            raise InvalidRequest(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
        if extra_body is not None:
            if not isinstance(extra_body, dict):
                raise InvalidRequest("extra_body must be an object of upstream parameters")
            clash = set(extra_body) & {"model", "messages", "max_tokens", "stream"}
            if clash:
                raise InvalidRequest(f"extra_body may not set {sorted(clash)}; use the arguments")
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
                          deadline_s=deadline_s, source=source, extra_body=extra_body or {})
        except Exception:
            if owned:
                self.r.delete(self.keys.task_owner(task_id))
            raise
        if idempotency_key is not None:
            first = self.r.set(self.keys.meta(task_id), "submitted", nx=True,
                               ex=self.settings.result_ttl_s)
            if not first:
                return self._handle(task_id, req)
        try:
            self.app.send_task(
                TASK_NAME, args=[req.to_body()], task_id=task_id, queue=self._queue(req),
                headers=req.routing_headers(), argsrepr=req.argsrepr(), kwargsrepr="{}")
        except Exception:
            self.r.delete(self.keys.task_owner(task_id))
            if idempotency_key is not None:
                self.r.delete(self.keys.meta(task_id))
            raise
        return self._handle(task_id, req)

    def _queue(self, req: InferenceRequest) -> str:
        return self.settings.queue_name(req.tier, req.pool)

    def _handle(self, task_id: str, req: InferenceRequest) -> TaskHandle:
        return TaskHandle(task_id, req.tenant_id, req.tier, self._queue(req), req.model,
                          req.prompt_tokens, req.est_tokens, self.app)

    def result(self, task_id: str) -> AsyncResult:
        return AsyncResult(task_id, app=self.app)


@lru_cache(maxsize=1)
def default_gateway() -> Gateway:
    return Gateway(get_settings())


def submit(tenant_id: str, messages: Sequence[dict[str, Any]] | str, *, model: str | None = None,
           max_tokens: int | None = None, deadline_s: float | None = None) -> TaskHandle:
    """Submit through the process-wide gateway configured from the environment."""
    return default_gateway().submit(tenant_id, messages, model=model, max_tokens=max_tokens,
                                    deadline_s=deadline_s)
