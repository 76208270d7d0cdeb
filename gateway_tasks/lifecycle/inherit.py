"""Priority inheritance, transitive: the highest tier waiting on a task flows down its whole
chain of dependencies, and backs off when the waiter is gone.

An *origin* is a task that lends its tier: a held task (``depends_on``) lends the tier it
waits at to every task down its chain -- its dependencies, theirs if they are held too, and
so on -- and a task named by ``on_behalf_of`` lends its tier to the work submitted for it.
Each lent-to task records its lenders (``Keys.lift``: origin -> tier), each origin what it
lent to (``Keys.lifted``):

* ``lend``: an origin starts waiting -- the tasks below it of a lower tier record it; the
  queued ones are boosted at once (lua/lifecycle/boost.lua), the held ones when they are
  released (``reboost`` after their send);
* ``withdraw``: an origin ended (finished, failed, cancelled, evicted) -- its entries go and
  each task it lent to is boosted at what is left, or no longer.

A boosted task is dispatched first at the lent tier's priority (lua/dispatch/pick.lua), charged
to its own tenant and tier, and lua/dispatch/evict.lua never evicts it.  The chain is walked
breadth-first, one round trip per level, at most ``MAX_WALK`` tasks; the walk also finds a
cycle through the origin (``Walk.cycle``).  A lent-to task records its lender before its state
is read and a released task is boosted after its send, so a task released while it is lent to
is boosted by one of the two (or both: a boost is idempotent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Sequence

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import layout, scripts_for, text
from gateway_tasks.core.settings import Settings
from gateway_tasks.lifecycle.cancel import TaskRef, read_refs

MAX_WALK = 256   # tasks one walk down a chain of dependencies visits, at most
MAX_BOOSTS_PER_TIER = 64   # boosts pick.lua reads per tier and pool (each is one short line)


@dataclass(frozen=True)
class BoostCall:
    """lua/lifecycle/boost.lua: dispatch a queued lower-tier task at a higher tier's priority
    (``inherits`` '': no longer)."""

    SCRIPT: ClassVar[str] = "lifecycle/boost"

    keys: Keys
    pool: str
    tier: str           # the boosted task's own tier
    inherits: str       # the tier whose priority it gets ('': none any more)
    entry: str          # its index entry

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(fair=self.keys.fair(self.pool))

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(tier=self.tier, inherits=self.inherits, entry=self.entry,
                                        max_boosts=MAX_BOOSTS_PER_TIER)

    def parse(self, reply: Any) -> int:
        return int(reply)


@dataclass(frozen=True)
class Node:
    """One task down a chain: held (its effective tier and the ids it waits on) or not (its
    queue ref when it was queued: ``ref.entry`` says where)."""

    task_id: str
    held: bool
    tier: str                       # held: the tier it waits at; else its queue's tier ('' unknown)
    deps: tuple[str, ...] = ()
    ref: TaskRef | None = None


@dataclass(frozen=True)
class Walk:
    nodes: tuple[Node, ...]
    cycle: bool          # the origin itself is down its own chain
    truncated: bool      # stopped at MAX_WALK


def walk(client: redis.Redis, keys: Keys, pools: Sequence[str], origin: str, deps: Iterable[str],
         limit: int = MAX_WALK) -> Walk:
    """The tasks down ``origin``'s chain of dependencies, breadth-first (each once)."""
    seen: set[str] = set()
    frontier = [d for d in dict.fromkeys(deps)]
    nodes: list[Node] = []
    cycle = truncated = False
    while frontier:
        frontier = [d for d in frontier if d not in seen]
        if len(seen) + len(frontier) > limit:
            frontier, truncated = frontier[:max(0, limit - len(seen))], True
        if not frontier:
            break
        seen.update(frontier)
        with client.pipeline(transaction=False) as pipe:
            for task_id in frontier:
                pipe.hmget(keys.held(task_id), "tier", "deps")
            held = pipe.execute()
        loose = [t for t, (tier, _) in zip(frontier, held) if tier is None]
        refs = read_refs(client, keys, pools, loose)
        nxt: list[str] = []
        for task_id, (tier, raw_deps) in zip(frontier, held):
            if task_id == origin:
                cycle = True
            if tier is not None:
                below = tuple(x for x in text(raw_deps or b"").split("\n") if x)
                nodes.append(Node(task_id, True, text(tier), below))
                nxt.extend(below)
            else:
                ref = refs.get(task_id)
                nodes.append(Node(task_id, False, ref.tier if ref else "", (), ref))
        frontier = nxt
    return Walk(tuple(nodes), cycle, truncated)


def lend(client: redis.Redis, keys: Keys, settings: Settings, pools: Sequence[str], origin: str,
         tier: str, nodes: Sequence[Node], ttl_s: int) -> tuple[str, ...]:
    """``origin`` waits at ``tier`` on ``nodes`` (a ``walk``): each of a lower tier records it,
    the queued ones are boosted.  Returns the ids of the tasks it lent to."""
    rank = settings.tier_rank(tier)
    lower = [n for n in nodes if n.tier and settings.tier_rank(n.tier) > rank]
    if not lower:
        return ()
    _record_lent(client, keys, origin, tier, [n.task_id for n in lower], ttl_s)
    reboost(client, keys, settings, pools, [n.task_id for n in lower if not n.held])
    return tuple(n.task_id for n in lower)


def lend_to(client: redis.Redis, keys: Keys, origin: str, tier: str, task_id: str, ttl_s: int) -> None:
    """``origin`` lends ``tier`` to one task (submitted on its behalf), before it is queued."""
    _record_lent(client, keys, origin, tier, [task_id], ttl_s)


def _record_lent(client: redis.Redis, keys: Keys, origin: str, tier: str, task_ids: Sequence[str],
                 ttl_s: int) -> None:
    """``origin`` lends ``tier`` to ``task_ids``: the origin's own record of it first (its slot),
    then each task's entry (theirs), one round trip after the other -- a crash between leaves
    the origin taking back what it never lent (nothing), never a lent tier nobody takes back."""
    with client.pipeline(transaction=False) as pipe:
        pipe.sadd(keys.lifted(origin), *task_ids)
        pipe.expire(keys.lifted(origin), ttl_s)
        pipe.execute()
    with client.pipeline(transaction=False) as pipe:
        for task_id in task_ids:
            pipe.hset(keys.lift(task_id), origin, tier)
            pipe.expire(keys.lift(task_id), ttl_s)
        pipe.execute()


def lent_tier(settings: Settings, own: str, lenders: Iterable[str]) -> str:
    """The highest of the lent tiers above ``own`` ('' when none is above it)."""
    best, best_rank = "", settings.tier_rank(own)
    for tier in lenders:
        try:
            rank = settings.tier_rank(tier)
        except Exception:   # a tier no longer configured lends nothing
            continue
        if rank < best_rank:
            best, best_rank = tier, rank
    return best


def reboost(client: redis.Redis, keys: Keys, settings: Settings, pools: Sequence[str],
            task_ids: Sequence[str]) -> None:
    """Boost each queued task at the highest tier lent to it now, or no longer (none left)."""
    if not task_ids:
        return
    refs = read_refs(client, keys, pools, task_ids)
    queued = [t for t in task_ids if t in refs and refs[t].entry]
    if not queued:
        return
    with client.pipeline(transaction=False) as pipe:
        for task_id in queued:
            pipe.hvals(keys.lift(task_id))
        lenders = pipe.execute()
    scripts = scripts_for(client)
    for task_id, tiers in zip(queued, lenders):
        ref = refs[task_id]
        top = lent_tier(settings, ref.tier, (text(t) for t in tiers))
        scripts.run(BoostCall(keys, ref.pool, ref.tier, top, ref.entry))


def boost_released(client: redis.Redis, keys: Keys, settings: Settings, pools: Sequence[str],
                   task_id: str) -> None:
    """A held task was just sent: boosted when a tier is lent to it."""
    if client.exists(keys.lift(task_id)):
        reboost(client, keys, settings, pools, [task_id])


def withdraw(client: redis.Redis, keys: Keys, settings: Settings, pools: Sequence[str],
             origin: str) -> int:
    """``origin`` ended: take back what it lent; the tasks it lent to are boosted at what is
    left.  Returns how many tasks it had lent to."""
    lent = [text(t) for t in client.smembers(keys.lifted(origin))]
    take_back(client, keys, settings, pools, origin, lent)
    return len(lent)


def take_back(client: redis.Redis, keys: Keys, settings: Settings, pools: Sequence[str], origin: str,
              task_ids: Sequence[str]) -> None:
    """What ``origin`` lent to ``task_ids`` is taken back; they are boosted at what is left."""
    if not task_ids:
        return
    with client.pipeline(transaction=False) as pipe:     # lending's steps in reverse
        for task_id in task_ids:
            pipe.hdel(keys.lift(task_id), origin)
        pipe.execute()
    client.srem(keys.lifted(origin), *task_ids)
    reboost(client, keys, settings, pools, task_ids)
