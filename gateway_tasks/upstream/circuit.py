"""Each pool's circuit breaker (lua/upstream/circuit.lua) as a typed call and a small handle.

closed -> open after ``Circuit.failure_threshold`` consecutive 5xx / timeouts /
connection errors; open holds the pool's bucket (pick.lua admits nothing to it)
for ``open_s``; then one half-open probe: its success closes the circuit again
(failback), its failure re-opens it.  429s are not failures here: they drain
the bucket until Retry-After (lua/bucket/drain.lua).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import layout, scripts_for, text
from gateway_tasks.core.settings import Circuit, Pool
from gateway_tasks.core.stats import CIRCUIT_CLOSES, CIRCUIT_OPENS

ALLOW, SUCCESS, FAILURE = "allow", "success", "failure"
CALL, PROBE, WAIT = "call", "probe", "wait"          # allow's verdicts
OPENED, CLOSED_NOW = "opened", "closed"             # failure's / success's transitions


@dataclass(frozen=True)
class CircuitReply:
    state: str
    verdict: str
    until_ms: int
    failures: int

    @property
    def may_call(self) -> bool:
        return self.verdict in (CALL, PROBE)

    @property
    def clean(self) -> bool:
        """Closed with no failure counted: a success needs no write."""
        return self.state == "closed" and self.failures == 0


@dataclass(frozen=True)
class CircuitCall:
    SCRIPT: ClassVar[str] = "upstream/circuit"

    keys: Keys
    pool: str
    op: str
    circuit: Circuit

    @property
    def script_keys(self) -> list[str]:
        k = self.keys
        return layout(self.SCRIPT).keys(circuit=k.circuit(self.pool), bucket=k.bucket(self.pool),
                                        stats=k.stats(self.pool))

    @property
    def script_args(self) -> list[str | int]:
        c = self.circuit
        return layout(self.SCRIPT).args(op=self.op, failure_threshold=c.failure_threshold,
                                        open_ms=int(c.open_s * 1000), probe_timeout_ms=int(c.probe_timeout_s * 1000),
                                        opens_field=CIRCUIT_OPENS, closes_field=CIRCUIT_CLOSES)

    def parse(self, reply: Any) -> CircuitReply:
        return CircuitReply(text(reply[0]), text(reply[1]), int(reply[2]), int(reply[3]))


CLOSED = "closed"
READ_FIELDS = ("state", "failures")   # what closed_verdict needs of the circuit hash


def closed_verdict(raw: list[Any]) -> CircuitReply | None:
    """allow's verdict from an HMGET of ``READ_FIELDS``, when the circuit is closed -- then
    circuit.lua's allow only reads (it writes nothing), so a plain read in the caller's own
    round trip says the same; None when it is open or half-open: run the script (pure)."""
    state = text(raw[0]) if raw[0] is not None else CLOSED
    if state != CLOSED:
        return None
    return CircuitReply(CLOSED, CALL, 0, int(raw[1] or 0))


class PoolCircuit:
    """One pool's breaker for one client."""

    def __init__(self, client: redis.Redis, keys: Keys, circuit: Circuit, pool: Pool):
        self.scripts = scripts_for(client)
        self.keys, self.circuit, self.pool = keys, circuit, pool

    def _run(self, op: str) -> CircuitReply:
        return self.scripts.run(CircuitCall(self.keys, self.pool.name, op, self.circuit))

    def allow(self) -> CircuitReply:
        return self._run(ALLOW)

    def success(self) -> CircuitReply:
        return self._run(SUCCESS)

    def failure(self) -> CircuitReply:
        return self._run(FAILURE)
