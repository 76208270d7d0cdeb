"""The gateway's Redis clients: the one place a process makes one.

* ``connect(url)``: a client of the Redis at ``url`` -- a ``redis.Redis`` for one server
  (``redis://``, ``rediss://``, ``unix://``), a ``redis.cluster.RedisCluster`` for a Redis
  Cluster (``redis+cluster://host1:port,host2:port``, ``rediss+cluster://``: the listed nodes
  are seeds, the others are discovered), with the gateway's command packer
  (``core.packer``) and the URL's credentials and TLS options for every node;
  ``data_client(settings)`` is that client of the deployment's Redis (``settings.redis_url``:
  queues, tenants, buckets, results).  ``retry``: the client's retry policy (a worker task's
  rides a restart, ``core.redis_retry.riding_retry``); on a cluster it is the cluster
  client's, which also refreshes the slot map between attempts.
* ``async_client(url)``: the same with redis-py's asyncio clients (the REST result waiter);
  ``subscriber_urls(url)``: where a pub/sub subscriber may connect -- on a cluster, any
  node: a PUBLISH reaches every node of a cluster.
* ``node_client(client, key)``: the plain client of the node that owns ``key``'s hash slot
  (the client itself on one server), for a MULTI or a connection of one's own that must
  reach that node (``gateway_tasks.dispatch.enqueue``, the workers' poll connection);
  ``after_redirect(client, exc)`` refreshes a cluster client's slot map after such a node
  answered MOVED/ASK/CLUSTERDOWN or could not be reached (a failover, a master restarted,
  slots moved), so that the next ``node_client`` finds the new owner.
"""

from __future__ import annotations

import inspect
import logging
from functools import lru_cache
from typing import Any, Callable, Union

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway_tasks.core.packer import FAST_PACKER, connection_kwargs
from gateway_tasks.core.urls import cluster_nodes, is_cluster_url, node_url

log = logging.getLogger(__name__)

Client = Union[redis.Redis, RedisCluster]

# a node's answers that mean the slot map a client holds is out of date: the slot moved
# (MOVED, ASK), or the cluster is reconfiguring (CLUSTERDOWN, TRYAGAIN while a slot migrates)
REDIRECTS = (redis.exceptions.MovedError, redis.exceptions.AskError, redis.exceptions.ClusterDownError,
             redis.exceptions.TryAgainError)


class PackedConnection(redis.Connection):
    """A TCP connection with the gateway's command packer (a cluster's node pools are made
    from a connection class and drop the ``command_packer`` keyword)."""

    def __init__(self, **kwargs: Any):
        if FAST_PACKER is not None:
            kwargs.setdefault("command_packer", FAST_PACKER)
        super().__init__(**kwargs)


class PackedSSLConnection(redis.SSLConnection):
    """``PackedConnection`` over TLS."""

    def __init__(self, **kwargs: Any):
        if FAST_PACKER is not None:
            kwargs.setdefault("command_packer", FAST_PACKER)
        super().__init__(**kwargs)


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a cluster client (sync or asyncio)."""
    return isinstance(client, (RedisCluster, aiocluster.RedisCluster))


def node_options(url: str) -> dict[str, Any]:
    """The connection options every node of a cluster URL gets: the URL's credentials, TLS
    options and query parameters, as redis-py parses them for one server (no host, port, db)."""
    host, port = cluster_nodes(url)[0]
    options = parse_url(node_url(url, host, port))
    for name in ("host", "port", "db"):
        options.pop(name, None)
    return options


def connect(url: str, *, retry: Retry | None = None, cluster_class: type[RedisCluster] = RedisCluster,
            **kwargs: Any) -> Client:
    """A client of the Redis (or Redis Cluster) at ``url``; ``kwargs`` go to every connection
    (socket timeouts, ...); ``cluster_class``: the cluster client's class."""
    if not is_cluster_url(url):
        if retry is not None:
            kwargs["retry"] = retry
        return redis.Redis.from_url(url, **connection_kwargs(), **kwargs)
    options = node_options(url)
    tls = issubclass(options.pop("connection_class", redis.Connection), redis.SSLConnection)
    options["connection_class"] = PackedSSLConnection if tls else PackedConnection
    options.update(kwargs)
    if retry is not None:
        options["retry"] = retry
    return cluster_class(startup_nodes=[ClusterNode(h, p) for h, p in cluster_nodes(url)], **options)


# the transport's client: its calls made in kombu's event loop (a dispatch counter flush, an
# enqueue) fail at once rather than stall the loop behind a cluster client's back-off (ten
# retries, up to a second apart); one immediate retry reconnects a connection gone stale
FAIL_FAST = Retry(NoBackoff(), 1)


@lru_cache(maxsize=8)
def shared_client(url: str) -> Client:
    """One client of ``url`` per process (thread-safe), for the transport's channels: they
    come and go with broker connections, the deployment's Redis stays.  It fails fast
    (``FAIL_FAST``); what must ride a restart retries around it (``core.redis_retry``)."""
    return connect(url, retry=FAIL_FAST)


def data_client(settings: Any, who: str = "a gateway Redis client", *, retry: Retry | None = None,
                **kwargs: Any) -> Client:
    """A client of the deployment's Redis (``settings.redis_url``: a ConfigError saying that
    ``who`` needs it when it is not set)."""
    return connect(settings.require_redis_url(who), retry=retry, **kwargs)


_ASYNC_CLUSTER_PARAMS = frozenset(inspect.signature(aiocluster.RedisCluster.__init__).parameters) - {"self"}


def async_client(url: str, **kwargs: Any) -> Union[aioredis.Redis, aiocluster.RedisCluster]:
    """An asyncio client of the Redis (or Redis Cluster) at ``url``."""
    if not is_cluster_url(url):
        return aioredis.Redis.from_url(url, **kwargs)
    options = node_options(url)
    if issubclass(options.pop("connection_class", redis.Connection), redis.SSLConnection):
        options["ssl"] = True
    options = {k: v for k, v in options.items() if k in _ASYNC_CLUSTER_PARAMS}
    options.update(kwargs)
    nodes = [aiocluster.ClusterNode(h, p) for h, p in cluster_nodes(url)]
    return aiocluster.RedisCluster(startup_nodes=nodes, **options)


def subscriber_urls(url: str) -> list[str]:
    """Where a pub/sub subscriber of ``url``'s channels may connect, in order of preference:
    ``url`` itself for one server; each seed node of a cluster (PUBLISH reaches every node)."""
    if not is_cluster_url(url):
        return [url]
    return [node_url(url, host, port) for host, port in cluster_nodes(url)]


def server_client(url: str, address: tuple[str, int] | None = None, *,
                  wrap: Callable[[type[redis.Connection]], type[redis.Connection]] | None = None,
                  **kwargs: Any) -> redis.Redis:
    """A plain client of one server: ``url``'s, or on a cluster the node at ``address`` (with
    the cluster URL's credentials and TLS options).  ``wrap``: makes the class of its
    connections from the one it would use (a subclass)."""
    if is_cluster_url(url):
        if address is None:
            address = cluster_nodes(url)[0]
        url = node_url(url, *address)
    options = parse_url(url)
    base = options.pop("connection_class", redis.Connection)
    packed = {redis.Connection: PackedConnection, redis.SSLConnection: PackedSSLConnection}.get(base, base)
    options["connection_class"] = wrap(packed) if wrap is not None else packed
    options.update(kwargs)
    return redis.Redis(connection_pool=redis.ConnectionPool(**options))


def node_client(client: Client, key: str | bytes) -> redis.Redis:
    """The plain client of the node owning ``key``'s hash slot (``client`` on one server)."""
    if isinstance(client, RedisCluster):
        return client.get_node_from_key(key).redis_connection
    return client


def node_address(client: Client, key: str | bytes) -> tuple[str, int] | None:
    """(host, port) of the master owning ``key``'s slot, as ``client`` knows it; None on one
    server."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)
        return node.host, int(node.port)
    return None


def queue_time(pipe: Any) -> None:
    """Add Redis's TIME to a pipeline of either client: a cluster pipeline refuses
    ``pipe.time()``, and sends the command itself to one node, as any keyless command."""
    pipe.execute_command("TIME")


def after_redirect(client: Client, exc: BaseException | None = None) -> None:
    """After a node answered MOVED (or ASK, CLUSTERDOWN, TRYAGAIN) or could not be reached:
    refresh ``client``'s slot map (a MOVED names the new owner; anything else asks the
    nodes).  Nothing on one server; a refresh that finds no node answering keeps the old map
    (the next call tries again)."""
    if not isinstance(client, RedisCluster):
        return
    manager = client.nodes_manager
    try:
        if isinstance(exc, redis.exceptions.MovedError):
            manager.move_slot(exc)
        else:
            manager.initialize()
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as err:
        log.warning("Redis Cluster: slot map not refreshed (%s); trying again on the next call", err)
