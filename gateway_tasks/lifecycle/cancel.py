"""Cancelling a task, Redis side: where a queued task sits, and lua/lifecycle/cancel.lua as a typed call.

lua/dispatch/enqueue.lua records each gateway task's place as it queues it
(``Keys.task_ref_in``, under the pool's tag: pool, tier, tenant, delivery tag, index
entry; ``read_refs`` finds it by task id alone).  Cancelling finds the
task's index entry in its tenant's range of the tier's index, then runs
cancel.lua, which -- if it is still queued -- removes its entry and message together,
atomically: no dispatcher can take it afterwards.  The producer then marks the task
cancelled (``Keys.cancelled``, under the task's own tag).  A dispatched task is reported
as running; the producer revokes it, the worker sees the mark and discards it, and the
lease sweep drops it instead of putting it back (``gateway_tasks.dispatch.leases``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import redis

from gateway_tasks.dispatch.index_entry import SEP, tenant_range
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import layout

QUEUED, RUNNING, GONE = "queued", "running", "gone"   # what cancel.lua found
SCAN_CHUNK = 1_000


@dataclass(frozen=True)
class TaskRef:
    pool: str
    tier: str
    tenant: str
    tag: str
    entry: str = ""    # its index entry as enqueue.lua made it (requeues put the same one back)

    def encode(self) -> str:
        return SEP.join((self.pool, self.tier, self.tenant, self.tag, self.entry))

    @classmethod
    def decode(cls, text: str | bytes) -> "TaskRef":
        if isinstance(text, bytes):
            text = text.decode()
        pool, tier, tenant, tag, *entry = text.split(SEP, 4)
        return cls(pool, tier, tenant, tag, entry[0] if entry else "")


def read_refs(client: redis.Redis | redis.RedisCluster, keys: Keys, pools: Sequence[str],
              task_ids: Sequence[str]) -> dict[str, TaskRef]:
    """Where each of ``task_ids`` was queued, if it was (id -> TaskRef), in one round trip: its
    ref under each pool's tag (``Keys.task_ref_in``; the task id does not say its pool), and
    the key producers of an earlier release wrote (``Keys.task_ref``)."""
    if not task_ids:
        return {}
    with client.pipeline(transaction=False) as pipe:
        for task_id in task_ids:
            for pool in pools:
                pipe.get(keys.task_ref_in(pool, task_id))
            pipe.get(keys.task_ref(task_id))
        got = pipe.execute()
    out: dict[str, TaskRef] = {}
    per = len(pools) + 1
    for i, task_id in enumerate(task_ids):
        raw = next((r for r in got[i * per:(i + 1) * per] if r is not None), None)
        if raw is not None:
            out[task_id] = TaskRef.decode(raw)
    return out


def find_entry(client: redis.Redis, keys: Keys, ref: TaskRef) -> str:
    """The task's index entry: the one recorded at enqueue, else (a ref without one) found in
    its tenant's range of the index if it is queued now ('' if not)."""
    if ref.entry:
        return ref.entry
    low, high = tenant_range(ref.tenant)
    needle = f"{SEP}{ref.tag}{SEP}"
    offset = 0
    while True:
        chunk = client.zrangebylex(keys.index(ref.pool, ref.tier), low, high, start=offset, num=SCAN_CHUNK)
        for raw in chunk:
            entry = raw.decode() if isinstance(raw, bytes) else raw
            if needle in entry:
                return entry
        if len(chunk) < SCAN_CHUNK:
            return ""
        offset += SCAN_CHUNK


@dataclass(frozen=True)
class CancelCall:
    SCRIPT: ClassVar[str] = "lifecycle/cancel"

    keys: Keys
    task_id: str
    ref: TaskRef
    entry: str          # '' when find_entry found none
    lag_tokens: int = 0  # the tier's scheduled lag (gateway_tasks.dispatch.lanes)

    @property
    def script_keys(self) -> list[str]:
        k, p, t = self.keys, self.ref.pool, self.ref.tier
        return layout(self.SCRIPT).keys(messages=k.messages(p), index=k.index(p, t), active=k.active(p, t),
                                        parked=k.parked(p), dispatched=k.dispatched(p))

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(entry=self.entry, tag=self.ref.tag, tier=self.ref.tier, tenant=self.ref.tenant,
                                        lag_tokens=self.lag_tokens)

    def parse(self, reply: Any) -> str:
        return {1: QUEUED, 2: RUNNING}.get(int(reply), GONE)


def is_cancelled(client: redis.Redis, keys: Keys, task_id: str) -> bool:
    return bool(client.exists(keys.cancelled(task_id)))
