-- uses: core/prelude
-- dispatch/pick.lua: choose the next tasks for a dispatcher -- between tiers by policy,
-- between a tier's tenants by tenant fair queuing -- admit each through its
-- pool's TPM/RPM bucket, and record it as dispatched: all in one atomic call.
-- A dispatcher with several free slots takes up to max_picks tasks in one call,
-- in exactly the order as many single calls at the same instant would.
--
-- It reads small index entries only (lua/dispatch/enqueue.lua), never a message body,
-- and hands back a message, copied and never decoded, when it is at most inline_max_b
-- bytes (its size is in its entry): a larger one the dispatcher fetches itself
-- (HGET of the messages hash).  Apart from that copy its cost does not grow with
-- prompt size, nor with queue depth or the number of tenants:
-- a fixed number of O(log n) sorted-set and O(1) hash commands, each state hash
-- read once (HMGET) and written once (HSET).  Per-tier dispatch statistics are
-- counted by the dispatcher from the reply (gateway_tasks/dispatch/transport.py), not here.
--
-- Its parts (lua/dispatch/pick/), spliced in where included, share this file's locals:
--   fair_state  each pool's state hash read once: bucket, fair state, boosts, empty flags
--   lifecycle   inherited, deadline-urgent and stale candidates (boosts, queue TTL)
--   candidates  a queue's next candidate by tenant fair queuing
--   admission   the pools' refilled buckets; whether and when a candidate is admitted
--   scoring     the score bands and the policies; the queue to dispatch from
--   dispatch    a tenant's slot taken, the task dispatched and recorded
--   write_back  what the call changed, written once per state hash
--
-- KEYS[1] per pool (P): state messages finish parked inflight dispatched dispatched_at
--   each pool's keys, all under the pool's hash tag:
--   state: the bucket (tokens, requests, ts_ms, blocked_until_ms, debited_tokens, dispatches)
--     and the fair state beside it (v, f:<tier>, tv:<tier>, the tie counter n:<tier>, the empty
--     flag e:<tier>; Keys.fair):
--     read by one HMGET, written by one HSET
--   messages (tag -> message)   finish tags (tenant -> F, its tie as the fraction)   parked tenants (tenant -> tier)
--   inflight (tenant -> n)   dispatched (tag -> '<tier>|<dispatch ms>|<entry>')
--   dispatched_at (zset tag -> lease expiry, ms)
-- KEYS[..] per queue (Q): index active bell
--   each queue's keys (a queue is one tier of one pool): the tier's index (sorted set of
--   entries); its active tenants (zset tenant -> start tag, lane-encoded: 2 x tag, or
--   2 x (tag + lag) + 1 when the tenant's head is scheduled, plus a fraction that orders
--   equal tags by arrival; prelude.lua gt_lane_score); its bell
--   (Keys.tier_bell): emptied when the tier is found empty -- its tokens were rung for work
--   that is gone, and each would cost a waiting dispatcher an empty pick
--
-- ARGV[1] policy: fifo | strict | aging | wfq      ARGV[2] P   ARGV[3] Q
-- ARGV[4] lease_ms: the dispatcher's hold on the task; past it (not renewed) anyone may restore it
-- ARGV[5] inline_max_b: largest message (bytes) handed back inline
-- ARGV[6] max_picks: most tasks to dispatch (>= 1)
-- ARGV[7] general_picks: most of them that may not use the reserve (-1: no limit): the
--   dispatcher's free slots less those it keeps for reserved tiers' interactive work
--   (Settings.reserved_worker_slots); at 0 only such work is a candidate
-- ARGV[..] per pool (P): token_capacity tokens_per_ms request_capacity requests_per_ms reserve_tokens reserve_hold_ms
--   reserve_tokens: head-room only reserved tiers' interactive work may use, held back while
--   such work is a candidate here or arrived (rsv_ms in the state hash, lua/dispatch/enqueue.lua)
--   less than reserve_hold_ms ago; else other work may use it too
-- ARGV[..] per queue (Q): pool tier base_weight alpha_per_ms share max_wait_ms reserved,
--                         tenant_max_inflight ttl_ms lag_tokens aging_cap priority urgent_priority
--   pool: its pool's index (1-based); reserved: 1 = may use the reserve;
--   base_weight alpha_per_ms aging_cap: the aging policy's score, weight + min(alpha x wait, cap)
--   (cap < 0: none; gateway_tasks/dispatch/priority.py: the presets' terms);
--   priority urgent_priority: the tier's band and its deadline-urgent tasks' band across tiers
--   (lower first; urgent_priority -1: an urgent task stays inside its tier; pick/scoring: lift)
--   ttl_ms: the tier's queue TTL (0 = none): a candidate that waited longer is
--   stale -- dispatched at once, taking no tokens, for its worker to fail it (Expired)
--   without calling the upstream;
--   lag_tokens: the tier's scheduled lag (weighted tokens; gateway_tasks/dispatch/lanes.py): a
--   tenant whose next task is scheduled goes after interactive tenants by this much virtual
--   time; its real start tag is read back from its score (no extra command)
-- the state hash also holds, per tier: 'b:<tier>' priority inheritance (lua/lifecycle/boost.lua:
--   '<higher tier>><entry>' lines, dispatched first, at the higher tier's priority and reserve,
--   charged to their own tenant and tier) and 'd:<tier>' / 'dn:<tier>' deadline boost
--   (lua/dispatch/deadline.lua: '<urgent from ms>><entry>' lines; a due one goes ahead of its tier's
--   fair order, its tenant's cap kept).  Lines whose task is no longer queued are dropped.
--
-- Returns {n, wait_ms, then per task dispatched (n >= 1) ten values: message, queue index,
--          now_ms, est_tokens, enqueued_ms, tenant, tag, pool tokens debited so far (with
--          this task), pool dispatches so far, message bytes}
--         (now_ms is also the dispatch's token: release and renew name it; message is ''
--         when it is larger than inline_max_b: fetch it by tag).  n = 0: nothing admissible
--         now, wait_ms says for how long (-1: every queue is empty, or what is queued waits
--         for a general slot; 0: pick again at once).  n >= 1: wait_ms is what the call's
--         other slots face when it took fewer than max_picks (0: it took them all, or pick again).

local policy = ARGV[A_policy]
local P, Q = N_pool, N_queue
local wfq = policy == 'wfq'
local MAX_ROUNDS = 8  -- tenants found at their cap and parked by one call, at most
-- a tier found empty is not read again for this long, unless a tenant joins it first (its
-- flag bounds what a tenant let in without clearing it costs: a producer of a release before
-- the flag, during a rolling upgrade, is seen as late as an idle worker's poll)
local EMPTY_RECHECK_MS = 1000

local now = gt_now_ms()

-- per queue: its tier and pool; the rest of its ARGV is read once it has a candidate
-- (qd.a: the offset of its values, ARGV[qd.a + A_queue_<field>])
local queues = {}
local general_left = tonumber(ARGV[A_general_picks]) or -1   -- dispatches left for work outside the reserve
local slot_limited = false                     -- a candidate waited for a general slot
for q = 1, Q do
  local a, k = A_per_queue * (q - 1), K_per_queue * (q - 1)
  -- every field the call sets later is named here: a table grown one field at a time is
  -- rehashed as it grows (measured: a 3-field table 0.2 us, one grown to 13 fields 0.8 us)
  queues[q] = {pool = tonumber(ARGV[a + A_queue_pool]), tier = ARGV[a + A_queue_tier], a = a,
               index = KEYS[k + K_queue_index], active = KEYS[k + K_queue_active],
               bell = KEYS[k + K_queue_bell],
               lag = tonumber(ARGV[a + A_queue_lag_tokens]) or 0,
               ttl = tonumber(ARGV[a + A_queue_ttl_ms]) or 0, field_at = 0, boosts = false,
               urgent_at = false, f = 0, tv0 = false, n = 0, n_dirty = false,
               was_empty = false, empty = false, c = false, weight = 0, alpha = 0, share = 0,
               max_wait = 0, reserved = false, tenant_max = 0, taken = 0, score = 0, start = 0,
               aging_cap = -1, prio = 0, urgent_prio = -1,
               bypass = false, tv = false, boosts_dirty = false, urgent_lines = false,
               urgent_dirty = false}
end
local pools   -- per pool: its keys, refilled bucket and fair state (pick/admission)

-- include: dispatch/pick/fair_state
-- include: dispatch/pick/lifecycle
-- include: dispatch/pick/candidates
local any_message = false
for q = 1, Q do
  local qd = queues[q]
  qd.c = candidate(qd)
  if qd.c then
    any_message = true
    local a = qd.a
    qd.weight, qd.alpha = tonumber(ARGV[a + A_queue_base_weight]), tonumber(ARGV[a + A_queue_alpha_per_ms])
    qd.share, qd.max_wait = tonumber(ARGV[a + A_queue_share]), tonumber(ARGV[a + A_queue_max_wait_ms])
    qd.reserved = ARGV[a + A_queue_reserved] == '1'
    qd.tenant_max = tonumber(ARGV[a + A_queue_tenant_max_inflight])
    qd.aging_cap = tonumber(ARGV[a + A_queue_aging_cap]) or -1
    qd.prio, qd.urgent_prio = tonumber(ARGV[a + A_queue_priority]) or 0, tonumber(ARGV[a + A_queue_urgent_priority]) or -1
    qd.taken = 0
  end
end

if not any_message then
  for p = 1, P do
    local fields = empty_flags(p, {})
    if #fields > 0 then redis.call('HSET', KEYS[K_per_pool * (p - 1) + K_pool_state], unpack(fields)) end
  end
  return {0, -1}
end

-- include: dispatch/pick/admission
-- include: dispatch/pick/scoring
-- include: dispatch/pick/dispatch
local wait_ms = nil
local stopped = false   -- before max_picks: the call's other slots found nothing admissible
local max_picks = tonumber(ARGV[A_max_picks])
for k = 1, max_picks do
  local q, n = next_dispatch()
  if q == nil then wait_ms, stopped = n, true break end
  dispatch(q, n, k == max_picks)
end

-- include: dispatch/pick/write_back
if stopped then
  -- messages exist but none (more) is admissible: its pool needs time to refill (or
  -- every head's tenant is capped: no wait time known; poll again soon).  -1 when what is
  -- queued waits for a slot this dispatcher keeps for reserved work: it picks again when one
  -- of its tasks ends (gateway_tasks/dispatch/transport.py) or a bell rings.  0: pick again at once.
  -- After dispatches too: what the call's other slots face, so that the dispatcher waits
  -- instead of asking again at once for what this call just found missing
  local left = false   -- a candidate left in some queue (else -1: only a bell brings work)
  for q = 1, Q do left = left or (queues[q].c and true or false) end
  out[2] = wait_ms or ((slot_limited or not left) and -1) or 50
end
return out
