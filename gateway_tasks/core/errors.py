"""The one error hierarchy: everything gateway-tasks raises on purpose.

    GatewayError
    ├── ConfigError          settings missing (REDIS_URL...), malformed or inconsistent
    ├── StartupError         a service a process needs does not come up (Redis, a worker)
    ├── InvalidRequest       a request rejected before anything was enqueued
    │   ├── UnknownTenant
    │   ├── PromptTooLarge
    │   ├── UnknownTask      a task id the caller never submitted (or long forgotten)
    │   │   └── TaskNotFound a task looked up (result, show, a batch) that is not there
    │   └── CronError
    ├── Rejected             a valid request the gateway will not run now (reason, retry_after_s)
    │   ├── QueueFull
    │   │   └── Evicted      queued, then dropped for a higher tier's arrival (shared capacity full)
    │   ├── QuotaExceeded    tasks per hour, or the tenant's TPM quota (reason says which)
    │   └── Deferred         overload: the tier's new work is deferred at this load level
    ├── DeadlineExceeded     waited past its deadline; the upstream was not called
    │   └── Expired          waited past its tier's queue TTL (stale-drop)
    ├── TaskCancelled        cancelled by its owner (queued: never ran; running: result discarded)
    ├── DependencyFailed     a task it depends on (depends_on) did not succeed; it never ran
    ├── DeadLettered         a queued message no worker can run, taken off with its reason
    ├── UpstreamError        the upstream failed in a way retries could not hide
    │   ├── RetryBudgetExceeded  the task's attempts (by tier) are spent (retry_after_s)
    │   └── UpstreamRejected     the upstream refused the request with a 4xx: the caller's error
    ├── RedisUnavailable     Redis is unreachable or refused the write: nothing was enqueued
    │   └── RedisFull        Redis is at its maxmemory (noeviction): submits are refused
    └── ApiError             an HTTP-level refusal with its status code (REST, simulator)

A process that stops on one of them (a ``gateway`` command, a worker, beat) prints one
line and exits with ``exit_status(exc)``: EXIT_CONFIG (78, sysexits' EX_CONFIG) for a
ConfigError, EXIT_REDIS_UNAVAILABLE (69, EX_UNAVAILABLE) for RedisUnavailable and
RedisFull, EXIT_FAILED (2) for the others.
"""

from __future__ import annotations

from typing import Any

EXIT_FAILED = 2
EXIT_REDIS_UNAVAILABLE = 69
EXIT_CONFIG = 78


class GatewayError(Exception):
    """Base class of every error raised by gateway-tasks."""


class ConfigError(GatewayError):
    """Settings are missing, malformed or inconsistent."""


class StartupError(GatewayError):
    """A process cannot start: a required service or setting is not there."""


class PortTaken(StartupError):
    """A child server could not bind its port: something else took it first."""


class InvalidRequest(GatewayError):
    """A request was rejected before anything was enqueued."""


class UnknownTenant(InvalidRequest):
    """The tenant id is not registered."""


class PromptTooLarge(InvalidRequest):
    """The prompt (plus max_tokens) cannot fit the model or the pool."""


class UnknownTask(InvalidRequest):
    """No task of this id for this tenant (another tenant's ids look the same: unknown)."""


class TaskNotFound(UnknownTask):
    """A task (or a batch, a file) looked up by id is not there: never submitted, another
    tenant's, or its record expired.  Raised at once, never after a wait (REST: 404)."""


class CronError(InvalidRequest):
    """A cron definition is malformed (bad expression, unknown tenant...)."""


class _Explained(GatewayError):
    """An error with a machine-readable ``reason`` and, where it applies, ``retry_after_s``.

    Both travel in ``args`` (message, retry_after_s, reason), so the error survives the
    JSON result backend: Celery rebuilds it as ``cls(*args)`` and a caller of
    ``TaskHandle.get()`` gets the same type with the same fields; ``str()`` is the message."""

    def __init__(self, message: str, retry_after_s: float | None = None, reason: str = ""):
        super().__init__(message, retry_after_s, reason)
        self.message = message
        self.retry_after_s = None if retry_after_s is None else float(retry_after_s)
        self.reason = reason

    def __str__(self) -> str:
        return self.message

    def details(self) -> dict[str, Any]:
        """The fields a REST error body adds to type and message."""
        out: dict[str, Any] = {}
        if self.reason:
            out["reason"] = self.reason
        if self.retry_after_s is not None:
            out["retry_after_s"] = round(self.retry_after_s, 3)
        return out


class Rejected(_Explained):
    """A valid request the gateway will not take now; ``retry_after_s`` says when to try again."""


class QueueFull(Rejected):
    """Tier-aware tail drop: the tier's queue is at its limit."""


class Evicted(QueueFull):
    """The task was queued, then dropped to make room for a higher tier's arrival
    (the pool's shared queue capacity was full); it never reached the upstream."""


class QuotaExceeded(Rejected):
    """A per-tier or per-tenant quota is used up: reason 'tasks_per_hour' (the tier's
    max_tasks_per_hour; retry_after_s = until the clock hour resets) or 'tenant_tpm'
    (the tenant's token bucket; retry_after_s = until it holds the request's tokens)."""


class Deferred(Rejected):
    """Overload: at the current load level new work of this tier is not taken; try again
    after ``retry_after_s``.  ``reason`` says why in words, ``level`` is the load level."""

    def __init__(self, message: str, retry_after_s: float | None = None, reason: str = "",
                 level: int = 0):
        super().__init__(message, retry_after_s, reason)
        self.args = (message, retry_after_s, reason, level)   # survives the JSON result backend
        self.level = int(level)

    def details(self) -> dict[str, Any]:
        return {**super().details(), "level": self.level}


class DeadlineExceeded(_Explained):
    """The task waited in the queue past its deadline; the upstream was not called."""


class DeadLettered(GatewayError):
    """A message on a gateway queue that no worker can run (not JSON, not a Celery task
    message, an impossible token estimate): taken off the queue and recorded with the reason."""


class RedisUnavailable(GatewayError):
    """Redis (queues, tenants, buckets) is unreachable or refused the write; the request was
    not enqueued (REST: 503).  ``str()`` is the detail for logs and Python callers (the
    client's error, no credentials); ``cause`` says what happened in a few words
    ("connection refused", "authentication failed"); ``public_message`` is what a REST
    client is told instead of the detail."""

    public_message = "the gateway's Redis is unreachable; retry later"

    def __init__(self, message: str, cause: str = ""):
        super().__init__(message)
        self.cause = cause


class RedisFull(RedisUnavailable):
    """Redis is at its ``maxmemory`` with ``noeviction``: submits are refused, nothing is evicted."""

    public_message = "the gateway's Redis is full; retry later"


class Expired(DeadlineExceeded):
    """The task waited past its tier's queue TTL (``queue_ttl_s``): stale, dropped before
    it reached the upstream."""


class TaskCancelled(_Explained):
    """The task was cancelled by its owner (``Gateway.cancel``, ``DELETE /v1/tasks/{id}``,
    a synchronous caller that went away): reason 'queued' (removed, never ran) or
    'running' (revoked; a call already in flight finishes and its result is discarded)."""


class DependencyFailed(_Explained):
    """A task named in ``depends_on`` ended without succeeding (failed, cancelled, evicted,
    expired); the dependent task was not run."""


class UpstreamError(_Explained):
    """The upstream failed in a way retries could not hide."""


class RetryBudgetExceeded(UpstreamError):
    """The task's attempts (the tier's ``max_attempts``, 429s included) or the tier's
    retry budget are spent; ``retry_after_s`` is the upstream's Retry-After when known."""


class UpstreamRejected(UpstreamError):
    """The upstream refused the request with a 4xx other than 429 (an unknown parameter, a
    prompt past the model's context window, an unknown model): the caller's error, so it is
    never retried, and it tells nothing of the upstream's health.  It carries the upstream's
    ``status`` and its OpenAI error object (``upstream_message``, ``type``, ``param``,
    ``code``, as the upstream sent them); ``message`` is the gateway's sentence around them.

    All fields travel in ``args``, so the error survives the JSON result backend (Celery
    rebuilds it as ``cls(*args)``)."""

    def __init__(self, message: str, retry_after_s: float | None = None, reason: str = "",
                 status: int = 400, upstream_message: str = "", type_: str = "",
                 param: str | None = None, code: str | None = None):
        super().__init__(message, retry_after_s, reason)
        self.args = (message, retry_after_s, reason, status, upstream_message, type_, param, code)
        self.status = int(status)
        self.upstream_message, self.type, self.param, self.code = upstream_message, type_, param, code

    def openai_error(self) -> dict[str, Any]:
        """The upstream's error object: ``{"message", "type", "param", "code"}``."""
        return {"message": self.upstream_message, "type": self.type, "param": self.param, "code": self.code}

    def details(self) -> dict[str, Any]:
        return {**super().details(), "status": self.status, "upstream": self.openai_error()}


class ApiError(GatewayError):
    """An HTTP-level refusal (auth, not found, timeout, rate limit) with its status code."""

    def __init__(self, status: int, type_: str, message: str,
                 headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message
        self.headers = headers or {}
        self.extra = extra


def exit_status(exc: GatewayError) -> int:
    """The exit status of a process that stops on ``exc``."""
    if isinstance(exc, ConfigError):
        return EXIT_CONFIG
    if isinstance(exc, RedisUnavailable):
        return EXIT_REDIS_UNAVAILABLE
    return EXIT_FAILED
