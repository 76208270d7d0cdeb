"""What a running task holds and gives back: its ``Reservation``.

A task holds tokens it may not use:

* the pool's bucket -- tokens and one request slot, debited by pick.lua at dispatch
  (``Dispatch``; nothing when it was dispatched stale) and by take.lua on each backup
  pool it fails over to;
* its tenant's own TPM bucket -- its estimate, taken at submit by lua/tenants/quota_take.lua
  when the tenant has a TPM quota.

``Reservation.settle`` is the one place any of it goes back, in one round trip: the
pool that served the call is settled to the upstream's usage (and follows the reply's
rate-limit headers); every other debit is given back whole, except one a 429 drained
(the upstream counted it); the tenant's TPM bucket is settled to the call's usage like the
pool's (what it did not use back, what it used beyond the estimate charged) -- all of the
estimate back when the task ends without a call, nothing while the task runs again (a
requeue or another dispatch of it still holds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.tenants.quota import tpm_settle
from gateway_tasks.core.scripts import ScriptCall, scripts_for
from gateway_tasks.core.settings import Pool
from gateway_tasks.bucket.pool_bucket import LEARN_EWMA_WEIGHT, remaining_from_headers
from gateway_tasks.bucket.calls import SettleCall, Settled
from gateway_tasks.upstream.client import UpstreamReply


@dataclass
class Debit:
    """Tokens and a request slot taken from one pool's bucket for this task."""

    pool: Pool
    tokens: int
    request: bool                     # a request slot was taken too
    debited_total: float | None       # the pool's running totals right after the debit (None: unknown)
    dispatches_total: int | None
    spent: bool = False               # a 429 drained the bucket: the upstream counted it, nothing goes back


@dataclass(frozen=True)
class Used:
    """The upstream call that served the task: its pool, model and reply."""

    pool: Pool
    model: str
    reply: UpstreamReply


@dataclass(frozen=True)
class Settlement:
    settled: Settled | None      # the serving pool's bucket after its settle (None: no call served)
    also: list[Any]              # the replies of the extra script calls, in order
    reads: list[Any]             # the replies of the extra reads, in order


class Reservation:
    def __init__(self, client: redis.Redis, keys: Keys, tier: str, tenant_id: str):
        self.r, self.keys = client, keys
        self.tier, self.tenant_id = tier, tenant_id
        self.debits: list[Debit] = []
        self.tenant_tokens = 0       # taken from the tenant's TPM bucket at submit
        self.tenant_tpm = 0

    def hold(self, debit: Debit) -> None:
        """A debit of a pool's bucket this task now holds."""
        if debit.tokens > 0 or debit.request:
            self.debits.append(debit)

    def hold_tenant_tokens(self, tokens: int, tpm: int) -> None:
        """The tokens taken from the tenant's TPM bucket at submit (tpm 0: none were)."""
        self.tenant_tokens, self.tenant_tpm = (tokens, tpm) if tpm > 0 else (0, 0)

    def drained(self, pool: Pool) -> None:
        """A 429 of ``pool`` drained its bucket: its debit stays spent."""
        for debit in self.debits:
            if debit.pool.name == pool.name:
                debit.spent = True

    def debit_on(self, pool: Pool) -> Debit | None:
        return next((d for d in self.debits if d.pool.name == pool.name), None)

    def settle(self, used: Used | None, *, ends: bool, model: str = "",
               also: Sequence[ScriptCall[Any]] = (), reads: Sequence[tuple[str, ...]] = ()) -> Settlement:
        """Give back whatever was reserved and not used, in one round trip with the script
        calls ``also`` and the reads ``reads``.  ``used``: the call that served the task
        (None: none did); ``ends``: the task ends here (False: it runs again -- requeued, or
        another dispatch of it runs -- and keeps its tenant's tokens); ``model``: the
        request's model (named in the bucket's records of a refund)."""
        calls: list[ScriptCall[Any]] = []
        served_at = -1
        for debit in self.debits:
            if used is not None and debit.pool.name == used.pool.name:
                served_at = len(calls)
                calls.append(self._settle_used(debit, used))
            elif not debit.spent:
                calls.append(self._give_back(debit, model))
        if used is not None and served_at < 0:   # served without a debit here (not dispatched by pick.lua)
            served_at = len(calls)
            calls.append(self._settle_used(Debit(used.pool, 0, False, None, None), used))
        # the tenant's bucket settled to the usage: what the call did not use back, what it used
        # beyond the estimate charged (n choices, an overrun of a learned completion length)
        unused = self.tenant_tokens - (used.reply.total_tokens if used is not None else 0)
        if self.tenant_tpm and unused != 0 and (used is not None or (ends and unused > 0)):
            calls.append(tpm_settle(self.keys, self.tenant_id, unused, self.tenant_tpm))
        if not calls and not also and not reads:
            return Settlement(None, [], [])
        self.debits = []
        self.tenant_tokens = 0
        replies, got = scripts_for(self.r).run_together([*calls, *also], reads)
        settled = replies[served_at] if served_at >= 0 else None
        return Settlement(settled, replies[len(calls):], got)

    def _settle_used(self, debit: Debit, used: Used) -> SettleCall:
        reply = used.reply
        rem = remaining_from_headers(reply.headers)
        return SettleCall(self.keys, used.pool, tier=self.tier, tenant_id=self.tenant_id, model=used.model,
                          est_tokens=debit.tokens, actual_tokens=reply.total_tokens,
                          completion_tokens=reply.completion_tokens, learn_weight=LEARN_EWMA_WEIGHT,
                          give_back_request=False, remaining_tokens=rem.tokens,
                          remaining_requests=rem.requests, debited_tokens_at_dispatch=debit.debited_total,
                          dispatches_at_dispatch=debit.dispatches_total)

    def _give_back(self, debit: Debit, model: str) -> SettleCall:
        """The whole debit back: the upstream never counted it."""
        return SettleCall(self.keys, debit.pool, tier=self.tier, tenant_id=self.tenant_id, model=model,
                          est_tokens=debit.tokens, actual_tokens=0, completion_tokens=0, learn_weight=0,
                          give_back_request=debit.request)
