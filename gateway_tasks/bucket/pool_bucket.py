"""The upstream side of a pool's TPM/RPM bucket: settle actual usage, follow
the upstream's x-ratelimit headers, and drain on 429 (see lua/bucket/settle.lua,
lua/bucket/sync_limits.lua, lua/bucket/drain.lua; lua/dispatch/pick.lua debits at dispatch)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import redis

from gateway_tasks.core.keys import Keys, learned_field
from gateway_tasks.core.scripts import ScriptCall, scripts_for
from gateway_tasks.core.settings import Pool
from gateway_tasks.bucket.calls import DrainCall, SettleCall, Settled, SyncLimitsCall

# the bucket's own fields: its hash also holds the pool's fair-queuing state (Keys.fair)
BUCKET_FIELDS = frozenset({"tokens", "requests", "ts_ms", "blocked_until_ms", "debited_tokens", "dispatches"})

LEARN_EWMA_WEIGHT = 0.2

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_MS = {"h": 3_600_000.0, "m": 60_000.0, "s": 1_000.0, "ms": 1.0}


def parse_duration_ms(text: str | None) -> float | None:
    """OpenAI's reset durations ('1s', '6m0s', '120ms', '1h2m3.5s') or plain seconds -> ms."""
    if text is None:
        return None
    text = text.strip()
    if not text:
        return None
    try:
        return float(text) * 1000.0
    except ValueError:
        pass
    parts = _DURATION_RE.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_MS[u] for n, u in parts)


def retry_after_ms(headers: Mapping[str, str], default_ms: float = 1_000.0) -> float:
    """Retry-After from a 429: retry-after-ms, then Retry-After seconds, then the token reset."""
    lower = {k.lower(): v for k, v in headers.items()}
    for key, scale in (("retry-after-ms", 1.0), ("retry-after", 1000.0)):
        if key in lower:
            try:
                return max(0.0, float(lower[key]) * scale)
            except ValueError:
                pass
    for key in ("x-ratelimit-reset-tokens", "x-ratelimit-reset-requests"):
        ms = parse_duration_ms(lower.get(key))
        if ms is not None:
            return ms
    return default_ms


@dataclass(frozen=True)
class Remaining:
    tokens: float | None
    requests: float | None


def remaining_from_headers(headers: Mapping[str, str]) -> Remaining:
    lower = {k.lower(): v for k, v in headers.items()}

    def num(key: str) -> float | None:
        try:
            return float(lower[key])
        except (KeyError, ValueError):
            return None

    return Remaining(num("x-ratelimit-remaining-tokens"), num("x-ratelimit-remaining-requests"))


class PoolBucket:
    """Python handle on one pool's bucket in Redis."""

    def __init__(self, client: redis.Redis, keys: Keys, pool: Pool):
        self.r = client
        self.keys = keys
        self.pool = pool
        self.scripts = scripts_for(client)

    def settle(self, *, est_tokens: int, actual_tokens: int, tier: str, tenant_id: str,
               model: str, completion_tokens: int, learn: bool = True,
               reached_upstream: bool = True) -> float:
        """Correct the bucket to the real usage; returns its token level after."""
        return self.settle_reply(est_tokens=est_tokens, actual_tokens=actual_tokens, tier=tier,
                                 tenant_id=tenant_id, model=model, completion_tokens=completion_tokens,
                                 learn=learn, reached_upstream=reached_upstream).tokens

    def settle_reply(self, *, est_tokens: int, actual_tokens: int, tier: str, tenant_id: str,
                     model: str, completion_tokens: int, learn: bool = True,
                     reached_upstream: bool = True, headers: Mapping[str, str] | None = None,
                     debited_tokens_at_dispatch: float | None = None,
                     dispatches_at_dispatch: int | None = None) -> Settled:
        """Correct the bucket to the real usage and, in the same call, follow the reply's
        x-ratelimit-remaining-* (``headers``; minus what was dispatched after the task:
        pass the pool's totals pick.lua reported with it)."""
        return self.scripts.run(self._settle_call(
            est_tokens=est_tokens, actual_tokens=actual_tokens, tier=tier, tenant_id=tenant_id, model=model,
            completion_tokens=completion_tokens, learn=learn, reached_upstream=reached_upstream,
            headers=headers, debited_tokens_at_dispatch=debited_tokens_at_dispatch,
            dispatches_at_dispatch=dispatches_at_dispatch))

    def settle_reply_and_read(self, reads: Sequence[tuple[str, ...]], also: Sequence[ScriptCall[Any]] = (),
                              **settle: Any) -> tuple[Settled, list[Any], list[Any]]:
        """``settle_reply(**settle)`` and, in the same round trip, the script calls ``also``
        and the read-only commands ``reads``: (settled, also's replies, reads' replies).
        Each script runs exactly once (``Scripts.run_together``)."""
        (settled, *done), got = self.scripts.run_together([self._settle_call(**settle), *also], reads)
        return settled, done, got

    def _settle_call(self, *, est_tokens: int, actual_tokens: int, tier: str, tenant_id: str,
                     model: str, completion_tokens: int, learn: bool = True,
                     reached_upstream: bool = True, headers: Mapping[str, str] | None = None,
                     debited_tokens_at_dispatch: float | None = None,
                     dispatches_at_dispatch: int | None = None) -> SettleCall:
        rem = remaining_from_headers(headers or {})
        return SettleCall(
            self.keys, self.pool, tier=tier, tenant_id=tenant_id, model=model,
            est_tokens=est_tokens, actual_tokens=actual_tokens, completion_tokens=completion_tokens,
            learn_weight=LEARN_EWMA_WEIGHT if learn else 0, give_back_request=not reached_upstream,
            remaining_tokens=rem.tokens, remaining_requests=rem.requests,
            debited_tokens_at_dispatch=debited_tokens_at_dispatch,
            dispatches_at_dispatch=dispatches_at_dispatch)

    def sync(self, headers: Mapping[str, str], debited_tokens_at_dispatch: float | None = None,
             dispatches_at_dispatch: int | None = None) -> tuple[float, float] | None:
        """Follow the upstream's x-ratelimit-remaining-*, minus what was dispatched after
        this task (pass the pool's totals pick.lua reported with it)."""
        rem = remaining_from_headers(headers)
        if rem.tokens is None and rem.requests is None:
            return None
        levels = self.scripts.run(SyncLimitsCall(self.keys, self.pool, rem.tokens, rem.requests,
                                                 debited_tokens_at_dispatch, dispatches_at_dispatch))
        return levels.tokens, levels.requests

    def drain(self, retry_after: float, est_tokens: int = 0) -> int:
        """A 429: nothing dispatched to the pool for ``retry_after`` ms, then ``est_tokens`` (the
        refused request's debit) there for it; returns the blocked-until time (Redis clock, ms)."""
        return self.scripts.run(DrainCall(self.keys, self.pool, int(retry_after), int(est_tokens)))

    def level(self) -> dict[str, float]:
        raw = self.r.hgetall(self.keys.bucket(self.pool.name))
        return {k.decode(): float(v) for k, v in raw.items() if k.decode() in BUCKET_FIELDS}

    def learned_completion(self, tenant_id: str, model: str) -> float | None:
        v = self.r.hget(self.keys.learned(self.pool.name), learned_field(tenant_id, model))
        return float(v) if v is not None else None
