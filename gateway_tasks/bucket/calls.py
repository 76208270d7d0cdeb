"""The upstream side of a pool's bucket as typed calls (``gateway_tasks.core.scripts.ScriptCall``)
of lua/bucket/settle.lua, lua/bucket/sync_limits.lua and lua/bucket/drain.lua, and the debit of
a failed-over call on a backup pool's bucket, lua/bucket/take.lua."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gateway_tasks.core.keys import BELL_MAX, Keys, learned_field
from gateway_tasks.core.scripts import layout, text
from gateway_tasks.core.settings import Pool
from gateway_tasks.core.stats import ACTUAL_TOKENS, COMPLETED, UPSTREAM_429, tier_field

NOT_REPORTED = -1  # sync_limits.lua's "the upstream did not say"


def bucket_rates(pool: Pool) -> dict[str, float]:
    """A pool's bucket as the scripts' ARGV name it (pick, settle, sync_limits, take)."""
    return dict(zip(("token_capacity", "tokens_per_ms", "request_capacity", "requests_per_ms"), pool.rates()))


@dataclass(frozen=True)
class PoolCall:
    """A script call on one pool's bucket."""

    keys: Keys
    pool: Pool

    @property
    def bucket_key(self) -> str:
        return self.keys.bucket(self.pool.name)

    @property
    def stats_key(self) -> str:
        return self.keys.stats(self.pool.name)


@dataclass(frozen=True)
class SettleCall(PoolCall):
    """Correct the bucket from the estimate debited at dispatch to the real usage."""

    SCRIPT: ClassVar[str] = "bucket/settle"

    tier: str
    tenant_id: str
    model: str
    est_tokens: int              # debited at dispatch
    actual_tokens: int           # prompt + completion; 0 when the upstream never saw the call
    completion_tokens: int
    learn_weight: float          # EWMA weight of the learned completion length (0 = do not learn)
    give_back_request: bool      # the upstream never saw the request: refund its slot too
    bell_max: int = BELL_MAX
    # what the reply's x-ratelimit-remaining-* said (None: not reported), and the pool's
    # running totals right after the task was dispatched (None: unknown)
    remaining_tokens: float | None = None
    remaining_requests: float | None = None
    debited_tokens_at_dispatch: float | None = None
    dispatches_at_dispatch: int | None = None

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(bucket=self.bucket_key, stats=self.stats_key,
                                        learned=self.keys.learned(self.pool.name), bell=self.keys.bell(self.pool.name))

    @property
    def script_args(self) -> list[str | int | float]:
        return layout(self.SCRIPT).args(
            **bucket_rates(self.pool), est_tokens=self.est_tokens, actual_tokens=self.actual_tokens,
            learned_field=learned_field(self.tenant_id, self.model), completion_tokens=self.completion_tokens,
            learn_weight=self.learn_weight, bell_max=self.bell_max, unsent=1 if self.give_back_request else 0,
            actual_tokens_field=tier_field(ACTUAL_TOKENS, self.tier), completed_field=tier_field(COMPLETED, self.tier),
            keep_unused=1 if self.pool.window == "strict" else 0,
            **remaining_args(self.remaining_tokens, self.remaining_requests, self.debited_tokens_at_dispatch,
                             self.dispatches_at_dispatch))

    def parse(self, reply: Any) -> "Settled":
        return Settled(float(reply[0]), float(reply[1]), int(reply[2]))


def _given(value: float | None) -> float:
    return NOT_REPORTED if value is None else value


def remaining_args(remaining_tokens: float | None, remaining_requests: float | None,
                   debited_at_dispatch: float | None, dispatches_at_dispatch: int | None) -> dict[str, float]:
    """What a reply said is left and the pool's totals at dispatch, as settle.lua and
    sync_limits.lua name them (NOT_REPORTED for what is not known)."""
    return dict(remaining_tokens=_given(remaining_tokens), remaining_requests=_given(remaining_requests),
                debited_at_dispatch=_given(debited_at_dispatch), dispatches_at_dispatch=_given(dispatches_at_dispatch))


@dataclass(frozen=True)
class Levels:
    tokens: float
    requests: float


@dataclass(frozen=True)
class Settled(Levels):
    now_ms: int   # Redis clock when the bucket was settled


@dataclass(frozen=True)
class SyncLimitsCall(PoolCall):
    """Lower the bucket to what the upstream says is left (never raises it)."""

    SCRIPT: ClassVar[str] = "bucket/sync_limits"

    remaining_tokens: float | None
    remaining_requests: float | None
    # the pool's running totals right after the task was dispatched (None: unknown)
    debited_tokens_at_dispatch: float | None = None
    dispatches_at_dispatch: int | None = None

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(bucket=self.bucket_key)

    @property
    def script_args(self) -> list[float]:
        return layout(self.SCRIPT).args(**bucket_rates(self.pool), **remaining_args(
            self.remaining_tokens, self.remaining_requests, self.debited_tokens_at_dispatch,
            self.dispatches_at_dispatch))

    def parse(self, reply: Any) -> Levels:
        return Levels(float(reply[0]), float(reply[1]))


@dataclass(frozen=True)
class DrainCall(PoolCall):
    """The upstream answered 429: block the pool until Retry-After, when the bucket holds what
    the refused request needed (lua/bucket/drain.lua)."""

    SCRIPT: ClassVar[str] = "bucket/drain"

    retry_after_ms: int
    est_tokens: int = 0   # the refused request's debit: the bucket holds it at Retry-After

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(bucket=self.bucket_key, stats=self.stats_key)

    @property
    def script_args(self) -> list[str | int | float]:
        return layout(self.SCRIPT).args(retry_after_ms=self.retry_after_ms, stats_field=UPSTREAM_429,
                                        est_tokens=min(float(self.est_tokens), self.pool.token_capacity))

    def parse(self, reply: Any) -> int:
        """The blocked-until time (ms since epoch, Redis clock)."""
        return int(reply)


@dataclass(frozen=True)
class Taken:
    admitted: bool
    wait_ms: int = 0
    debited_tokens: float | None = None
    dispatches: int | None = None


@dataclass(frozen=True)
class TakeCall:
    """lua/bucket/take.lua: debit a backup pool's bucket for one failed-over call, if it has room."""

    SCRIPT: ClassVar[str] = "bucket/take"

    keys: Keys
    pool: Pool
    est_tokens: int

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(bucket=self.keys.bucket(self.pool.name))

    @property
    def script_args(self) -> list[float | int]:
        return layout(self.SCRIPT).args(**bucket_rates(self.pool), est_tokens=self.est_tokens)

    def parse(self, reply: Any) -> Taken:
        if int(reply[0]) == 0:
            return Taken(False, int(reply[1]))
        return Taken(True, 0, float(text(reply[1])), int(reply[2]))
