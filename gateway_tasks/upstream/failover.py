"""The VIP fallback channel at dispatch: a reserved-tier task whose pool failed it
(a 429, a 5xx / timeout / connection error, or a circuit that is open) is served
by one of the pool's ``backup_pools`` on this same dispatch -- the second
attempt -- debiting the backup's bucket (lua/bucket/take.lua) and settling there.
Other tiers never fail over: they wait (their pool is held by the drain or the
open circuit).  New reserved-tier submissions are routed to a backup by the
producer while the primary is unavailable (gateway_tasks/upstream/health.py); once
a half-open probe succeeds the circuit closes and traffic fails back.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import openai
import redis

from gateway_tasks.core.errors import UpstreamRejected
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool, Settings
from gateway_tasks.core.stats import FAILOVERS, UPSTREAM_ERRORS
from gateway_tasks.bucket.pool_bucket import PoolBucket, retry_after_ms
from gateway_tasks.bucket.calls import TakeCall
from gateway_tasks.upstream.circuit import PROBE, PoolCircuit
from gateway_tasks.upstream.reservation import Debit, Reservation, Used
from gateway_tasks.upstream.client import UpstreamReply

logger = logging.getLogger(__name__)

TRANSIENT = (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError)


def model_on(pool: Pool, model: str) -> str:
    """The model a backup serves for ``model``: the same when it has it, else its first."""
    return model if model in pool.models else pool.model


def fail_over(client: redis.Redis, keys: Keys, settings: Settings, primary: Pool, backups: Sequence[Pool],
              call: Callable[[Pool, str], UpstreamReply], reservation: Reservation, *, model: str,
              est_tokens: int, tier: str, reason: str) -> tuple[Used | None, list[str]]:
    """Try each backup in order; (the call that served, None if none could) and what each
    said.  Each backup's debit is held by ``reservation`` (its ``settle`` gives back what
    was not used); a 4xx the caller caused is raised: no other backup is tried."""
    scripts = scripts_for(client)
    notes: list[str] = []
    for backup in backups:
        circuit = PoolCircuit(client, keys, settings.circuit, backup)
        gate = circuit.allow()
        if not gate.may_call:
            notes.append(f"{backup.name}: circuit {gate.state}")
            continue
        est = min(est_tokens, int(backup.token_capacity))
        taken = scripts.run(TakeCall(keys, backup, est))
        if not taken.admitted:
            notes.append(f"{backup.name}: bucket admits in {taken.wait_ms} ms")
            continue
        reservation.hold(Debit(backup, est, True, taken.debited_tokens, taken.dispatches))
        used_model = model_on(backup, model)
        try:
            reply = call(backup, used_model)
        except openai.RateLimitError as exc:
            PoolBucket(client, keys, backup).drain(retry_after_ms(dict(exc.response.headers)), est)
            reservation.drained(backup)
            notes.append(f"{backup.name}: 429")
            continue
        except TRANSIENT as exc:
            client.hincrby(keys.stats(backup.name), UPSTREAM_ERRORS, 1)
            circuit.failure()
            notes.append(f"{backup.name}: {type(exc).__name__}")
            continue
        except UpstreamRejected:   # the caller's error: no other backup; the upstream answered
            if gate.verdict == PROBE:
                circuit.success()
            raise
        if not gate.clean or gate.verdict != "call":
            circuit.success()
        client.hincrby(keys.stats(primary.name), FAILOVERS, 1)
        logger.warning("failover: pool %s -> %s for a %s task (%s)", primary.name, backup.name, tier, reason)
        return Used(backup, used_model, reply), notes
    return None, notes
