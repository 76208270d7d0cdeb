"""Lanes inside a tier: interactive work goes before scheduled work, by a bounded lag.

A cron run (beat submits it with ``source="cron"``) or background API work
(``lane="scheduled"``) tolerates seconds of delay; an interactive request has a user
waiting.  Inside each tier and pool:

* **A tenant's own line.** The index entry of a scheduled task has its seq written
  ``'s' + 16 hex digits`` (``gateway_tasks.dispatch.index_entry``); ``'s'`` sorts after every
  hex digit, so all of a tenant's interactive tasks are ahead of its queued scheduled
  ones, each lane in enqueue order.
* **Between tenants.** The tier's active set orders its tenants by start tag (tenant
  fair queuing).  A tenant whose head -- its next task -- is scheduled is placed at its
  start tag + ``Tier.scheduled_lag_tokens`` (D): interactive tenants whose start tags are
  below that go first.  The tier's virtual time and the tenants' finish tags stay real,
  so an idle tenant still banks no credit and the lag moves no tag.
* **Bounded.** A waiting scheduled head at start tag S is served once the tier's virtual
  time reaches S + D: each interactive tenant can be served at most D (weighted) tokens of
  virtual time past S -- D x its weight in tokens, plus the one task that crosses the
  line -- ahead of it.  Nothing starves, and with only scheduled work queued it is served
  at once (work-conserving: the lag orders, it never waits for time).
* **The reserve.** A reserved tier's scheduled work leaves the pool's reserve to the
  interactive work of its tier, as non-reserved tiers do (lua/dispatch/pick.lua, ``may_use_reserve``):
  VIP cron runs all land on the boundary (a VIP jitter window is 0) and would otherwise
  drain the head-room a VIP user's request finds.
* **Score encoding.** ``2 x tag`` for an interactive head, ``2 x (tag + D) + 1`` for a
  scheduled one: the parity of the whole part says whether a score carries D, so the
  scripts read a tenant's real start tag back from its score alone (``start_tag``), without
  reading its head.  With D = 0 every whole part is even and no entry is marked: the order
  is exactly that of one lane.
* **Ties.** Start tags are whole weighted tokens and many tenants share one (every
  newcomer joins at the tier's virtual time).  The score's fraction orders them by when
  they took the tag -- the tier's counter ``n:<tier>`` in the fair hash, one step per tag
  given (``tie``) -- so equal tags go first come first served, never by tenant id.  The
  fraction has ``TIE_BITS`` bits (the counter wraps every 2^20 tags: only a tie group
  spanning the wrap is misordered), fewer once the whole part is at 2^(52 - bits) or above,
  so that the sum stays exact; at 2^52 none (ties by member name).

lua/core/prelude.lua has the same functions for the scripts (``gt_lane_score``,
``gt_lane_start``, ``gt_scheduled``); these are the reference (tests, tools).
"""

from __future__ import annotations

from gateway_tasks.core.errors import InvalidRequest

INTERACTIVE = "interactive"
SCHEDULED = "scheduled"
LANES = (INTERACTIVE, SCHEDULED)
SCHEDULED_SOURCES = frozenset({"cron"})   # submits from these sources are scheduled by default
SCHEDULED_SEQ_PREFIX = "s"                # an index entry's seq in the scheduled lane


def lane_for(source: str, lane: str | None = None) -> str:
    """A submit's lane: ``lane`` when given, else scheduled for a cron run, else interactive."""
    if lane is None:
        return SCHEDULED if source in SCHEDULED_SOURCES else INTERACTIVE
    if lane not in LANES:
        raise InvalidRequest(f"lane must be one of {list(LANES)}, got {lane!r}")
    return lane


def marks_scheduled(lane: str, lag_tokens: int) -> bool:
    """Whether a task of ``lane`` is queued in the scheduled lane (no lane when D = 0)."""
    return lane == SCHEDULED and lag_tokens > 0


TIE_BITS = 20


def tie(n: int) -> float:
    """The tie-breaker of the n-th tag given in a tier, in [0, 1).  Mirrors gt_tie."""
    return (n % 2 ** TIE_BITS) / 2 ** TIE_BITS


def active_score(start: int, scheduled: bool, lag_tokens: int, tie_fraction: float = 0.0) -> float:
    """A tenant's score in its tier's active set: its start tag, whether its head is
    scheduled (then + D), and its place among equal tags (a fraction in [0, 1), kept to
    the bits that stay exact beside the whole part).  Mirrors gt_lane_score in
    lua/core/prelude.lua."""
    base = 2 * (start + lag_tokens) + 1 if scheduled and lag_tokens > 0 else 2 * start
    if tie_fraction <= 0:
        return base
    bits, room = TIE_BITS, 2 ** (52 - TIE_BITS)
    while bits > 0 and abs(base) >= room:
        bits, room = bits - 1, room * 2
    if bits == 0:
        return base
    span = 2 ** bits
    return base + int(tie_fraction * span) / span


def start_tag(score: float, lag_tokens: int) -> int:
    """A tenant's real start tag read back from its active score.  Mirrors gt_lane_start."""
    base = int(score // 1)
    if base % 2 == 1:
        return (base - 1) // 2 - lag_tokens
    return base // 2
