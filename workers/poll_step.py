"""What a dispatcher sends next, pick or wait (pure; ``workers.transport`` runs it).

A dispatcher alternates between picking (pick.lua) and waiting on its bells (BLPOP).
Two corrections to the plain alternation, both about the slots it keeps for reserved
tiers' interactive work (``Settings.reserved_worker_slots``):

* waiting for a slot of its own (only kept slots were free at its last pick) while one
  has freed since: it picks now, not after a wake-up that may not come (its task ended
  between the pick and the wait, before the release would ring its own bell);
* woken by its own bell while only kept slots are free: the token was stale (the slot
  it announced was filled again since), and a pick could take only reserved work, which
  would have rung the reserved bell: it waits again instead of an empty pick.
"""

from __future__ import annotations

PICK, WAIT = "pick", "wait"


def next_step(mode: str, slot_limited: bool, woke_own: bool, general_now: int) -> tuple[str, bool]:
    """(what to send: PICK or WAIT, whether a wait is for a slot of its own) given the mode
    the last reply left, whether that wait was for a slot, whether the last wait ended on its
    own bell, and pick.lua's ARGV[7] for its free slots now (0: only kept ones; -1: any)."""
    if mode == WAIT and slot_limited and general_now != 0:
        return PICK, slot_limited
    if mode == PICK and woke_own and general_now == 0:
        return WAIT, True
    return mode, slot_limited
