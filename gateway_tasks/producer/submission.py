"""One submit as an object that owns its rollbacks: ``Submission``.

    Submission(gw, tenant_id, messages, ...).run()

runs named steps, in order:

    validate      the arguments that need no Redis (deadline, extra_body, lane; messages and
                  extra_body as JSON: nesting depth, lone surrogates, NaN/Infinity)
    claim         the task id; one round trip: the tenant's record, the task's owner written
                  ahead, the load level (or the higher one the tenant is held at)
    behalf        on_behalf_of: the live task this work is for, its tier and owner
    estimate      messages checked, tokens estimated, the load level's actions (defer,
                  degrade) at the effective tier (its own, or the higher one it works on
                  behalf of), the pool (a reserved tier's failover) -- ``estimate_request``;
                  a deferred request is refused here when its caller asked for a refusal
    dependencies  depends_on checked: the tenant's own tasks (or shared with it), not itself
    remember      an idempotency key's first submit (a repeat returns the first's handle)
    take_quota    the tenant's hourly count and TPM tokens, both or neither -- sent in claim's
                  round trip when the estimate can be made ahead from what this gateway last
                  read of the tenant (``Guess``: a plain submit; kept only when the claim reads
                  the same record and load level, else given back and taken again)
    enqueue       published on its tier's queue, evicting a lower tier's newest task when the
                  pool is full (in the same publish: ``gateway_tasks.dispatch.evict.evicting``),
                  or held on its dependencies (with transitive priority inheritance:
                  ``gateway_tasks.lifecycle.inherit``; a cycle through it is refused), or held
                  as deferred until its release (gateway_tasks.overload.deferral)

Each step that takes something registers how to give it back; when a later step fails,
``run`` undoes exactly the steps that ran, newest first, in one place (``_undo``).
Nothing is enqueued unless every step passes.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import redis
from celery import states

from gateway_tasks.lifecycle import depends, inherit
from gateway_tasks.core.result_backend import REPLY_CHANNEL_HEADER
from gateway_tasks.dispatch.message import send_infer
from gateway_tasks.core.json_limits import check_value
from gateway_tasks.core.errors import DependencyFailed, Evicted, InvalidRequest, PromptTooLarge, UnknownTask
from gateway_tasks.dispatch.evict import EVICTED_BY_HIGHER_TIER, Eviction, Victim, evicting, tiers_below
from gateway_tasks.dispatch.enqueue import throttle_retry_after_s
from gateway_tasks.upstream.health import choose_pool, read_health
from gateway_tasks.core.keys import learned_field
from gateway_tasks.dispatch.lanes import lane_for
from gateway_tasks.overload.actions import Action, Request, action_for, degrade, deferral_error
from gateway_tasks.overload import deferral
from gateway_tasks.overload.state import tenant_level
from gateway_tasks.tenants.quota import QuotaRefundCall, QuotaTakeCall, effective_tpm
from gateway_tasks.dispatch.request import CHAT, EMBEDDINGS, ENDPOINTS, MAX_DEADLINE_S, InferenceRequest
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool, Tier
from gateway_tasks.core.stats import DEFERRED, DEFERRED_REFUSED, EVICTED, deferral_field, tier_field
from gateway_tasks.tenants.registry import Tenant, TenantRegistry, tenant_of_tag
from gateway_tasks.core.tokens import (count_embedding_tokens, count_prompt_tokens, validate_embedding_input,
                                       validate_messages)
from gateway_tasks.producer.memory_guard import submit_bytes

if TYPE_CHECKING:
    from gateway_tasks.producer.gateway import Gateway, TaskHandle

IDEMPOTENCY_NAMESPACE = uuid.UUID("6f1d3c1e-4b7a-4d55-9a51-2b8c9e1f0a77")
LEARNED_MARGIN = 1.2  # learned completion estimates are padded by 20%
UPSTREAM_PARAMETERS = {"model", "messages", "max_tokens", "stream", "stream_options", "input"}   # not in extra_body
MAX_TASK_ID_CHARS = 200


@dataclass(frozen=True)
class Asked:
    """A submit's arguments, as the caller gave them."""

    tenant_id: str
    messages: Sequence[dict[str, Any]] | str
    model: str | None = None
    max_tokens: int | None = None
    deadline_s: float | None = None
    source: str = "api"
    idempotency_key: str | None = None
    extra_body: dict[str, Any] | None = None
    stream: bool = False
    count_quota: bool = True
    depends_on: Sequence[str] | None = None
    lane: str | None = None
    on_behalf_of: str | None = None
    on_defer: str = deferral.HOLD   # a deferred request: held (later) or refused (Deferred)
    endpoint: str = CHAT     # EMBEDDINGS: ``messages`` is the embeddings input
    tier: str | None = None  # run in this tier when it ranks below the tenant's own (batch lines)
    cron_run: tuple[str, int] | None = None   # (entry id, nominal ms) of a cron run (beat.fire)
    reply_channel: str | None = None   # its final state published there too (REPLY_CHANNEL_HEADER)


@dataclass(frozen=True)
class Behalf:
    """The live task a submit works on behalf of: its id, the tier it lends, its owner."""

    task_id: str
    tier: str
    owner: str


@dataclass
class Guess:
    """A plain submit's estimate made ahead from the gateway's last read of its tenant
    (``Submission._guess``), and its quota take, sent in the claim's round trip.  It holds
    when the claim reads the same tenant record and load level: the estimate is the one the
    submit would have made, and the take stands; otherwise what it took is given back."""

    record: dict[Any, Any]
    level: int
    reason: str
    req: InferenceRequest
    effective: str
    take: QuotaTakeCall
    counted: bool
    taken: Any = None          # the take's reply (QuotaTaken), or the error it met

    def taken_reply(self, reply: Any, undos: list[Callable[[], Any]], client: redis.Redis) -> None:
        """Read the take's reply; a take that succeeded is given back if the submit fails."""
        if isinstance(reply, redis.exceptions.NoScriptError):
            scripts_for(client).lost()
        self.taken = reply if isinstance(reply, Exception) else self.take.parse(reply)
        if self.ok:
            undos.append(lambda: self.give_back(client))

    @property
    def ok(self) -> bool:
        return not isinstance(self.taken, Exception) and self.taken is not None and self.taken.ok

    def holds(self, record: dict[Any, Any], level: int, reason: str) -> bool:
        """The claim read what the guess was made from, and the take ran (refused or not)."""
        return not isinstance(self.taken, Exception) and self.taken is not None \
            and (record, level, reason) == (self.record, self.level, self.reason)

    def check_taken(self) -> None:
        if not self.ok:
            raise self.take.refusal(self.taken)

    def give_back(self, client: redis.Redis) -> None:
        """What its take took goes back (once): the guess did not hold (the submit takes again),
        or the submit failed."""
        if self.ok:
            scripts_for(client).run(QuotaRefundCall(self.take, counted=self.counted))
            self.taken = None


class Submission:
    def __init__(self, gw: "Gateway", asked: Asked):
        self.gw, self.asked = gw, asked
        self.r, self.keys, self.settings = gw.r, gw.keys, gw.settings
        self.task_id = ""
        self.lane = ""
        self.req: InferenceRequest | None = None
        self.deps: tuple[str, ...] = ()
        self.behalf: Behalf | None = None
        self.effective = ""      # the tier it is admitted and judged at (its own or a lent one)
        self.deferred: Action | None = None    # the defer action of a request held as deferred
        self.deferral: deferral.Deferral | None = None
        self.level_reason = ""
        self.level = 0
        self._undos: list[Callable[[], Any]] = []

    def run(self) -> "TaskHandle":
        try:
            self.validate()
            guess = self._guess()
            record, level, reason = self.claim(guess)
            self.level = level
            if guess is not None and guess.holds(record, level, reason):
                self._estimated(guess.req, None, guess.effective, reason)
                guess.check_taken()
            else:
                if guess is not None:
                    guess.give_back(self.r)
                self.behalf_of()
                self.estimate(record, level, reason)
                self.dependencies()
                if not self.remember():
                    return self.gw._handle(self.task_id, self.req)   # a repeat: the first submit's task
                self.take_quota()
            self.enqueue()
        except BaseException:
            self._undo()
            raise
        req = self.req
        # counted against the memory limit until the guard's next INFO read sees it
        payload = req.messages if req.endpoint == CHAT else req.input
        self.gw.memory.charge(submit_bytes(len(json.dumps(payload)) + len(json.dumps(req.extra_body))))
        return self.gw._handle(self.task_id, req, self.deferral)

    def _undo(self) -> None:
        """Give back what the steps that ran took, newest first (Redis may be what failed)."""
        with contextlib.suppress(redis.RedisError):
            while self._undos:
                self._undos.pop()()

    # -- the steps ------------------------------------------------------------------------
    def validate(self) -> None:
        a = self.asked
        deadline_s = a.deadline_s
        if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                       or not 0 < deadline_s <= MAX_DEADLINE_S):
            raise InvalidRequest(f"deadline_s must be a positive number of seconds up to {MAX_DEADLINE_S} "
                                 f"(7 days), got {deadline_s!r}")
        if a.extra_body is not None:
            if not isinstance(a.extra_body, dict):
                raise InvalidRequest("extra_body must be an object of upstream parameters")
            clash = set(a.extra_body) & UPSTREAM_PARAMETERS
            if clash:
                raise InvalidRequest(f"extra_body may not set {sorted(clash)}; use the arguments")
        # what the worker must encode as UTF-8 JSON (and dataclasses.asdict copy, recursively)
        check_value(a.messages, "messages", self.settings.max_json_depth)
        check_value(a.extra_body, "extra_body", self.settings.max_json_depth)
        if a.on_behalf_of is not None and (not isinstance(a.on_behalf_of, str) or not a.on_behalf_of
                                           or len(a.on_behalf_of) > MAX_TASK_ID_CHARS):
            raise InvalidRequest(f"on_behalf_of must be a task id (a non-empty string of at most "
                                 f"{MAX_TASK_ID_CHARS} characters)")
        if a.endpoint == EMBEDDINGS and a.stream:
            raise InvalidRequest("embeddings are not streamed")
        self.lane = lane_for(a.source, a.lane)
        if a.on_defer not in deferral.ON_DEFER:
            raise InvalidRequest(f"on_defer must be one of {list(deferral.ON_DEFER)}, got {a.on_defer!r}")
        self.gw.memory.check()

    def claim(self, ahead: "Guess | None" = None) -> tuple[dict[Any, Any], int, str]:
        """The task's id, and in one round trip the tenant's record, the task's owner written
        ahead (undone if a later step fails) and the load level -- and ``ahead``'s quota take.

        The owner is the tenant's generation (``Tenant.owner_tag``), written as this gateway
        last saw it and corrected once when the record says otherwise.  An idempotency key's
        id that an earlier generation of the tenant owns is not this generation's: the
        submit takes the id of the key under its own generation instead."""
        a = self.asked
        self.task_id = str(uuid.uuid4())
        if a.idempotency_key is not None:
            self.task_id = self._keyed_id(a.tenant_id)
        record, owned, stored, level, held = {}, False, None, [None, None], None
        if isinstance(a.tenant_id, str):
            guess = self.gw.owner_tags.get(a.tenant_id, a.tenant_id)
            owner_key = self.keys.task_owner(self.task_id)
            now_ms = int(time.time() * 1000)
            tasks = self.keys.tenant_tasks(a.tenant_id)
            with self.r.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.keys.tenant(a.tenant_id))
                pipe.set(owner_key, guess, ex=self.settings.result_ttl_s, nx=True)
                pipe.get(owner_key)
                pipe.hmget(self.keys.overload_state, "level", "reason")
                pipe.hget(self.keys.overload_held, a.tenant_id)
                # the tenant's list of its tasks (gateway task list), trimmed to the result TTL
                pipe.zadd(tasks, {self.task_id: now_ms}, nx=True)
                pipe.zremrangebyscore(tasks, 0, now_ms - self.settings.result_ttl_s * 1000)
                pipe.expire(tasks, self.settings.result_ttl_s)
                if ahead is not None:
                    pipe.execute_command(*scripts_for(self.r).command(ahead.take))
                replies = pipe.execute(raise_on_error=False)
            if ahead is not None:
                ahead.taken_reply(replies.pop(), self._undos, self.r)
            failed = next((r for r in replies if isinstance(r, Exception)), None)
            if failed is not None:
                raise failed
            record, owned, stored, level, held, *_ = replies
            if record:
                tag = TenantRegistry.from_record(a.tenant_id, record).owner_tag
                self.gw.owner_tags[a.tenant_id] = tag
                if owned and tag != guess:
                    self.r.set(owner_key, tag, xx=True, keepttl=True)
                elif not owned and stored is not None and stored.decode() != tag:
                    self.task_id = self._keyed_id(tag)      # an earlier generation's id
                    owned = self.r.set(self.keys.task_owner(self.task_id), tag,
                                       ex=self.settings.result_ttl_s, nx=True)
                    self.r.zadd(tasks, {self.task_id: now_ms}, nx=True)
        if owned:
            owner_key, task_id = self.keys.task_owner(self.task_id), self.task_id
            self._undos.append(lambda: (self.r.delete(owner_key), self.r.zrem(tasks, task_id)))
        level_now, reason = self.gw._level_of(level)
        if self.settings.overload.enabled:   # a tenant held at the level it causes sees that level
            level_now, reason = tenant_level(level_now, reason, held)
        if record and isinstance(a.tenant_id, str):
            remember_view(self.gw.last_views, a.tenant_id, (record, level_now, reason))
        return record, level_now, reason

    def _guess(self) -> "Guess | None":
        """The estimate and quota take of a plain submit (no idempotency key, dependencies or
        on_behalf_of), made ahead from what this gateway last read of its tenant and the load
        level, so the take rides in claim's round trip; None when there is nothing to go on,
        the request would be deferred, or the estimate fails (the real one says why)."""
        a = self.asked
        if a.idempotency_key is not None or a.depends_on is not None or a.on_behalf_of is not None \
                or not isinstance(a.tenant_id, str):
            return None
        view = self.gw.last_views.get(a.tenant_id)
        if view is None:
            return None
        record, level, reason = view
        try:
            req, deferred, effective = self._estimate_at(record, level, reason)
            if deferred is not None:
                return None
            take = self._take_call(req)
            take.check_fits()
        except Exception:   # noqa: BLE001 -- the submit's own estimate raises it again, or not
            return None
        return Guess(record, level, reason, req, effective, take, self.asked.count_quota)

    def _keyed_id(self, owner: str) -> str:
        return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, f"{owner}:{self.asked.idempotency_key}"))

    def behalf_of(self) -> None:
        """on_behalf_of: the task named must be live (submitted, not ended); it lends its tier
        (its tenant's, or the one it waits at or is lent) -- UnknownTask otherwise.  Its owner
        (a tenant generation's tag) is whom the new task is shared with."""
        origin = self.asked.on_behalf_of
        if origin is None:
            return
        if origin == self.task_id:
            raise InvalidRequest("on_behalf_of names this task itself")
        with self.r.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.task_owner(origin))
            pipe.exists(self.keys.done(origin))
            pipe.get(self.gw.app.backend.get_key_for_task(origin))
            pipe.hget(self.keys.held(origin), "tier")
            pipe.hvals(self.keys.lift(origin))
            owner, done, result, held_tier, lent = pipe.execute()
        if owner is None or done or depends.stored_outcome(result):
            raise UnknownTask(f"on_behalf_of names no live task: {origin!r} (unknown, or it has ended)")
        owner_tier = self.r.hget(self.keys.tenant(tenant_of_tag(owner.decode())), "tier")
        tiers = [t.decode() for t in (owner_tier, held_tier, *lent) if t]
        if not tiers:
            raise UnknownTask(f"on_behalf_of names no live task: {origin!r} (unknown, or it has ended)")
        top = min(tiers, key=lambda t: self._rank(t))
        self.behalf = Behalf(origin, self.settings.tier(top).name, owner.decode())

    def _rank(self, tier: str) -> int:
        try:
            return self.settings.tier_rank(tier)
        except Exception:   # a tier no longer configured ranks last
            return len(self.settings.tiers)

    def estimate(self, record: dict[Any, Any], level: int, reason: str) -> None:
        self._estimated(*self._estimate_at(record, level, reason), reason)

    def _estimate_at(self, record: dict[Any, Any], level: int,
                     reason: str) -> tuple[InferenceRequest, Action | None, str]:
        """The request estimated for this tenant record and load level (nothing kept): the
        request, its defer action if deferred, the tier it is admitted at."""
        a = self.asked
        tenant = TenantRegistry.from_record(a.tenant_id, record)
        if a.tier is not None and self.settings.tier_rank(a.tier) > self.settings.tier_rank(tenant.tier):
            tenant = replace(tenant, tier=self.settings.tier(a.tier).name)      # a batch's lines
        own = self.settings.tier(tenant.tier).name
        lent = inherit.lent_tier(self.settings, own, [self.behalf.tier]) if self.behalf else ""
        req, deferred = _estimate(self.gw, a.tenant_id, a.messages, a.model, a.max_tokens,
                                  tenant, level, reason, judged_at=lent, extra_body=a.extra_body,
                                  endpoint=a.endpoint)
        return (replace(req, deadline_s=a.deadline_s, source=a.source, stream=bool(a.stream),
                        lane=self.lane, effective_tier=lent), deferred, lent or own)

    def _estimated(self, req: InferenceRequest, deferred: Action | None, effective: str, reason: str) -> None:
        a = self.asked
        self.req, self.effective = req, effective
        if deferred is not None:
            # a deadline that ends before the retry time: holding the task could only end it
            # as DeadlineExceeded, so its caller hears now, with the retry time
            if a.on_defer == deferral.REFUSE or (a.deadline_s is not None and a.deadline_s < deferred.retry_after_s):
                self._count(DEFERRED_REFUSED, deferred.reason, "refused")
                raise deferral_error(deferred, reason)
            self.deferred, self.level_reason = deferred, reason

    def dependencies(self) -> None:
        """depends_on names the tenant's own tasks (this generation's: its owner tag), or tasks
        submitted on behalf of one of them (``Keys.shared``): any other id answers like an
        unknown one (same error, same reads); the task itself (an idempotency key's id) is
        refused."""
        depends_on = self.asked.depends_on
        if depends_on is None:
            return
        try:
            deps = depends.dependency_ids(depends_on)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if self.task_id in deps:
            raise InvalidRequest(f"depends_on names this task itself ({self.task_id}, the id of its "
                                 f"idempotency key): a task cannot wait on itself")
        a = self.asked
        tenant = self.gw.owner_tags.get(a.tenant_id, a.tenant_id).encode()   # read by claim
        with self.r.pipeline(transaction=False) as pipe:
            for dep in deps:
                pipe.get(self.keys.task_owner(dep))
                pipe.get(self.keys.shared(dep))
            got = pipe.execute()
        unknown = [d for i, d in enumerate(deps) if tenant not in (got[2 * i], got[2 * i + 1])]
        if unknown:
            raise UnknownTask(f"depends_on names unknown tasks: {unknown}")
        self.deps = deps

    def remember(self) -> bool:
        """False when an idempotency key was submitted before (this submit is its repeat)."""
        if self.asked.idempotency_key is None:
            return True
        meta = self.keys.meta(self.task_id)
        # a cron run's marker says which run it is: 'cron:<entry id>:<nominal ms>'
        # (gateway_tasks.producer.where shows it)
        run = self.asked.cron_run
        marker = f"cron:{run[0]}:{int(run[1])}" if run else "submitted"
        if not self.r.set(meta, marker, nx=True, ex=self.settings.result_ttl_s):
            return False
        self._undos.append(lambda: self.r.delete(meta))
        return True

    def take_quota(self) -> None:
        """The tenant's hourly and TPM quotas (both or neither), or QuotaExceeded saying which,
        its limit and when to retry."""
        count = self.asked.count_quota
        take = self._take_call(self.req)
        take.check_fits()
        taken = scripts_for(self.r).run(take)
        if not taken.ok:
            raise take.refusal(taken)
        self._undos.append(lambda: scripts_for(self.r).run(QuotaRefundCall(take, counted=count)))

    def _take_call(self, req: InferenceRequest) -> QuotaTakeCall:
        tier = self.settings.tier(req.tier)
        return QuotaTakeCall(self.keys, req.tenant_id, int(time.time() * 1000),   # the hour, as beat names it
                             tier.max_tasks_per_hour if self.asked.count_quota else 0, req.est_tokens,
                             req.tenant_tpm)

    def enqueue(self) -> None:
        """Held on its dependencies while any runs, else published on its tier's queue (a task
        on behalf of a higher tier's: lent that tier first, so it is boosted once queued, and
        it may evict below that tier)."""
        if self.behalf is not None:
            self._lend_from_behalf()
        if self.deps and self._hold():
            return
        if self.deferred is not None:
            self._defer(self.deferred)
            return
        req = self.req
        below = tiers_below(self.settings, self.effective or req.tier)
        eviction = Eviction(tuple(t.name for t in below), tuple(t.scheduled_lag_tokens for t in below))
        try:
            with evicting(eviction):
                send_infer(self.gw.app, self.r, self.task_id, self.gw._queue(req), req.to_body(),
                           self._headers(), req.argsrepr())
        finally:   # evicted for it, whether it was enqueued or not
            for victim in eviction.victims:
                fail_evicted(self.gw, victim, req)
        if self.behalf is not None:
            inherit.boost_released(self.r, self.keys, self.settings, self.gw._pool_names, self.task_id)

    def _headers(self) -> dict[str, Any]:
        """The message's headers: the request's routing headers, and its reply channel if any."""
        headers = self.req.routing_headers()
        if self.asked.reply_channel:
            headers[REPLY_CHANNEL_HEADER] = self.asked.reply_channel
        return headers

    def _lend_from_behalf(self) -> None:
        """The task it works for lends it its tier (taken back when that task ends) and shares it
        with that task's tenant (which may name it in depends_on)."""
        b, ttl_s = self.behalf, self.settings.result_ttl_s
        inherit.lend_to(self.r, self.keys, b.task_id, self.effective, self.task_id, ttl_s)
        self.r.set(self.keys.shared(self.task_id), b.owner, ex=ttl_s)
        lift, lifted, shared, task_id = (self.keys.lift(self.task_id), self.keys.lifted(b.task_id),
                                         self.keys.shared(self.task_id), self.task_id)
        self._undos.append(lambda: (self.r.delete(lift, shared), self.r.srem(lifted, task_id)))

    def _hold(self) -> bool:
        """Hold the task on its dependencies; False when none is running any more (send it now).
        Guarded (``gateway_tasks.lifecycle.depends.hold``): no dependency's end releases it
        before its chain is lent its tier and checked for a cycle (``_inherit``)."""
        req, deps = self.req, self.deps
        finished = depends.finished_outcomes(self.gw.app, self.r, deps)
        failed = next((d for d, outcome in finished.items() if outcome != depends.OK), "")
        if failed:
            raise _dependency_failed(failed)
        running = tuple(d for d in deps if d not in finished)
        if not running:
            return False
        spec = depends.send_spec(self.task_id, self.gw._queue(req), req.to_body(), self._headers(),
                                 req.argsrepr())
        self._undos.append(lambda: self._unhold(running))
        waiting = depends.hold(self.r, self.keys, self.task_id, running, spec,
                               self.settings.result_ttl_s * 1000, req.tier)
        if waiting:
            self._inherit(waiting)
        released = depends.unguard(self.r, self.keys, self.task_id)
        if released is None:
            return True
        if released.failed:
            raise _dependency_failed(released.failed)
        return False

    def _unhold(self, deps: tuple[str, ...]) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.held(self.task_id))
            for dep in deps:
                pipe.srem(self.keys.waiters(dep), self.task_id)
            pipe.execute()

    def _defer(self, action: Action) -> None:
        """Hold the deferred task until its tier's retry time (or off-peak window), or until
        the level falls: ``gateway_tasks.overload.deferral`` releases it."""
        req, o = self.req, self.settings.overload
        tier = self.settings.tier(self.effective or req.tier)      # the tier it was judged at
        now_ms = int(time.time() * 1000)
        until = deferral.deferred_until_ms(now_ms, action.retry_after_s, tier.off_peak, o.off_peak_timezone)
        spec = depends.send_spec(self.task_id, self.gw._queue(req), req.to_body(), self._headers(),
                                 req.argsrepr())
        self._undos.append(lambda: self.r.delete(self.keys.held(self.task_id)))
        deferral.hold(self.r, self.keys, self.task_id, tier.name, req.pool, spec, action, until, now_ms,
                      self.settings.result_ttl_s)
        self._count(DEFERRED, action.reason, "held")
        self.deferral = deferral.Deferral.of(action, until, self.level_reason)

    def _count(self, counter: str, reason: str, outcome: str) -> None:
        """Count a deferral (a counter lost to a Redis error must not undo an accepted task)."""
        req = self.req
        with contextlib.suppress(redis.RedisError), self.r.pipeline(transaction=False) as pipe:
            pipe.hincrby(self.keys.stats(req.pool), tier_field(counter, req.tier), 1)
            pipe.hincrby(self.keys.stats(req.pool), deferral_field(reason, outcome, req.tier), 1)
            pipe.execute()

    def _inherit(self, deps: tuple[str, ...]) -> None:
        """Transitive priority inheritance: every task down its chain of a lower tier than its
        own is lent its tier while it waits (``gateway_tasks.lifecycle.inherit``), and the task
        it works on behalf of lends its tier down the same chain while that task lives: the
        queued ones are dispatched at that priority, the held ones once released.  A chain
        that leads back to it is a cycle: refused."""
        pools, ttl_s = self.gw._pool_names, self.settings.result_ttl_s
        chain = inherit.walk(self.r, self.keys, pools, self.task_id, deps)
        if chain.cycle:
            raise InvalidRequest(f"depends_on makes a cycle: task {self.task_id} would wait on itself "
                                 f"through {list(deps)}")
        lenders = [(self.task_id, self.req.tier)]
        if self.behalf is not None:
            lenders.append((self.behalf.task_id, self.behalf.tier))
        for origin, tier in lenders:
            lent = inherit.lend(self.r, self.keys, self.settings, pools, origin, tier, chain.nodes, ttl_s)
            self._undos.append(lambda o=origin, t=lent: inherit.take_back(self.r, self.keys, self.settings,
                                                                          pools, o, t))
        self._release_deferred_below(chain.nodes, [t for _, t in lenders])

    def _release_deferred_below(self, nodes: Sequence[Any], lender_tiers: Sequence[str]) -> None:
        """Held deferred tasks down the chain wait no longer when a tier the level does not
        defer waits on them (it lends them its tier): released now, then boosted."""
        if not any(not deferral.tier_defers(self.settings, self.settings.tier(t), self.level) for t in lender_tiers):
            return
        held = [(n.task_id, n.tier) for n in nodes if n.held and not n.deps]
        for task_id in deferral.release_now(self.r, self.gw.app, self.settings, held):
            inherit.boost_released(self.r, self.keys, self.settings, self.gw._pool_names, task_id)


LAST_VIEWS_MAX = 10_000   # tenants whose last read a gateway keeps for its next estimate ahead


def remember_view(views: dict[str, Any], tenant_id: str, view: Any) -> None:
    """Keep a tenant's last read (``Gateway.last_views``), at most LAST_VIEWS_MAX of them: the
    oldest kept goes first (its next submit reads before it estimates, as the first did)."""
    if tenant_id not in views and len(views) >= LAST_VIEWS_MAX:
        with contextlib.suppress(RuntimeError, StopIteration, KeyError):   # another thread's change
            del views[next(iter(views))]
    views[tenant_id] = view


def _dependency_failed(task_id: str) -> DependencyFailed:
    return DependencyFailed(f"task {task_id} (in depends_on) did not succeed; this task "
                            f"was not queued", None, "dependency_failed")


def fail_evicted(gw: "Gateway", victim: Victim, by: InferenceRequest) -> None:
    """The evicted task's result: Evicted, with a throttle reason and when to retry."""
    gw.r.hincrby(gw.keys.stats(by.pool), tier_field(EVICTED, victim.tier), 1)
    if victim.task_id is None:
        return
    gw._finished(victim.task_id)
    retry_s = throttle_retry_after_s(gw.settings.tier(victim.tier))
    gw.app.backend.store_result(victim.task_id, Evicted(
        f"task {victim.task_id} ({victim.tier}) was evicted from the full queue of pool "
        f"{by.pool!r} to make room for a {by.tier} request; it never reached the upstream; "
        f"retry in {retry_s:g} s", retry_s, EVICTED_BY_HIGHER_TIER), states.FAILURE)


# -- estimate: validation, tokens, the load level's actions, routing -----------------------
def completion_limit(max_tokens: Any, extra_body: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """``max_completion_tokens`` in ``extra_body`` is OpenAI's name for ``max_tokens``: taken
    as it (out of ``extra_body``, so one limit goes upstream, the one reserved); both given
    and different is refused.  Returns (max_tokens, extra_body)."""
    extra = dict(extra_body or {})
    if "max_completion_tokens" not in extra:
        return max_tokens, extra
    limit = extra.pop("max_completion_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidRequest(f"extra_body.max_completion_tokens must be a positive integer, got {limit!r}")
    if max_tokens is not None and max_tokens != limit:
        raise InvalidRequest(f"max_tokens ({max_tokens!r}) and max_completion_tokens ({limit}) differ; "
                             f"they name one limit: give one of them")
    return limit, extra


def choices_of(extra_body: dict[str, Any], pool: Pool) -> int:
    """The choices (``n``) a request asks for: up to the pool's ``max_n``, else refused."""
    n = extra_body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidRequest(f"extra_body.n must be a positive integer, got {n!r}")
    if n > pool.max_n:
        raise InvalidRequest(f"n={n} asks for more choices than pool {pool.name!r} serves in one "
                             f"request (max_n {pool.max_n})")
    return n


def estimate_request(gw: "Gateway", tenant_id: str, messages: Any, model: str | None, max_tokens: int | None,
                     tenant: Tenant, level: int, reason: str, judged_at: str = "",
                     extra_body: dict[str, Any] | None = None, endpoint: str = CHAT) -> InferenceRequest:
    """A request validated, its pool and token estimate computed (enqueues nothing): the
    load level's actions applied (a tier deferred at ``level`` raises ``Deferred``) and a
    reserved tier routed to a backup while its pool is unavailable.  ``judged_at``: the tier
    whose load-level actions apply when it is not the tenant's own (work on behalf of a
    higher tier's task: ``Submission.behalf_of``); routing and quotas stay the tenant's.
    The prompt is every forwarded field, ``extra_body``'s too (``count_prompt_tokens``); the
    completion reserve is max_tokens times the choices asked for (``n``).  ``endpoint``
    EMBEDDINGS: ``messages`` is the embeddings input (``_estimate_embeddings``)."""
    req, deferred = _estimate(gw, tenant_id, messages, model, max_tokens, tenant, level, reason, judged_at,
                              extra_body, endpoint)
    if deferred is not None:
        raise deferral_error(deferred, reason)
    return req


def _estimate(gw: "Gateway", tenant_id: str, messages: Any, model: str | None, max_tokens: int | None,
              tenant: Tenant, level: int, reason: str, judged_at: str = "",
              extra_body: dict[str, Any] | None = None,
              endpoint: str = CHAT) -> tuple[InferenceRequest, Action | None]:
    """``estimate_request``, a deferral returned (the defer action) instead of raised."""
    if endpoint == EMBEDDINGS:
        return _estimate_embeddings(gw, tenant_id, messages, model, tenant, level, judged_at, extra_body)
    if endpoint != CHAT:
        raise InvalidRequest(f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint!r}")
    settings = gw.settings
    tier = settings.tier(tenant.tier)
    judged = settings.tier(judged_at) if judged_at else tier
    msgs = validate_messages(messages)
    max_tokens, extra = completion_limit(max_tokens, extra_body)
    if max_tokens is None:
        max_tokens = settings.default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    try:
        pool = settings.pool_for_model(model)
    except Exception as exc:  # ConfigError -> the caller's mistake here
        raise InvalidRequest(str(exc)) from None
    model = model or pool.model
    deferred = action_for(settings.overload, level, judged, Request(max_tokens, model))
    pool, model, max_tokens, changes = _overload(gw, judged, pool, model, max_tokens, level)
    n = choices_of(extra, pool)
    reserve = max_tokens * n
    # counted only as far as the larger prompt that could fit: beyond, it is refused
    budget = max(0, min(settings.max_prompt_tokens - max_tokens, math.floor(pool.token_capacity) - reserve))
    prompt_tokens = count_prompt_tokens(msgs, stop_above=budget, extra_body=extra)
    counted = f"{prompt_tokens} tokens" if prompt_tokens <= budget else f"at least {prompt_tokens} tokens"
    total = prompt_tokens + max_tokens
    if total > settings.max_prompt_tokens:
        raise PromptTooLarge(
            f"prompt ({counted}) + max_tokens ({max_tokens}) = {total} exceeds "
            f"the limit of {settings.max_prompt_tokens} tokens")
    reserved = f"max_tokens ({max_tokens}) x n ({n})" if n > 1 else f"max_tokens ({max_tokens})"
    if prompt_tokens + reserve > pool.token_capacity:
        raise PromptTooLarge(
            f"prompt ({counted}) + {reserved} = {prompt_tokens + reserve} exceeds "
            f"pool {pool.name!r}'s bucket capacity of {int(pool.token_capacity)} tokens "
            f"(TPM {pool.tpm}); it could never be admitted")
    total = prompt_tokens + reserve
    requested_pool, requested_model = pool.name, model
    pool, model, failover = _route(gw, tier, pool, model, total)
    if failover:
        changes = {"level": level, "requested_max_tokens": max_tokens,
                   "requested_model": changes.get("requested_model", requested_model), **changes,
                   "requested_pool": requested_pool, "failover": failover}
    completion_est = reserve
    if pool.charge == "actual":
        learned = gw.r.hget(gw.keys.learned(pool.name), learned_field(tenant_id, model))
        if learned is not None:
            completion_est = min(reserve, max(1, math.ceil(float(learned) * LEARNED_MARGIN)))
    return InferenceRequest(tenant_id=tenant_id, tier=tier.name, pool=pool.name, model=model,
                            messages=msgs, max_tokens=max_tokens, prompt_tokens=prompt_tokens,
                            est_tokens=prompt_tokens + completion_est, tenant_weight=tenant.weight,
                            tenant_tpm=effective_tpm(tenant.tpm, tier.tenant_tpm),
                            degradation=changes, extra_body=extra), (deferred if deferred.deferred else None)


def _estimate_embeddings(gw: "Gateway", tenant_id: str, value: Any, model: str | None, tenant: Tenant,
                         level: int, judged_at: str = "",
                         extra_body: dict[str, Any] | None = None) -> tuple[InferenceRequest, Action | None]:
    """An embeddings request: its input checked and its tokens counted with the prompts'
    tokenizer; no completion is reserved (max_tokens 0, est_tokens = the input's tokens).  The
    load level may defer it (returned, as ``_estimate``'s); it is never degraded (an embedding
    model has no fallback)."""
    settings = gw.settings
    tier = settings.tier(tenant.tier)
    value = validate_embedding_input(value)
    if not model:
        raise InvalidRequest("model is required for embeddings (GET /v1/models lists them)")
    try:
        pool = settings.pool_for_model(model)
    except Exception as exc:  # ConfigError -> the caller's mistake here
        raise InvalidRequest(str(exc)) from None
    deferred = action_for(settings.overload, level, settings.tier(judged_at) if judged_at else tier,
                          Request(0, model))
    budget = min(settings.max_prompt_tokens, math.floor(pool.token_capacity))
    tokens = count_embedding_tokens(value, stop_above=budget)
    if tokens > budget:
        raise PromptTooLarge(f"the input's tokens (at least {tokens}) exceed the limit of {budget} tokens "
                             f"(max_prompt_tokens, pool {pool.name!r}'s bucket capacity)")
    return InferenceRequest(tenant_id=tenant_id, tier=tier.name, pool=pool.name, model=model, messages=[],
                            max_tokens=0, prompt_tokens=tokens, est_tokens=tokens, tenant_weight=tenant.weight,
                            tenant_tpm=effective_tpm(tenant.tpm, tier.tenant_tpm), endpoint=EMBEDDINGS,
                            input=value, extra_body=dict(extra_body or {})), \
        (deferred if deferred.deferred else None)


def _overload(gw: "Gateway", tier: Tier, pool: Pool, model: str, max_tokens: int,
              level: int) -> tuple[Pool, str, int, dict[str, Any]]:
    """The level's execute action on a valid request: max_tokens cap (or fixed max_tokens)
    and model fallback (a defer leaves it as it is).  Returns (pool, model, max_tokens, what
    changed)."""
    settings = gw.settings
    served = {m for p in settings.pools for m in p.models}
    d = degrade(settings.overload, tier, level, model, max_tokens,
                lambda m: settings.overload.fallback_for(m, pool.fallback_model),
                lambda m: m in served)
    changes: dict[str, Any] = {}
    if d.changed:
        changes = {"level": level, "requested_max_tokens": max_tokens, "requested_model": model}
        if d.substituted:
            pool = settings.pool_for_model(d.model)
    return pool, d.model, d.max_tokens, changes


def _route(gw: "Gateway", tier: Tier, pool: Pool, model: str, est_tokens: int) -> tuple[Pool, str, str]:
    """A reserved tier's pool: a backup while its own is unavailable (circuit open,
    drained by a 429, or its bucket cannot admit within the tier's max wait).
    Returns (pool, model, reason); reason "" = no failover."""
    if tier.reserved_share <= 0 or not pool.backup_pools:
        return pool, model, ""
    backups = [gw.settings.pool(n) for n in pool.backup_pools]
    health = read_health(gw.r, gw.keys, [pool, *backups])
    route = choose_pool(pool, backups, health, est_tokens, tier.max_wait_ms)
    if not route.reason:
        return pool, model, ""
    target = route.pool
    return target, (model if model in target.models else target.model), route.reason
