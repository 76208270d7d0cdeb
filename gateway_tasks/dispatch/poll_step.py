"""What a dispatcher sends next, pick or wait (pure; ``gateway_tasks.dispatch.transport`` runs it).

A dispatcher alternates between picking (pick.lua) and waiting on its bells (BLPOP).
One correction to the plain alternation, about the slots it keeps for reserved tiers'
interactive work (``Settings.reserved_worker_slots``): waiting for a slot of its own (only
kept slots were free at its last pick) while one has freed since, it picks now, not after a
wake-up that may not come (its task ended between the pick and the wait, before the
release would ring its own bell).

Not done here, on purpose: a wake-up by its own bell while only kept slots look free is
not taken for a stale token.  release.lua rings that bell before the ack's bookkeeping
frees the slot in this process (the ack thread runs it after the script returns), so the
slot often looks taken still: a dispatcher that waited again slept up to its poll timeout
with a free slot (the storm bench's throughput halved for seconds).
"""

from __future__ import annotations

PICK, WAIT = "pick", "wait"

# which bells a wait listens on (``wait_bells``)
ALL_BELLS = "all"            # its tiers' bells (arrivals) and its pools' (refunds, restores)
RESERVED_AND_OWN = "own"     # reserved interactive arrivals and its own bell (a slot of its own freed)
RESERVED_AND_POOL = "pool"   # reserved interactive arrivals and its pool's bell (refunds that end the wait)


def next_step(mode: str, slot_limited: bool, general_now: int) -> str:
    """What to send, PICK or WAIT, given the mode the last reply left, whether that wait is
    for a slot of its own, and pick.lua's ARGV[7] for its free slots now (0: only kept ones;
    -1: any)."""
    if mode == WAIT and slot_limited and general_now != 0:
        return PICK
    return mode


def wait_bells(slot_limited: bool, wait_ms: int, pools: int) -> str:
    """The bells a wait listens on, given whether it waits for a slot of its own, pick.lua's
    wait (ms; -1: nothing admissible is known to come) and how many pools the dispatcher serves.

    A wait for the bucket (wait_ms > 0 on a dispatcher of one pool) knows when the bucket
    admits the winner: an arrival of its tiers cannot be dispatched sooner -- it needs tokens
    too, unless it may use the reserve (a reserved tier's interactive work, which rings the
    reserved bell) -- so the tiers' bells are not listened to: each arrival would wake the
    dispatcher for an empty pick while the bucket refills.  Refunds ring the pool's bell only
    once they end the wait (lua/bucket/settle.lua).  A dispatcher of several pools does not know
    which pool the wait is for: an arrival in another may be dispatchable, so it listens to all.
    """
    if slot_limited:
        return RESERVED_AND_OWN
    if wait_ms > 0 and pools == 1:
        return RESERVED_AND_POOL
    return ALL_BELLS
