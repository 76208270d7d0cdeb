"""The result backend: Celery's Redis backend, one round trip per result write, and whose
retries also ride out a full Redis.

* Celery's Redis backend reads a task's meta back before every write (a late write of a
  lost worker must not overwrite a success), then writes and publishes it: two round trips
  per write, and a task whose STARTED state is tracked writes twice.  Here
  lua/core/result_store.lua checks and writes in one atomic call (``ResultStoreCall``).
* A task may take its STARTED write along with its first round trip (``HeldStarted``):
  Celery's tracer writes STARTED on its own just before the task's body runs, and the
  body's first pipeline is microseconds later -- one round trip less per task.
* ``result_backend_always_retry`` retries a result write (STARTED, SUCCESS, FAILURE)
  with exponential back-off -- but Celery's Redis backend counts only connection
  errors as worth it, so a result refused at ``maxmemory`` (noeviction) was dropped
  and its task, acked, never reached a final state.  Here that refusal is retried
  as well (``result_backend_max_retries`` times, ~1 minute in all): memory frees as
  the queues drain, or when the limit is raised.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import redis
from redis.cluster import RedisCluster

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str

from gateway_tasks.core.redis_client import connect
from gateway_tasks.core.redis_failures import is_out_of_memory
from gateway_tasks.core.scripts import layout, scripts_for
from gateway_tasks.core.urls import is_cluster_url, without_credentials

RESULT_BACKEND = "gateway_tasks.core.result_backend:ResultBackend"


def backend_url(redis_url: str) -> str:
    """The ``result_backend`` setting for a Redis URL: this backend, at that URL."""
    return f"{RESULT_BACKEND}+{redis_url}"


@dataclass(frozen=True)
class ResultStoreCall:
    """lua/core/result_store.lua: store and publish a result meta unless a success is stored."""

    SCRIPT: ClassVar[str] = "core/result_store"

    key: str
    meta: str | bytes      # encoded
    expires_s: int         # 0: none
    reply_channel: str = ""   # published there too ('': only on the key's own channel)

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(result=self.key)

    @property
    def script_args(self) -> list[str | bytes | int]:
        return layout(self.SCRIPT).args(meta=self.meta, expires_s=self.expires_s,
                                        reply_channel=self.reply_channel or None)

    def parse(self, reply: Any) -> bool:
        return int(reply) == 1


# the message header naming the pub/sub channel of the process that waits for the task's result
# (an API process's result waiter, gateway_tasks.rest.result_waiter): its final state is published
# there as well as on the result key's own channel -- the waiter needs no subscription per task
REPLY_CHANNEL_HEADER = "gt_reply_channel"


def reply_channel_of(request: Any) -> str:
    """The reply channel a running task's message names ('' when none)."""
    if request is None:
        return ""
    found = getattr(request, REPLY_CHANNEL_HEADER, None) or (getattr(request, "headers", None) or {}).get(
        REPLY_CHANNEL_HEADER)
    return found if isinstance(found, str) else ""


# the attribute of a task (``@shared_task(**{STARTED_WITH_FIRST_TRIP: True})``) whose body
# sends its STARTED write in its first round trip (``take_started``); a body that ends before
# it (a request found invalid) leaves it unsent, and the task's final state stands instead
STARTED_WITH_FIRST_TRIP = "gt_started_with_first_trip"


@dataclass(frozen=True)
class HeldStarted:
    """A task's STARTED write, held back by the backend for the task's first round trip."""

    task_id: str
    call: ResultStoreCall
    backend: "ResultBackend"

    def send(self) -> None:
        """Write it now, on the backend's own client, with its retries."""
        self.backend.store_now(self.call)

    def rides_with(self, client: Any) -> bool:
        """Whether ``client`` talks to the backend's server: then the write may go in its pipeline."""
        return same_server(self.backend.client, client)


def same_server(a: Any, b: Any) -> bool:
    """Whether two redis clients talk to the same server and database (pure)."""
    def where(client: Any) -> tuple[Any, ...]:
        kw = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
        if kw is None:
            return (id(client),)
        return kw.get("host"), kw.get("port"), kw.get("path"), kw.get("db", 0)
    return where(a) == where(b)


_held = threading.local()   # the STARTED write of the task this thread runs


def take_started(task_id: str) -> HeldStarted | None:
    """The STARTED write this thread's backend held back for ``task_id`` (once), else None."""
    held: HeldStarted | None = getattr(_held, "started", None)
    _held.started = None
    return held if held is not None and held.task_id == task_id else None


class NodePools:
    """A cluster client's node connection pools seen as one pool: what Celery resets after a
    fork and before it reconnects its result subscriber."""

    def __init__(self, cluster: RedisCluster):
        self._cluster = cluster

    def reset(self) -> None:
        for node in self._cluster.get_nodes():
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.reset()


class ClusterResults(RedisCluster):
    """The result backend's client on a Redis Cluster (see the module's docstring)."""

    @property
    def connection_pool(self) -> NodePools:
        return NodePools(self)

    def mget(self, keys: Any, *args: Any) -> list[Any]:
        """The values of keys of any slots (one MGET per slot), in order."""
        return self.mget_nonatomic(keys, *args)

    def pubsub(self, **kwargs: Any) -> redis.client.PubSub:
        """A pub/sub connection to one master, chosen at random (each reconnect may find
        another, should that one be down)."""
        node = random.choice(self.get_primaries())
        return node.redis_connection.pubsub(**kwargs)


# the connection parameter holding a cluster URL (ResultBackend._params_from_url)
CLUSTER_URL = "gt_cluster_url"


class ResultBackend(RedisBackend):
    def _params_from_url(self, url: str, defaults: dict[str, Any]) -> dict[str, Any]:
        """A cluster URL is kept whole: its client is made by ``core.redis_client.connect``."""
        if is_cluster_url(url):
            return {CLUSTER_URL: url}
        return super()._params_from_url(url, defaults)

    def _create_client(self, **params: Any) -> Any:
        if params.get(CLUSTER_URL):
            return connect(params[CLUSTER_URL], cluster_class=ClusterResults)
        return super()._create_client(**params)

    def as_uri(self, include_password: bool = False) -> str:
        """The backend's URL as the worker's banner shows it (a cluster URL, which kombu's
        URL parser cannot read, without its credentials)."""
        if self.url and is_cluster_url(self.url) and not include_password:
            return without_credentials(self.url)
        return super().as_uri(include_password)

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        return bool(super().exception_safe_to_retry(exc)) or is_out_of_memory(exc)

    def on_task_call(self, producer: Any, task_id: str) -> None:
        """Nothing: Celery's Redis backend subscribes to every task's result channel as the
        task is sent, a round trip per submit and, in a producer that never waits (the REST
        API, beat), a pub/sub connection whose unread results pile up in Redis's output
        buffer.  A caller that waits (``TaskHandle.get``) subscribes then, and reads the
        stored result after subscribing, so a task that finished first is not missed."""

    def _store_result(self, task_id: Any, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        """Celery's ``_store_result`` (the meta, its size limit, the failure expiry) in one
        round trip: a stored success is kept by the script, not by a read before."""
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)
        expires = self.failure_expires if state == states.FAILURE else self.expires
        call = ResultStoreCall(self.get_key_for_task(task_id), value, int(expires or 0),
                               reply_channel_of(request) if state in states.READY_STATES else "")
        tid = bytes_to_str(task_id)
        if state == states.STARTED and self._holds_started(tid, request):
            _held.started = HeldStarted(tid, call, self)
            return result
        held = getattr(_held, "started", None)
        if held is not None and held.task_id == tid:   # a later state of it stands instead
            _held.started = None
        self.store_now(call)
        return result

    def store_now(self, call: ResultStoreCall) -> None:
        self.ensure(lambda: scripts_for(self.client).run(call), ())

    def _holds_started(self, task_id: str, request: Any) -> bool:
        """Whether the task runs in this thread now (Celery's tracer pushed its request) and
        takes its STARTED write along itself (STARTED_WITH_FIRST_TRIP)."""
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        return bool(getattr(task, STARTED_WITH_FIRST_TRIP, False)) and task.request.id == task_id
