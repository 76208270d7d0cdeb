"""The bell: a Redis list of wake-up tokens (``Keys.bell``).

Every enqueue pushes one on its tier's bell (``Keys.tier_bell``, lua/enqueue.lua), as
does a release that puts a task back or unparks its tenant (lua/release.lua); every
token refund pushes one on the pool's (lua/settle.lua) while a dispatcher waits for
the pool's bucket (lua/pick.lua records until when); an idle dispatcher
BLPOPs the bells of the tiers it serves and of their pools (``workers.transport``).  The list is
trimmed to ``BELL_MAX`` tokens: one is enough to wake a dispatcher, and a bell
nobody waits on must not grow without bound.
"""

from __future__ import annotations

BELL_MAX = 1024  # wake-up tokens kept on the bell list
