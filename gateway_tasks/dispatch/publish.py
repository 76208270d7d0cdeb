"""Putting one message on a gateway queue (gt.<tier>.<pool>): the one place it is done, for
the kombu channel (``gateway_tasks.dispatch.broker.Channel.put_message``, Celery's
``send_task``) and for the producer's lean path (``gateway_tasks.dispatch.message``).

The message's routing headers are checked (a message no dispatcher could take is refused,
loudly), lua/dispatch/enqueue.lua queues it in one round trip -- with the task-sent event
published in the same call when one is given -- a full pool evicts a lower tier's newest
task for it while the publisher allows (``gateway_tasks.dispatch.evict``), a deadline
sets its boost (``gateway_tasks.dispatch.deadline``), and a refusal is ``QueueFull``.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import replace
from typing import Any

import redis

from gateway_tasks.core.errors import InvalidRequest, QueueFull
from gateway_tasks.core.keys import Keys, split_queue_name
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Settings
from gateway_tasks.dispatch.deadline import DeadlineCall, urgent_from_ms
from gateway_tasks.dispatch.enqueue import EnqueueCall, POOL_FULL, TIER_FULL, enqueue, throttle_retry_after_s
from gateway_tasks.dispatch.evict import EvictCall, current_eviction
from gateway_tasks.dispatch.lanes import INTERACTIVE, SCHEDULED
from gateway_tasks.dispatch.request import (HEADER_DEADLINE_S, HEADER_EST_TOKENS, HEADER_LANE, HEADER_TENANT,
                                            HEADER_TENANT_WEIGHT)
from gateway_tasks.tenants.registry import TENANT_ID_RE

ANONYMOUS_TENANT = "_anonymous"  # messages on a gateway queue without a (valid) tenant header


def publish(client: redis.Redis, keys: Keys, settings: Settings, queue: str, message: dict[str, Any], *,
            message_json: str | None = None, event_channel: str = "", event: str = "") -> None:
    """Queue ``message`` (a kombu envelope; ``message_json``: it already encoded) on the gateway
    queue ``queue``, or raise InvalidRequest / QueueFull; ``event_channel`` / ``event``: the
    task-sent event, published by the enqueue that queues it (none when it is refused)."""
    headers = message.get("headers") or {}
    parts = split_queue_name(queue)
    if parts is None:
        raise InvalidRequest(f"{queue!r} is not a gateway queue (gt.<tier>.<pool>)")
    if HEADER_EST_TOKENS not in headers:
        # it would sit in a list no dispatcher reads: refuse it, loudly
        raise InvalidRequest(f"a message for gateway queue {queue} needs the header "
                             f"{HEADER_EST_TOKENS} (publish through Gateway.submit); "
                             f"it was not enqueued")
    tier = settings.tier(parts[0])
    est_tokens = _whole(headers.get(HEADER_EST_TOKENS), HEADER_EST_TOKENS)
    pool = settings.pool(parts[1])
    capacity = pool.token_capacity
    if est_tokens > capacity:
        raise InvalidRequest(f"header {HEADER_EST_TOKENS}={est_tokens} is over the bucket capacity "
                             f"of pool {parts[1]!r} ({capacity:.0f} tokens): it could never be "
                             f"admitted; it was not enqueued")
    pool_capacity = pool.queue_capacity
    call = EnqueueCall(keys, tier, parts[1], tenant=_tenant_of(headers),
                       tag=str((message.get("properties") or {}).get("delivery_tag") or uuid.uuid4()),
                       est_tokens=est_tokens,
                       message_json=message_json if message_json is not None else json.dumps(message),
                       tenant_weight=_weight(headers.get(HEADER_TENANT_WEIGHT, 1)),
                       pool_capacity=pool_capacity,
                       pool_tiers=tuple(t.name for t in settings.tiers),
                       lane=SCHEDULED if headers.get(HEADER_LANE) == SCHEDULED else INTERACTIVE,
                       # where it sits, written as it is queued: Gateway.cancel and eviction find it by it
                       task_id=task_id if isinstance(task_id := headers.get("id"), str) else "",
                       ref_ttl_s=settings.result_ttl_s, event_channel=event_channel, event=event)
    done = enqueue(client, call)
    eviction = current_eviction()
    scripts = scripts_for(client)
    while done.pool_full and eviction is not None and eviction.may_evict():
        # the pool's shared capacity is full: its newest task of the lowest tier below this
        # arrival goes (lua/dispatch/evict.lua; the publisher fails it), and the arrival is enqueued again
        victim = scripts.run(EvictCall(keys, parts[1], eviction.lower, eviction.lags))
        if victim is None:
            eviction.found_none = True
            break
        eviction.victims.append(victim)
        done = enqueue(client, replace(call, count_demand=False))
    deadline_s = headers.get(HEADER_DEADLINE_S)
    boost_s = settings.deadline_boost_s
    if done.accepted and boost_s and done.entry and isinstance(deadline_s, (int, float)) \
            and not isinstance(deadline_s, bool) and deadline_s > 0 and done.enqueued_ms:
        scripts.run(DeadlineCall(keys, parts[1], tier.name,
                                 urgent_from_ms(done.enqueued_ms, deadline_s, boost_s), done.entry))
    if done.pool_full:
        none_below = (f"; no lower-tier task is queued to make room for this {tier.name} request"
                      if eviction is not None and eviction.found_none else "")
        raise QueueFull(f"pool {parts[1]!r} is at its shared queue capacity "
                        f"({pool_capacity} tasks, all tiers); the request was "
                        f"not enqueued{none_below}", throttle_retry_after_s(tier), POOL_FULL)
    if not done.accepted:
        raise QueueFull(f"queue {queue} is full ({done.queue_length} messages, limit "
                        f"{tier.queue_max_len}); the request was not enqueued",
                        throttle_retry_after_s(tier), TIER_FULL)


def _tenant_of(headers: dict[str, Any]) -> str:
    tenant = headers.get(HEADER_TENANT)
    return tenant if isinstance(tenant, str) and TENANT_ID_RE.fullmatch(tenant) else ANONYMOUS_TENANT


def _whole(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise InvalidRequest(f"header {name}={value!r} is invalid; expected a non-negative number")
    return int(value)


def _weight(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidRequest(f"header {HEADER_TENANT_WEIGHT}={value!r} is invalid; expected > 0")
    return float(value)
