"""The producer side of the gateway's kombu transport (Redis).

For gateway queues (gt.<tier>.<pool>) publishing runs lua/dispatch/enqueue.lua, which
stamps the Redis clock on the message and applies the tier's tail drop
(``gateway_tasks.dispatch.publish``).  Every
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
from typing import Any

import redis
from kombu.exceptions import InconsistencyError

from gateway_tasks.core.celery_app import PUBLIC_SETTINGS_OPTION, settings_behind
from gateway_tasks.core.keys import BELL_MAX, Keys, QUEUE_PREFIX, split_queue_name
from gateway_tasks.dispatch.index_entry import IndexEntry
from gateway_tasks.dispatch.publish import publish
from gateway_tasks.dispatch import kombu_adapter
from gateway_tasks.core.scripts import Scripts, scripts_for
from gateway_tasks.core.settings import Settings, get_settings, settings_from_json
from gateway_tasks.core.packer import connection_kwargs
from gateway_tasks.core.redis_client import Client, shared_client


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
        if split_queue_name(queue) is None:
            return super().put_message(queue, message, **kwargs)
        kwargs.pop("_publish_batch", None)
        publish(self._gt_raw, self._gt_keys, self._gt_settings, queue, message)

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


class Transport(kombu_adapter.Transport):
    Channel = Channel
    driver_name = "gateway-redis"


__all__ = ["BELL_MAX", "Channel", "QUEUE_PREFIX", "Transport", "channel_settings", "is_gateway_queue"]
