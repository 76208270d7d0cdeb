"""The producer API: validate, estimate tokens, route to the tier's queue.

    gw = Gateway(settings)
    handle = gw.submit("acme", [{"role": "user", "content": "hi"}], max_tokens=64)
    handle.get(timeout=30)   # {'response': ..., 'timing': ..., 'tokens': ..., 'tier': ...}

Nothing is enqueued unless every check passes; each failure is a subclass of
GatewayError saying what was wrong.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import redis
from celery import Celery
from celery.result import AsyncResult

from gateway_tasks.core.redis_client import data_client
from gateway_tasks.core.celery_app import make_app, settings_of
from gateway_tasks.core.errors import Deferred, Rejected, TaskNotFound
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.usage import counters as usage
from gateway_tasks.lifecycle import depends
from gateway_tasks.core.keys import Keys
from gateway_tasks.dispatch.lanes import INTERACTIVE
from gateway_tasks.dispatch.request import CHAT, InferenceRequest
from gateway_tasks.overload.deferral import HOLD, Deferral
from gateway_tasks.core.settings import Settings, get_settings
from gateway_tasks.tenants.registry import Tenant, TenantRegistry
from gateway_tasks.core.errors import UnknownTask
from gateway_tasks.core.redis_failures import redis_errors
from gateway_tasks.producer.cancel import ALREADY_CANCELLED, FINISHED, WAITING, Cancelled, cancel_task
from gateway_tasks.producer.memory_guard import MIB, MemoryGuard
from gateway_tasks.producer.submission import IDEMPOTENCY_NAMESPACE, Asked, Submission, estimate_request

__all__ = ["ALREADY_CANCELLED", "FINISHED", "IDEMPOTENCY_NAMESPACE", "WAITING", "Cancelled", "Gateway",
           "TaskHandle", "TaskResult", "default_gateway", "submit", "task_known"]


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
    lane: str = INTERACTIVE   # interactive | scheduled (gateway_tasks.dispatch.lanes)
    # accepted but deferred by the load level: held, not queued, until deferral.until_ms at
    # the latest (sooner when the level falls); None = queued (or held on its depends_on)
    deferral: Deferral | None = None

    @property
    def async_result(self) -> "TaskResult":
        return TaskResult(self.id, app=self.app)

    @property
    def status(self) -> str:
        return self.async_result.status

    def get(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the result; re-raises the task's error if it failed (an id the
        deployment does not know: ``TaskNotFound`` at once)."""
        return self.async_result.get(timeout=timeout)


class TaskResult(AsyncResult):
    """A task's result as Celery's ``AsyncResult``, with two differences:

    * ``get`` on an id the deployment does not know (no owner record, no stored result)
      raises ``TaskNotFound`` at once instead of waiting out its timeout;
    * a ``get`` that ends without the result (its timeout, an interrupt) stops listening
      for it there and then.  Left subscribed, the result's ``__del__`` unsubscribes at
      interpreter exit, when redis-py can no longer import its parser: ~20 lines of
      ``Exception ignored in AsyncResult.__del__ ... sys.meta_path is None``."""

    def get(self, timeout: float | None = None, interval: float = 0.05, **kwargs: Any) -> Any:
        if not self.ready() and not task_known(self.app, self.id):
            raise TaskNotFound(f"no task {self.id!r}: never submitted here, or its record expired")
        try:
            return super().get(timeout=timeout, interval=interval, **kwargs)
        except BaseException:
            if self.backend is not None and not self.ready():
                self.backend.remove_pending_result(self)
            raise


def task_known(app: Celery, task_id: str) -> bool:
    """Whether a task id was submitted to this deployment (its owner record, written by every
    submit, or its stored result is there) -- one round trip."""
    keys = Keys(settings_of(app).key_prefix)
    return bool(app.backend.client.exists(keys.task_owner(task_id), keys.result(task_id)))


class Gateway:
    """Producer side of one deployment (one Redis, one key prefix)."""

    def __init__(self, settings: Settings | None = None, *, app: Celery | None = None,
                 client: redis.Redis | None = None):
        self.settings = settings or get_settings()
        self.app = app or make_app(self.settings)
        self.r = client or data_client(self.settings, "a Gateway")
        self.keys = Keys(self.settings.key_prefix)
        self._pool_names = tuple(p.name for p in self.settings.pools)
        self.tenants = TenantRegistry(self.r, self.settings)
        self.owner_tags: dict[str, str] = {}   # tenant id -> its generation's owner tag, as last read
        # tenant id -> (its record, its load level and reason) as a submit last read them: the next
        # submit estimates ahead from them (gateway_tasks.producer.submission.Guess)
        self.last_views: dict[str, tuple[dict[Any, Any], int, str]] = {}
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

    def estimate(self, tenant_id: str, messages: Any, model: str | None = None,
                 max_tokens: int | None = None, *, tenant: Tenant | None = None,
                 level: int | None = None, reason: str = "",
                 extra_body: dict[str, Any] | None = None) -> InferenceRequest:
        """Validate a request and compute its routing and token estimate (enqueues nothing).
        ``tenant``: the tenant's record when the caller read it already.  ``level``: the load
        level to apply, ``reason`` its cause (None: the deployment's now); a tier deferred at
        that level raises ``Deferred``."""
        if level is None:
            level, reason = self.load_level()
        return estimate_request(self, tenant_id, messages, model, max_tokens,
                                tenant or self.tenants.get(tenant_id), level, reason, extra_body=extra_body)

    def admit(self, tenant: Tenant, messages: Any, *, model: str | None = None,
              max_tokens: int | None = None) -> InferenceRequest:
        """What a submit checks before it takes anything -- its JSON limits, the Redis memory
        guard, the messages, a served model, max_tokens and the token estimate -- taking and
        enqueueing nothing, at load level L0 (registering work for later is not deferred).
        A cron's payload is admitted through it at registration; each run is a submit."""
        with redis_errors("admit", "nothing was registered"):
            Submission(self, Asked(tenant.tenant_id, messages, model, max_tokens)).validate()
            return estimate_request(self, tenant.tenant_id, messages, model, max_tokens, tenant, 0, "")

    def submit(self, tenant_id: str, messages: Sequence[dict[str, Any]] | str, *,
               model: str | None = None, max_tokens: int | None = None,
               deadline_s: float | None = None, source: str = "api",
               idempotency_key: str | None = None,
               extra_body: dict[str, Any] | None = None, stream: bool = False,
               count_quota: bool = True, depends_on: Sequence[str] | None = None,
               lane: str | None = None, on_behalf_of: str | None = None,
               on_defer: str = HOLD, endpoint: str = CHAT, tier: str | None = None,
               cron_run: tuple[str, int] | None = None, reply_channel: str | None = None) -> TaskHandle:
        """Validate, estimate and enqueue one inference task on its tier's queue
        (``stream``: the worker publishes the upstream's chunks, ``gateway_tasks.upstream.chunks``).

        ``lane``: "interactive" (someone waits) or "scheduled" (it tolerates seconds of delay:
        inside its tier it yields to interactive work by the tier's ``scheduled_lag_tokens``,
        ``gateway_tasks.dispatch.lanes``); None: scheduled for ``source="cron"``, else interactive.
        Redis down or full: RedisUnavailable / RedisFull, and nothing is enqueued.

        The tenant's quotas are taken first, atomically (``gateway_tasks.tenants.quota``):
        ``QuotaExceeded`` (reason, retry_after_s) when its tier's ``max_tasks_per_hour``
        or its TPM quota is spent.  ``count_quota=False``: the hourly count was taken
        elsewhere (a cron fire, counted by beat when it claimed the run); the TPM quota still applies.

        ``depends_on``: ids of the tenant's own tasks (or of tasks submitted on behalf of one
        of its tasks) that must finish first; the task is held, taking no queue space, until
        they have, then queued (``gateway_tasks.lifecycle.depends``).  Any other id -- unknown,
        or another tenant's -- is ``UnknownTask``; the task itself or a cycle is
        ``InvalidRequest``; a dependency that did not succeed fails it with ``DependencyFailed``.
        A held task lends its tier down its whole chain of dependencies while it waits
        (``gateway_tasks.lifecycle.inherit``).

        ``on_behalf_of``: the id of a live task (any tenant's) this work is for: it is admitted
        and judged by the load level at that task's tier when that is higher than its own,
        dispatched at that tier's priority and never evicted while that task lives, and that
        task's tenant may name it in ``depends_on``; quotas stay its own tenant's.  A task
        that is unknown or has ended is ``UnknownTask``.

        ``endpoint="embeddings"``: an embeddings task; ``messages`` is its ``input`` (a string,
        strings, token ids), ``model`` is required, ``max_tokens`` is not used: its estimate is
        the input's tokens (the same tokenizer), nothing reserved for a completion.

        ``tier``: run in this tier instead of the tenant's when it ranks below it (a batch's
        lines, ``gateway_tasks.batches``); a tier above the tenant's is ignored.  ``cron_run``:
        (entry id, nominal ms) of a cron run, shown by ``gateway task show``.  ``reply_channel``:
        a pub/sub channel the task's final state is published to as well (the REST API's result
        waiter, ``gateway_tasks.rest.result_waiter``)."""
        with redis_errors("submit", "nothing was enqueued"):
            try:
                handle = Submission(self, Asked(tenant_id, messages, model, max_tokens, deadline_s, source,
                                                idempotency_key, extra_body, stream, count_quota, depends_on,
                                                lane, on_behalf_of, on_defer, endpoint, tier, cron_run,
                                                reply_channel)).run()
            except Rejected as exc:
                self._count_refusal(tenant_id, usage.DEFERRED if isinstance(exc, Deferred) else usage.REFUSED)
                raise
            if handle.deferral is not None:        # accepted, held by the load level
                self._count_refusal(tenant_id, usage.DEFERRED)
            return handle

    def _count_refusal(self, tenant_id: str, name: str) -> None:
        """A deferred or refused submit in the tenant's usage: on those paths only, so a submit
        queued at once pays no round trip for it."""
        with contextlib.suppress(redis.RedisError):
            scripts_for(self.r).run(usage.UsageCall(self.keys, tenant_id, int(time.time() * 1000),
                                                    self.settings.usage_retention_days, {name: 1}))

    def _queue(self, req: InferenceRequest) -> str:
        return self.settings.queue_name(req.tier, req.pool)

    def _handle(self, task_id: str, req: InferenceRequest, deferral: Deferral | None = None) -> TaskHandle:
        return TaskHandle(task_id, req.tenant_id, req.tier, self._queue(req), req.model,
                          req.prompt_tokens, req.est_tokens, self.app, req.lane, deferral)

    def result(self, task_id: str) -> TaskResult:
        """The task's result (``.get(timeout)`` waits for it); an id this deployment does not
        know raises ``TaskNotFound`` here, at once."""
        if not task_known(self.app, task_id):
            raise TaskNotFound(f"no task {task_id!r}: never submitted here, or its record expired")
        return TaskResult(task_id, app=self.app)

    def owner(self, task_id: str) -> str | None:
        """The tenant generation that submitted a task, as its owner tag ('<id>/<gen>',
        ``Tenant.owner_tag``; None: unknown id, or its record expired)."""
        owner = self.r.get(self.keys.task_owner(task_id))
        return owner.decode() if owner else None

    def owns(self, tenant_id: str, task_id: str) -> bool:
        """Whether the tenant registered now under ``tenant_id`` submitted the task (an
        earlier generation of the id owns nothing of today's)."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.task_owner(task_id))
            pipe.hgetall(self.keys.tenant(tenant_id))
            owner, record = pipe.execute()
        return bool(owner and record) and \
            owner.decode() == TenantRegistry.from_record(tenant_id, record).owner_tag

    def cancel(self, task_id: str, tenant_id: str | None = None) -> Cancelled:
        """Cancel a task.  Queued: its index entry and message go together (lua/lifecycle/cancel.lua),
        so it never reaches the upstream.  Running: revoked, and marked so the worker
        discards its result and no requeue or lease sweep puts it back.  Its result becomes
        ``TaskCancelled`` (reason 'queued' | 'running').  ``tenant_id``: only that tenant's
        task (anyone else's id is ``UnknownTask``, as if it did not exist)."""
        return cancel_task(self, task_id, tenant_id)

    def delete_tenant(self, tenant_id: str) -> int:
        """Delete a tenant and cancel its unfinished tasks; returns how many were cancelled.

        The registration goes first (its key stops working, its generation ends), then its
        tasks are found by their owner records -- a SCAN of ``Keys.task_owner``, an
        operator's occasional cost of O(keys) -- and each one queued, held or running is
        cancelled (``cancel``) with the reason.  The owner records stay until they expire:
        they name the old generation, so the id registered again sees none of them.  Its
        crons are beat's: ``beat.api.delete_tenant`` deletes them too."""
        tag = self.tenants.get(tenant_id).owner_tag       # UnknownTenant if not registered
        self.tenants.delete(tenant_id)
        self.owner_tags.pop(tenant_id, None)
        self.last_views.pop(tenant_id, None)
        cancelled = 0
        for task_id in self._owned_by(tag):
            try:
                done = cancel_task(self, task_id, why=f" (its tenant {tenant_id!r} was deleted)")
            except UnknownTask:
                continue
            cancelled += done.cancelled and done.was != ALREADY_CANCELLED
        return cancelled

    def _owned_by(self, tag: str) -> list[str]:
        pattern = self.keys.task_owner("*")
        head = len(self.keys.task_owner(""))
        found: list[str] = []
        batch: list[bytes] = []

        def flush() -> None:
            with self.r.pipeline(transaction=False) as pipe:    # one key each: one slot each on a cluster
                for key in batch:
                    pipe.get(key)
                owners = pipe.execute()
            for key, owner in zip(batch, owners):
                if owner is not None and owner.decode() == tag:
                    found.append(key.decode()[head:])
            batch.clear()

        for key in self.r.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                flush()
        if batch:
            flush()
        return found

    def _finished(self, task_id: str) -> None:
        """A task ended here (cancelled, evicted): release what waits on it."""
        depends.finish(self.app, self.r, self.keys, self.settings.result_ttl_s, task_id, ok=False)


@lru_cache(maxsize=1)
def default_gateway() -> Gateway:
    return Gateway(get_settings())


def submit(tenant_id: str, messages: Sequence[dict[str, Any]] | str, *, model: str | None = None,
           max_tokens: int | None = None, deadline_s: float | None = None) -> TaskHandle:
    """Submit through the process-wide gateway configured from the environment."""
    return default_gateway().submit(tenant_id, messages, model=model, max_tokens=max_tokens,
                                    deadline_s=deadline_s)
