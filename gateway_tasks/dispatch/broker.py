"""The producer side of the gateway's kombu transport (Redis).

For gateway queues (gt.<tier>.<pool>) publishing runs lua/dispatch/enqueue.lua, which
stamps the Redis clock on the message and applies the tier's tail drop.  Every
other queue (Celery's own, pidbox, events) behaves as on kombu's Redis
transport.  ``gateway_tasks.dispatch.transport`` extends this channel with the dispatching
consumer (pick.lua).

A channel reads the deployment's settings from the broker's transport options
(their public view, without API keys: see ``gateway_tasks.core.celery_app``).

The broker's Redis is the deployment's Redis, unless the settings name a control
Redis (``control_redis_url``; always on a Redis Cluster): then the broker connection
carries only Celery's own machinery (other queues, bindings, control, events) and
every gateway operation -- enqueue, queue sizes, purges here; picks, bell waits,
releases, leases and dead letters in the consumer -- runs on the deployment's Redis
(``_gt_raw``: a cluster client on a cluster), found in the settings the app was made
with (``celery_app.settings_behind``: the URL's credentials never travel in the
transport options).
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import replace
from typing import Any

import redis
from kombu.exceptions import InconsistencyError

from gateway_tasks.core.celery_app import PUBLIC_SETTINGS_OPTION, settings_behind
from gateway_tasks.core.keys import BELL_MAX, Keys, QUEUE_PREFIX, split_queue_name
from gateway_tasks.dispatch.deadline import DeadlineCall, urgent_from_ms
from gateway_tasks.dispatch.enqueue import EnqueueCall, POOL_FULL, TIER_FULL, enqueue, throttle_retry_after_s
from gateway_tasks.dispatch.evict import EvictCall, current_eviction
from gateway_tasks.core.errors import InvalidRequest, QueueFull
from gateway_tasks.dispatch.index_entry import IndexEntry
from gateway_tasks.dispatch.lanes import INTERACTIVE, SCHEDULED
from gateway_tasks.dispatch.request import (HEADER_DEADLINE_S, HEADER_EST_TOKENS, HEADER_LANE, HEADER_TENANT,
                                            HEADER_TENANT_WEIGHT)
from gateway_tasks.tenants.registry import TENANT_ID_RE
from gateway_tasks.dispatch import kombu_adapter
from gateway_tasks.core.scripts import Scripts, scripts_for
from gateway_tasks.core.settings import Settings, get_settings, settings_from_json
from gateway_tasks.core.packer import connection_kwargs
from gateway_tasks.core.redis_client import Client, shared_client

ANONYMOUS_TENANT = "_anonymous"  # messages on a gateway queue without a (valid) tenant header


def channel_settings(transport_options: dict[str, Any]) -> Settings:
    """The settings a channel works with: the app's public view, else the environment's."""
    text = transport_options.get(PUBLIC_SETTINGS_OPTION)
    return settings_from_json(text) if text else get_settings()


def data_url(transport_options: dict[str, Any]) -> str:
    """The deployment's Redis URL, credentials included, when it is not the broker's (the
    settings name a control Redis); '' when the broker's Redis is the deployment's."""
    text = transport_options.get(PUBLIC_SETTINGS_OPTION)
    full = (settings_behind(text) if text else None) or get_settings()
    public = channel_settings(transport_options)
    if not public.control_redis_url:
        return ""
    if full.key_prefix != public.key_prefix or not full.redis_url:
        full = public   # settings made elsewhere: their public view (a URL without credentials)
    return full.redis_url


def is_gateway_queue(name: str) -> bool:
    return split_queue_name(name) is not None


class Channel(kombu_adapter.Channel):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        options = self.connection.client.transport_options
        self._gt_settings = channel_settings(options)
        self._gt_keys = Keys(self._gt_settings.key_prefix)
        self._gt_data_url = data_url(options)
        if (self.global_keyprefix or "") != self._gt_settings.key_prefix:
            raise InconsistencyError(
                f"broker global_keyprefix {self.global_keyprefix!r} must equal the gateway "
                f"key_prefix {self._gt_settings.key_prefix!r} (use gateway_tasks.core.celery_app.make_app)")

    def connection_params(self, asynchronous: bool = False) -> dict[str, Any]:
        """kombu's connection parameters, with the gateway's command packer (core/packer.py)."""
        params = super().connection_params(asynchronous)
        params.update(connection_kwargs())
        return params

    # -- raw client: our scripts take full key names, unlike kombu's prefixing client; the
    # deployment's Redis (a cluster client on a cluster), which is the broker's without a control Redis
    @property
    def _gt_raw(self) -> Client:
        raw = getattr(self, "_gt_raw_client", None)
        if raw is None:
            raw = shared_client(self._gt_data_url) if self._gt_data_url else redis.Redis(connection_pool=self.pool)
            self._gt_raw_client = raw
        return raw

    @property
    def _gt_scripts(self) -> Scripts:
        return scripts_for(self._gt_raw)

    def put_message(self, queue: str, message: dict, **kwargs: Any) -> None:
        headers = message.get("headers") or {}
        parts = split_queue_name(queue)
        if parts is None:
            return super().put_message(queue, message, **kwargs)
        if HEADER_EST_TOKENS not in headers:
            # it would sit in a list no dispatcher reads: refuse it, loudly
            raise InvalidRequest(f"a message for gateway queue {queue} needs the header "
                                 f"{HEADER_EST_TOKENS} (publish through Gateway.submit); "
                                 f"it was not enqueued")
        kwargs.pop("_publish_batch", None)
        tier = self._gt_settings.tier(parts[0])
        est_tokens = _whole(headers.get(HEADER_EST_TOKENS), HEADER_EST_TOKENS)
        capacity = self._gt_settings.pool(parts[1]).token_capacity
        if est_tokens > capacity:
            raise InvalidRequest(f"header {HEADER_EST_TOKENS}={est_tokens} is over the bucket capacity "
                                 f"of pool {parts[1]!r} ({capacity:.0f} tokens): it could never be "
                                 f"admitted; it was not enqueued")
        call = EnqueueCall(self._gt_keys, tier, parts[1], tenant=_tenant_of(headers),
                           tag=str((message.get("properties") or {}).get("delivery_tag") or uuid.uuid4()),
                           est_tokens=est_tokens,
                           message_json=json.dumps(message),
                           tenant_weight=_weight(headers.get(HEADER_TENANT_WEIGHT, 1)),
                           pool_capacity=self._gt_pool_capacity(parts[1]),
                           pool_tiers=tuple(t.name for t in self._gt_settings.tiers),
                           lane=SCHEDULED if headers.get(HEADER_LANE) == SCHEDULED else INTERACTIVE,
                           # where it sits, written as it is queued: Gateway.cancel and eviction find it by it
                           task_id=task_id if isinstance(task_id := headers.get("id"), str) else "",
                           ref_ttl_s=self._gt_settings.result_ttl_s)
        done = enqueue(self._gt_raw, call)
        eviction = current_eviction()
        while done.pool_full and eviction is not None and eviction.may_evict():
            # the pool's shared capacity is full: its newest task of the lowest tier below this
            # arrival goes (lua/dispatch/evict.lua; the publisher fails it), and the arrival is enqueued again
            victim = self._gt_scripts.run(EvictCall(self._gt_keys, parts[1], eviction.lower, eviction.lags))
            if victim is None:
                eviction.found_none = True
                break
            eviction.victims.append(victim)
            done = enqueue(self._gt_raw, replace(call, count_demand=False))
        deadline_s = headers.get(HEADER_DEADLINE_S)
        boost_s = self._gt_settings.deadline_boost_s
        if done.accepted and boost_s and done.entry and isinstance(deadline_s, (int, float)) \
                and not isinstance(deadline_s, bool) and deadline_s > 0 and done.enqueued_ms:
            self._gt_scripts.run(DeadlineCall(self._gt_keys, parts[1], tier.name,
                                              urgent_from_ms(done.enqueued_ms, deadline_s, boost_s), done.entry))
        if done.pool_full:
            none_below = (f"; no lower-tier task is queued to make room for this {tier.name} request"
                          if eviction is not None and eviction.found_none else "")
            raise QueueFull(f"pool {parts[1]!r} is at its shared queue capacity "
                            f"({self._gt_pool_capacity(parts[1])} tasks, all tiers); the request was "
                            f"not enqueued{none_below}", throttle_retry_after_s(tier), POOL_FULL)
        if not done.accepted:
            raise QueueFull(f"queue {queue} is full ({done.queue_length} messages, limit "
                            f"{tier.queue_max_len}); the request was not enqueued",
                            throttle_retry_after_s(tier), TIER_FULL)

    def _gt_pool_capacity(self, pool: str) -> int:
        return next((p.queue_capacity for p in self._gt_settings.pools if p.name == pool), 0)

    def queue_size(self, queue: str) -> int:
        parts = split_queue_name(queue)
        if parts is None:
            return super().queue_size(queue)
        return int(self._gt_raw.zcard(self._gt_keys.index(parts[1], parts[0])))

    def purge_queue(self, queue: str) -> int:
        parts = split_queue_name(queue)
        if parts is None:
            return super().purge_queue(queue)
        return purge_tier(self._gt_raw, self._gt_keys, parts[1], parts[0])


def queued_messages(client: redis.Redis, keys: Keys, pool: str, tier: str) -> list[dict[str, Any]]:
    """The queued (not dispatched) messages of one tier on one pool, tenant by tenant in
    each tenant's order (tools and tests; O(queue length))."""
    tags = [IndexEntry.decode(e).tag for e in client.zrange(keys.index(pool, tier), 0, -1)]
    raw = client.hmget(keys.messages(pool), tags) if tags else []
    return [json.loads(m) for m in raw if m is not None]


def purge_tier(client: redis.Redis, keys: Keys, pool: str, tier: str) -> int:
    """Drop every queued (not dispatched) task of one tier on one pool; returns how many."""
    entries = client.zrange(keys.index(pool, tier), 0, -1)
    tags = [IndexEntry.decode(e).tag for e in entries]
    with client.pipeline(transaction=True) as pipe:   # one MULTI in the pool's slot
        if tags:
            pipe.hdel(keys.messages(pool), *tags)
        # one DEL of the two keys (a cluster pipeline's delete() takes one key)
        pipe.execute_command("DEL", keys.index(pool, tier), keys.active(pool, tier))
        pipe.execute()
    return len(tags)


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


class Transport(kombu_adapter.Transport):
    Channel = Channel
    driver_name = "gateway-redis"


__all__ = ["BELL_MAX", "Channel", "QUEUE_PREFIX", "Transport", "channel_settings", "is_gateway_queue"]
