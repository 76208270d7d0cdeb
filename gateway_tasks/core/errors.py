"""The one error hierarchy: everything gateway-tasks raises on purpose.

    GatewayError
    ├── ConfigError          settings missing (REDIS_URL...), malformed or inconsistent
    ├── StartupError         a service a process needs does not come up (Redis, a worker)
    ├── InvalidRequest       a request rejected before anything was enqueued
    │   ├── UnknownTenant
    │   ├── PromptTooLarge
    │   └── CronError
    ├── Rejected             a valid request the gateway will not run now (retry_after_s)
    │   ├── QueueFull
    │   ├── QuotaExceeded
    │   └── Deferred         overload: the tier's new work is deferred at this load level
    ├── DeadlineExceeded     waited past its deadline; the upstream was not called
    ├── UpstreamError        the upstream failed in a way retries could not hide
    └── ApiError             an HTTP-level refusal with its status code (REST, simulator)
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """Base class of every error raised by gateway-tasks."""


class ConfigError(GatewayError):
    """Settings are missing, malformed or inconsistent."""


class StartupError(GatewayError):
    """A process cannot start: a required service or setting is not there."""


class InvalidRequest(GatewayError):
    """A request was rejected before anything was enqueued."""


class UnknownTenant(InvalidRequest):
    """The tenant id is not registered."""


class PromptTooLarge(InvalidRequest):
    """The prompt (plus max_tokens) cannot fit the model or the pool."""


class CronError(InvalidRequest):
    """A cron definition is malformed (bad expression, unknown tenant...)."""


class Rejected(GatewayError):
    """A valid request the gateway will not take now; ``retry_after_s`` says when to try again."""

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(Rejected):
    """Tier-aware tail drop: the tier's queue is at its limit."""


class QuotaExceeded(Rejected):
    """A per-tier or per-tenant quota (e.g. tasks per hour) is used up."""


class Deferred(Rejected):
    """Overload: at the current load level new work of this tier is not taken; try again
    after ``retry_after_s``.  ``reason`` says why in words, ``level`` is the load level."""

    def __init__(self, message: str, *, retry_after_s: float, reason: str, level: int):
        super().__init__(message, retry_after_s=retry_after_s)
        self.reason = reason
        self.level = level


class DeadlineExceeded(GatewayError):
    """The task waited in the queue past its deadline; the upstream was not called."""


class UpstreamError(GatewayError):
    """The upstream failed in a way retries could not hide."""


class ApiError(GatewayError):
    """An HTTP-level refusal (auth, not found, timeout, rate limit) with its status code."""

    def __init__(self, status: int, type_: str, message: str,
                 headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message
        self.headers = headers or {}
        self.extra = extra
