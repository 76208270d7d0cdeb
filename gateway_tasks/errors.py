"""One base exception for everything gateway-tasks raises on purpose."""

from __future__ import annotations


class GatewayError(Exception):
    """Base class of every error raised by gateway-tasks."""


class ConfigError(GatewayError):
    """Settings are missing, malformed or inconsistent."""


class InvalidRequest(GatewayError):
    """A request was rejected before anything was enqueued."""


class UnknownTenant(InvalidRequest):
    """The tenant id is not registered."""


class PromptTooLarge(InvalidRequest):
    """The prompt (plus max_tokens) cannot fit the model or the pool."""


class QueueFull(GatewayError):
    """Tier-aware tail drop: the tier's queue is at its limit."""


class QuotaExceeded(GatewayError):
    """A per-tier or per-tenant quota (e.g. tasks per hour) is used up."""


class UpstreamError(GatewayError):
    """The upstream failed in a way retries could not hide."""


class CronError(InvalidRequest):
    """A cron definition is malformed (bad expression, unknown tenant...)."""
