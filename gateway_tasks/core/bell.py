"""The bell: a Redis list of wake-up tokens (``Keys.bell``).

Every enqueue (lua/enqueue.lua) and every token refund (lua/settle.lua) pushes
one; an idle dispatcher BLPOPs it (``workers.transport``).  The list is
trimmed to ``BELL_MAX`` tokens: one is enough to wake a dispatcher, and a bell
nobody waits on must not grow without bound.
"""

from __future__ import annotations

BELL_MAX = 1024  # wake-up tokens kept on the bell list
