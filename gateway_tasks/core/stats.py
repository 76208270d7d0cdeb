"""The names of the statistics counters kept in Redis, defined once.

Three hashes hold counters:

* ``Keys.stats(pool)``: one pool's counters.  Per-tier counters are named
  ``<counter>:<tier>`` (``tier_field``); ``UPSTREAM_429`` counts the pool's
  429 responses;
* ``Keys.dispatch_stats``: the dispatchers' round trips (``DISPATCH_COUNTERS``);
* ``Keys.cron_stats``: what beat did with due crons (the ``CRON_*`` outcomes,
  which are also the value of an entry's ``last_status``).

Lua scripts never spell a counter's name: the typed call that runs a script
passes the names of the fields it writes in ARGV (each script's header says
which), so this module is their only definition.  Python readers and writers
(``workers.tasks``, ``beat``, the metrics exporter, the benches) use it too.
"""

from __future__ import annotations

# -- per-tier counters of a pool's stats hash -----------------------------------
DISPATCHED = "dispatched"          # pick.lua: tasks dispatched
EST_TOKENS = "est_tokens"          # pick.lua: estimated tokens debited at dispatch
WAIT_MS = "wait_ms"                # pick.lua: queue wait of the dispatched tasks, summed (ms)
ACTUAL_TOKENS = "actual_tokens"    # settle.lua: tokens the upstream reported (prompt + completion)
COMPLETED = "completed"            # settle.lua: upstream calls that completed with a usage report
RETRIES = "retries"                # workers.tasks: transient failures requeued on the retry budget
DEAD_LETTERED = "dead_lettered"    # gateway_tasks.dispatch.dead_letters: malformed messages taken off a queue
UPSTREAM_MS = "upstream_ms"        # workers.tasks: upstream call time of the completed calls, summed (whole ms)
EXPIRED = "expired"                # workers.tasks: tasks dispatched past their deadline or queue TTL
EVICTED = "evicted"                # producer: queued tasks evicted for a higher tier (lua/dispatch/evict.lua)
CANCELLED = "cancelled"            # producer: tasks cancelled while queued or running (lua/lifecycle/cancel.lua)
DEFERRED = "deferred"              # producer: tasks the load level deferred and held (lua/overload/defer_hold.lua)
DEFERRED_RELEASED = "deferred_released"  # overload.deferral: held deferred tasks sent on their queue
DEFERRED_REFUSED = "deferred_refused"    # producer: deferred submits refused (the caller asked for a refusal)
DEFERRAL_REASON = "deferral"       # producer: deferrals by reason code and outcome (``deferral_field``)


def tier_field(counter: str, tier: str) -> str:
    """The stats hash field of one tier's counter: 'dispatched:vip'."""
    return f"{counter}:{tier}"


def deferral_field(reason: str, outcome: str, tier: str) -> str:
    """The stats hash field counting one tier's deferrals of one reason code and outcome
    ('held' | 'refused'): 'deferral:capacity_pressure:held:batch'."""
    return tier_field(f"{DEFERRAL_REASON}:{reason}:{outcome}", tier)


# -- pool-wide counters of a pool's stats hash ----------------------------------
UPSTREAM_429 = "upstream_429"      # drain.lua: 429 responses of the pool's upstream
UPSTREAM_ERRORS = "upstream_errors"  # workers.tasks: 5xx, timeouts and connection errors of the upstream
CIRCUIT_OPENS = "circuit_opens"    # circuit.lua: the pool's circuit breaker opened
CIRCUIT_CLOSES = "circuit_closes"  # circuit.lua: a half-open probe succeeded (failback)
FAILOVERS = "failovers"            # gateway_tasks.upstream.failover: reserved-tier calls served by this pool's backup
RESCUED = "rescued"                # gateway_tasks.upstream.rescue: queued reserved-tier tasks moved to a backup pool
                                   # while this pool was drained or its circuit open
DEGRADED = "degraded"              # workers.tasks (per tier): completed with a capped max_tokens or a
                                   # substituted model
STALE_RELEASES = "stale_releases"  # release.lua: a holder finished a task it had lost (lease expired,
                                   # restored and dispatched again): a duplicate execution
FINISHED_NOT_ACKED = "finished_not_acked"  # gateway_tasks.dispatch.leases: an expired lease whose task already had its
                                   # final result (the holder died between storing it and its ack):
                                   # acked by the sweep, not run again

# -- Keys.dispatch_stats: dispatcher round trips, flushed by every worker ------
DISPATCH_PICKS = "picks"           # EVALSHA pick.lua sent
DISPATCH_WAITS = "waits"           # BLPOP on the bell sent
DISPATCH_DISPATCHED = "dispatched"  # picks that delivered a message
DISPATCH_COUNTERS = (DISPATCH_PICKS, DISPATCH_WAITS, DISPATCH_DISPATCHED)

# -- Keys.cron_stats: outcomes of settling a due cron run ----------------------
CRON_FIRED = "fired"               # cron_admitted.lua: claimed within the hourly quota, then fired
CRON_QUOTA = "quota"               # cron_admitted.lua: claimed, skipped: the tenant's hourly quota is spent
CRON_DUPLICATE = "duplicate"       # cron_fire.lua: already settled (only rescheduled)
CRON_MISFIRE = "misfire"           # skipped: later than the misfire grace
CRON_UNKNOWN_TENANT = "unknown_tenant"  # skipped: the tenant is no longer registered
CRON_UNKNOWN_TIER = "unknown_tier"      # skipped: the tenant's tier is not configured
CRON_FIRE_ERROR = "fire_error"     # beat.engine: the fire function raised
CRON_DEFERRED = "deferred"         # beat.engine: the submit was deferred by the load level (Deferred,
                                   # overload): refused by design, not an error; tried again after the
                                   # error's retry_after_s when that comes before the entry's next run
CRON_RETRIED = "retried"           # beat.engine: a deferred run fired on a later try
CRON_SUPERSEDED = "superseded"     # beat.engine: a deferred run not tried again: its entry's next run
                                   # comes first (or the entry, its tenant or its tier is gone)
