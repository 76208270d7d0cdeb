"""Tenant quotas at submit, as typed calls of lua/tenants/quota_take.lua and lua/tenants/quota_refund.lua
(give back or settle).

Two quotas, taken together or not at all in one atomic call, so parallel submits
never exceed them:

* tasks per clock hour (the tier's ``max_tasks_per_hour``), one counter per tenant
  and hour (``Keys.quota``) that every path counts in: the Python API and REST here,
  cron fires in beat (``beat.cron_calls.CronFireCall.quota``: this script, once the run is
  claimed);
* optionally, the tenant's own TPM bucket (its ``tpm``, else its tier's
  ``tenant_tpm``): a continuous bucket of one minute's tokens, debited by the task's
  estimate at submit and settled to the upstream's reported usage when the task ends
  (``tpm_settle``: the unused part back, or what it used beyond the estimate charged) --
  beside the pool's bucket, which still paces the upstream calls.

A refusal is ``QuotaExceeded`` with ``reason`` and ``retry_after_s`` (the hour's
reset, or the time the bucket needs to hold the request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, ClassVar

from gateway_tasks.core.errors import PromptTooLarge, QuotaExceeded
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import layout, text

HOUR_MS = 3_600_000
QUOTA_TTL_MS = 2 * HOUR_MS       # an hour's counter outlives its hour
TASKS_PER_HOUR = "tasks_per_hour"
TENANT_TPM = "tenant_tpm"


def hour_of(now_ms: int) -> int:
    """The clock hour a time falls in (epoch ms // 1 h): the name of its quota counter."""
    return now_ms // HOUR_MS


def hour_reset_s(now_ms: int) -> float:
    """Seconds from now_ms until the next clock hour starts (the hourly quota's reset)."""
    return ((hour_of(now_ms) + 1) * HOUR_MS - now_ms) / 1000.0


def reset_iso(now_ms: int, after_s: float) -> str:
    """The UTC time now_ms + after_s, as ISO 8601 to the second."""
    return datetime.fromtimestamp(now_ms / 1000.0 + after_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def effective_tpm(tenant_tpm: int, tier_tenant_tpm: int) -> int:
    """A tenant's TPM quota: its own when set, else its tier's (0 = none)."""
    return tenant_tpm if tenant_tpm > 0 else tier_tenant_tpm


@dataclass(frozen=True)
class QuotaTaken:
    ok: bool
    count: int = 0                 # tasks of this hour (taken), or the hour's count (refused)
    reason: str = ""               # refused: TASKS_PER_HOUR | TENANT_TPM
    wait_ms: int = 0               # refused by the TPM bucket: until it holds the tokens


@dataclass(frozen=True)
class QuotaTakeCall:
    SCRIPT: ClassVar[str] = "tenants/quota_take"

    keys: Keys
    tenant_id: str
    now_ms: int            # the caller's clock (names the hour's counter; the bucket uses Redis TIME)
    max_per_hour: int      # 0: not counted here (a cron fire: beat counted it)
    est_tokens: int
    tpm: int               # 0: no TPM quota

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(counter=self.keys.quota(self.tenant_id, hour_of(self.now_ms)),
                                        bucket=self.keys.tenant_bucket(self.tenant_id))

    @property
    def script_args(self) -> list[int]:
        return layout(self.SCRIPT).args(max_per_hour=self.max_per_hour, counter_ttl_ms=QUOTA_TTL_MS,
                                        est_tokens=self.est_tokens, tpm=self.tpm)

    def parse(self, reply: Any) -> QuotaTaken:
        if int(reply[0]) == 1:
            return QuotaTaken(True, int(reply[1]))
        reason = text(reply[1])
        if reason == TENANT_TPM:
            return QuotaTaken(False, reason=reason, wait_ms=int(reply[2]))
        return QuotaTaken(False, count=int(reply[2]), reason=reason)

    def refusal(self, taken: QuotaTaken) -> QuotaExceeded:
        """The error a refused take raises: which quota, its limit, when to retry."""
        if taken.reason == TENANT_TPM:
            wait_s = max(0.001, taken.wait_ms / 1000.0)
            return QuotaExceeded(
                f"tenant {self.tenant_id!r} is over its TPM quota ({self.tpm} tokens per minute): "
                f"this request needs {self.est_tokens} tokens; retry in {wait_s:.1f} s",
                retry_after_s=wait_s, reason=TENANT_TPM)
        wait_s = hour_reset_s(self.now_ms)
        return QuotaExceeded(
            f"tenant {self.tenant_id!r} has used its quota of {self.max_per_hour} tasks per hour "
            f"({taken.count} this hour); it resets at {reset_iso(self.now_ms, wait_s)} "
            f"(in {math.ceil(wait_s)} s)", retry_after_s=wait_s, reason=TASKS_PER_HOUR)

    def check_fits(self) -> None:
        """A request larger than the whole TPM bucket could never be admitted."""
        if self.tpm and self.est_tokens > self.tpm:
            raise PromptTooLarge(f"the request's {self.est_tokens} estimated tokens exceed tenant "
                                 f"{self.tenant_id!r}'s TPM quota of {self.tpm}; it could never be admitted")


@dataclass(frozen=True)
class QuotaRefundCall:
    """Give back a take whose task was then not enqueued (``tokens`` None: all its tokens),
    or settle a tenant's TPM bucket by ``tokens`` (negative: charged)."""

    SCRIPT: ClassVar[str] = "tenants/quota_refund"

    take: QuotaTakeCall
    counted: bool
    tokens: int | None = None

    @property
    def script_keys(self) -> list[str]:
        t = self.take
        return layout(self.SCRIPT).keys(counter=t.keys.quota(t.tenant_id, hour_of(t.now_ms)),
                                        bucket=t.keys.tenant_bucket(t.tenant_id))

    @property
    def script_args(self) -> list[int]:
        t = self.take
        tokens = t.est_tokens if self.tokens is None else self.tokens
        return layout(self.SCRIPT).args(counted=1 if self.counted else 0, tokens=tokens, tpm=t.tpm)

    def parse(self, reply: Any) -> int:
        return int(reply)


def tpm_settle(keys: Keys, tenant_id: str, tokens: int, tpm: int) -> QuotaRefundCall:
    """Settle a tenant's TPM bucket by ``tokens``: a task's estimate less what the upstream
    reported it used (positive: given back; negative: charged; a task that never reached the
    upstream gives back all of it).  Its hourly count stays taken: the task was submitted."""
    return QuotaRefundCall(QuotaTakeCall(keys, tenant_id, 0, 0, 0, tpm), counted=False, tokens=tokens)
