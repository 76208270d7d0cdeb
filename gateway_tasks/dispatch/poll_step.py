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


def next_step(mode: str, slot_limited: bool, general_now: int) -> str:
    """What to send, PICK or WAIT, given the mode the last reply left, whether that wait is
    for a slot of its own, and pick.lua's ARGV[7] for its free slots now (0: only kept ones;
    -1: any)."""
    if mode == WAIT and slot_limited and general_now != 0:
        return PICK
    return mode
