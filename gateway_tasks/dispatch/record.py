"""The dispatch record: what pick.lua decided for one task, handed from the router to the task.

The router (``gateway_tasks.dispatch.router``) builds a ``Dispatch`` from the pick's reply and writes it
into the message as one header (``HEADER_DISPATCH``, ``encode``); the task reads it back
with ``decode`` (``of_request``).  Both sides use these two functions only, so the task
never re-derives what the pick decided: whether the pool's bucket was debited (a stale
task takes nothing), how much, the pool's running totals right after it, and the lease.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from gateway_tasks.dispatch.request import HEADER_DISPATCH


@dataclass(frozen=True)
class Dispatch:
    tag: str                  # the message's delivery tag
    pool: str
    tier: str
    tenant: str
    enqueued_ms: int          # Redis clock at enqueue (enqueue.lua)
    dispatched_ms: int        # Redis clock at dispatch (pick.lua): also this dispatch's lease token
    debited_tokens: int       # tokens pick.lua took from the pool's bucket (0 when stale)
    debited_request: bool     # whether it took one of the pool's request slots (False when stale)
    stale: bool               # past its tier's queue TTL: dispatched at once to be failed, nothing taken
    pool_debited_total: float  # the pool's debited tokens so far, right after this dispatch
    pool_dispatches_total: int  # the pool's dispatches so far, right after this dispatch

    @property
    def queue_wait_ms(self) -> int:
        return self.dispatched_ms - self.enqueued_ms

    @property
    def lease_token(self) -> str:
        """The token of this dispatch's record in the pool's dispatched hash."""
        return str(self.dispatched_ms)

    def encode(self) -> dict[str, Any]:
        """The header value (JSON)."""
        return asdict(self)

    @classmethod
    def decode(cls, raw: Any) -> "Dispatch | None":
        """The record from a header value; None when absent or not one (a message that did not
        come through pick.lua)."""
        if not isinstance(raw, dict):
            return None
        try:
            return cls(**{f.name: raw[f.name] for f in fields(cls)})
        except (KeyError, TypeError):
            return None

    @classmethod
    def of_request(cls, request: Any) -> "Dispatch | None":
        """The record of a running Celery task (its message headers)."""
        headers = getattr(request, "headers", None) or {}
        return cls.decode(headers.get(HEADER_DISPATCH, getattr(request, HEADER_DISPATCH, None)))
