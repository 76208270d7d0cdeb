"""Redis failures in the gateway's words.

Which of the Redis client's (and kombu's) errors mean that the gateway's Redis is
down or full, what happened in a few words ("connection refused", "authentication
failed", "at its maxmemory"), the same as ``RedisUnavailable`` / ``RedisFull``, and
the one line a command prints for them::

    Redis at redis://127.0.0.1:6379/0 is unreachable (connection refused); check REDIS_URL

Nothing here names a credential: redis-py's messages carry none, and the URL shown
is stripped of its userinfo and secret parameters (``core.urls.without_credentials``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import redis
from kombu.exceptions import OperationalError

from gateway_tasks.core.errors import RedisFull, RedisUnavailable
from gateway_tasks.core.urls import without_credentials

AUTHENTICATION_FAILED = "authentication failed"
AT_MAXMEMORY = "at its maxmemory"
# a Redis Cluster client's own errors for a cluster it cannot reach, or whose slots are not
# all served (a master down): not RedisErrors
CLUSTER_OUTAGES = (redis.exceptions.RedisClusterUnreachableError, redis.exceptions.SlotNotCoveredError)
# the client's errors that can be Redis being down, refusing us, or full
CLIENT_ERRORS = (redis.RedisError, OperationalError, *CLUSTER_OUTAGES)

# Telling Redis's "at maxmemory" refusal apart from other errors, on Redis 6.2 and 7.
#
# With ``maxmemory`` and ``noeviction`` Redis refuses every command that may grow
# memory (``-OOM command not allowed when used memory > 'maxmemory'``), and a
# script's first such write.  redis-py raises ``OutOfMemoryError`` for a plain
# command, and for a script's refused write on Redis 7, which keeps the error's
# code; Redis 6.2 wraps a script's error as ``ERR Error running script ...: -OOM
# command not allowed ...``, a plain ``ResponseError``.  ``is_out_of_memory``
# recognises both, and kombu's errors that carry the message.
OOM_MESSAGE = "command not allowed when used memory > 'maxmemory'"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write because it is at its maxmemory."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or OOM_MESSAGE in str(exc)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors it was raised from (kombu wraps redis-py, which wraps OSError)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the gateway's Redis cannot serve us now (unreachable, refusing
    our credentials, loading, read-only, at its maxmemory) rather than a bug in a command."""
    for err in _chain(exc):
        if isinstance(err, (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
                            redis.exceptions.ClusterDownError, *CLUSTER_OUTAGES)):
            return True
        if is_out_of_memory(err):
            return True
    return isinstance(exc, OperationalError)


def cause_of(exc: BaseException) -> str:
    """What happened, in a few lower-case words: 'connection refused', 'timed out'..."""
    chain = list(_chain(exc))
    if any(is_out_of_memory(err) for err in chain):
        return AT_MAXMEMORY
    for err in chain:
        if isinstance(err, redis.AuthenticationError):
            return AUTHENTICATION_FAILED
        if isinstance(err, redis.exceptions.BusyLoadingError):
            return "loading its data set"
        if isinstance(err, redis.exceptions.ReadOnlyError):
            return "a read-only replica"
        if isinstance(err, (redis.exceptions.ClusterDownError, *CLUSTER_OUTAGES)):
            return "the cluster is down or unreachable"
        if isinstance(err, (redis.TimeoutError, TimeoutError)):
            return "timed out"
        if isinstance(err, OSError) and err.strerror:
            return err.strerror.lower()
    return type(exc).__name__


def as_unavailable(exc: BaseException, what: str = "a Redis command",
                   consequence: str = "") -> RedisUnavailable:
    """``exc`` as RedisFull (at its maxmemory) or RedisUnavailable, the client's error in
    the message (for logs and Python callers) and its ``cause`` in words."""
    cause = cause_of(exc)
    tail = f"; {consequence}" if consequence else ""
    if cause == AT_MAXMEMORY:
        return RedisFull(f"{what} refused: Redis is at its maxmemory ({exc}){tail}", cause)
    return RedisUnavailable(f"{what} failed: Redis is unavailable ({type(exc).__name__}: {exc}){tail}",
                            cause)


@contextlib.contextmanager
def redis_errors(what: str, consequence: str = "") -> Iterator[None]:
    """Turn the Redis client's and kombu's errors into RedisUnavailable / RedisFull."""
    try:
        yield
    except (*CLIENT_ERRORS, OSError) as exc:
        raise as_unavailable(exc, what, consequence) from None


def unavailable_line(exc: RedisUnavailable, redis_url: str) -> str:
    """The one line a command prints when it stops on ``exc``."""
    where = f"Redis at {without_credentials(redis_url)}" if redis_url else "Redis"
    if isinstance(exc, RedisFull):
        return (f"{where} is full ({exc.cause or AT_MAXMEMORY}); free memory or raise its maxmemory, "
                f"with maxmemory-policy noeviction")
    if exc.cause == AUTHENTICATION_FAILED:
        return f"{where} refused the credentials ({exc.cause}); check REDIS_URL, REDIS_USERNAME and REDIS_PASSWORD"
    return f"{where} is unreachable ({exc.cause or 'unavailable'}); check REDIS_URL"
