-- uses: prelude
-- pick.lua: choose the next tasks for a dispatcher -- between tiers by policy,
-- between a tier's tenants by tenant fair queuing -- admit each through its
-- pool's TPM/RPM bucket, and record it as dispatched: all in one atomic call.
-- A dispatcher with several free slots takes up to max_picks tasks in one call,
-- in exactly the order as many single calls at the same instant would.
--
-- It reads small index entries only (lua/enqueue.lua), never a message body,
-- and hands back a message, copied and never decoded, when it is at most inline_max_b
-- bytes (its size is in its entry): a larger one the dispatcher fetches itself
-- (HGET of the messages hash).  Apart from that copy its cost does not grow with
-- prompt size, nor with queue depth or the number of tenants:
-- a fixed number of O(log n) sorted-set and O(1) hash commands, each state hash
-- read once (HMGET) and written once (HSET).  Per-tier dispatch statistics are
-- counted by the dispatcher from the reply (workers/transport.py), not here.
--
-- KEYS[1] per pool (P): state messages finish parked inflight dispatched dispatched_at
--   each pool's keys, all under the pool's hash tag:
--   state: the bucket (tokens, requests, ts_ms, blocked_until_ms, debited_tokens, dispatches)
--     and the fair state beside it (v, f:<tier>, tv:<tier>, the empty flag e:<tier>; Keys.fair):
--     read by one HMGET, written by one HSET
--   messages (tag -> message)   finish tags (tenant -> F)   parked tenants (tenant -> tier)
--   inflight (tenant -> n)   dispatched (tag -> '<tier>|<dispatch ms>|<entry>')
--   dispatched_at (zset tag -> lease expiry, ms)
-- KEYS[..] per queue (Q): index active bell
--   each queue's keys (a queue is one tier of one pool): the tier's index (sorted set of
--   entries); its active tenants (zset tenant -> start tag, lane-encoded: 2 x tag, or
--   2 x (tag + lag) + 1 when the tenant's head is scheduled; prelude.lua); its bell
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
-- ARGV[..] per pool (P): token_capacity tokens_per_ms request_capacity requests_per_ms reserve_tokens
--   reserve_tokens: head-room only reserved tiers' interactive work may use
-- ARGV[..] per queue (Q): pool tier base_weight alpha_per_ms share max_wait_ms reserved,
--                         tenant_max_inflight ttl_ms lag_tokens
--   pool: its pool's index (1-based); reserved: 1 = may use the reserve;
--   [lifecycle] ttl_ms: the tier's queue TTL (0 = none): a candidate that waited longer is
--   stale -- dispatched at once, taking no tokens, for its worker to fail it (Expired)
--   without calling the upstream;
--   lag_tokens: the tier's scheduled lag (weighted tokens; gateway_tasks/core/lanes.py): a
--   tenant whose next task is scheduled goes after interactive tenants by this much virtual
--   time; its real start tag is read back from its score (no extra command)
-- [lifecycle] the state hash also holds, per tier: 'b:<tier>' priority inheritance (lua/boost.lua:
--   '<higher tier>><entry>' lines, dispatched first, at the higher tier's priority and reserve,
--   charged to their own tenant and tier) and 'd:<tier>' / 'dn:<tier>' deadline boost
--   (lua/deadline.lua: '<urgent from ms>><entry>' lines; a due one goes ahead of its tier's
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
               urgent_at = false, f = 0, tv0 = false,
               was_empty = false, empty = false, c = false, weight = 0, alpha = 0, share = 0,
               max_wait = 0, reserved = false, tenant_max = 0, taken = 0, score = 0, start = 0,
               bypass = false, tv = false, boosts_dirty = false, urgent_lines = false,
               urgent_dirty = false}
end
local pools   -- per pool: its keys, refilled bucket and fair state ([admission])

-- [fair_state] each pool's state hash, read once.
--
-- [lifecycle: boosts] each queue's inheritance lines and first deadline-urgent time, with the
-- pool's fair state (virtual time, each tier's finish tag and tenant virtual time, its empty
-- flag) and its bucket's fields (used once the pool has a candidate): one HMGET of its state
-- hash per pool.  pool_state[p]: the reply, the pool's fields at STATE_*; qd.field_at: where
-- a queue's own fields start in it.
local STATE_V, STATE_TOKENS, STATE_REQUESTS, STATE_TS_MS, STATE_BLOCKED_UNTIL_MS = 1, 2, 3, 4, 5
local STATE_DEBITED_TOKENS, STATE_DISPATCHES, STATE_WAIT_UNTIL_MS = 6, 7, 8
local pool_state = {}
for p = 1, P do
  local fields, mine = {'v', 'tokens', 'requests', 'ts_ms', 'blocked_until_ms', 'debited_tokens', 'dispatches',
                        'wait_until_ms'}, {}
  for q = 1, Q do
    local qd = queues[q]
    if qd.pool == p then
      local n = #fields
      fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4], fields[n + 5] =
        'b:' .. qd.tier, 'dn:' .. qd.tier, 'f:' .. qd.tier, 'tv:' .. qd.tier, 'e:' .. qd.tier
      qd.field_at = n + 1
      mine[#mine + 1] = qd
    end
  end
  if #mine > 0 then
    local got = redis.call('HMGET', KEYS[K_per_pool * (p - 1) + K_pool_state], unpack(fields))
    pool_state[p] = got
    for _, qd in ipairs(mine) do
      local j = qd.field_at
      qd.boosts, qd.urgent_at = got[j] or false, tonumber(got[j + 1])
      qd.f, qd.tv0 = tonumber(got[j + 2]) or 0, tonumber(got[j + 3])
      qd.was_empty = (tonumber(got[j + 4]) or 0) > now
      qd.empty = qd.was_empty
    end
  end
end

-- the state hash fields of pool p's tiers whose empty flag changed (candidate), appended;
-- a tier found empty has its bell emptied: its tokens wake nobody for anything now (work
-- that comes rings it again, as an unparked tenant or a task put back do)
local function empty_flags(p, fields)
  for q = 1, Q do
    local qd = queues[q]
    if qd.pool == p and qd.empty ~= qd.was_empty then
      fields[#fields + 1], fields[#fields + 2] = 'e:' .. qd.tier, qd.empty and (now + EMPTY_RECHECK_MS) or 0
      if qd.empty then redis.call('DEL', qd.bell) end
    end
  end
  return fields
end
-- [lifecycle] candidates taken out of their tier's fair order --
-- inherited priority (lua/boost.lua), deadline-urgent (lua/deadline.lua) -- and stale ones
-- (past their tier's queue TTL).

-- an index entry (gateway_tasks/core/index_entry.py): tenant|seq|tag|est|enqueued ms|weight, then
-- its message's size when it was queued with it (older entries have six fields)
local ENTRY = '^[^|]+|[^|]+|([^|]+)|([^|]+)|([^|]+)|([^|]+)|?(%d*)$'
local ENTRY_WITH_TENANT = '^([^|]+)|[^|]+|([^|]+)|([^|]+)|([^|]+)|([^|]+)|?(%d*)$'

-- a candidate from an index entry taken out of the tier's fair order; its tenant's start
-- tag is its place in line (its real tag: the lane's lag taken off), else (parked) its
-- finish tag
local function entry_candidate(qd, entry)
  local _, _, tenant, tag, est, enq, w, size = string.find(entry, ENTRY_WITH_TENANT)
  if not tenant then return nil end
  local score = tonumber(redis.call('ZSCORE', qd.active, tenant))
  local start = score and gt_lane_start(score, qd.lag)
                or tonumber(redis.call('HGET', KEYS[K_per_pool * (qd.pool - 1) + K_pool_finish], tenant)) or 0
  return {entry = entry, tenant = tenant, start = start, tag = tag, est = tonumber(est) or 0,
          enq = tonumber(enq) or now, w = w, size = tonumber(size)}
end

-- whether the queue of the same pool serving `tier` may use the reserve
local function tier_reserved(p, tier)
  for q = 1, Q do
    if queues[q].pool == p and queues[q].tier == tier then return ARGV[queues[q].a + A_queue_reserved] == '1' end
  end
  return false
end

-- a boosted candidate of a queue: an inherited one first (lua/boost.lua), then a deadline-
-- urgent one (lua/deadline.lua); lines of tasks no longer queued are dropped (written back)
local function boosted_candidate(qd)
  if qd.boosts and qd.boosts ~= '' then
    local kept, found = {}, nil
    for line in string.gmatch(qd.boosts, '[^\n]+') do
      local _, _, tier, entry = string.find(line, '^([^>]+)>(.+)$')
      if entry and redis.call('ZSCORE', qd.index, entry) then
        kept[#kept + 1] = line
        if not found then
          found = entry_candidate(qd, entry)
          if found then found.boost, found.boost_reserved = tier, tier_reserved(qd.pool, tier) end
        end
      end
    end
    local left = table.concat(kept, '\n')
    if left ~= qd.boosts then qd.boosts, qd.boosts_dirty = left, true end
    if found then return found end
  end
  if qd.urgent_at and qd.urgent_at <= now then
    local pool_keys = K_per_pool * (qd.pool - 1)
    local raw = redis.call('HGET', KEYS[pool_keys + K_pool_state], 'd:' .. qd.tier) or ''
    local cap = tonumber(ARGV[qd.a + A_queue_tenant_max_inflight])
    local kept, found = {}, nil
    for line in string.gmatch(raw, '[^\n]+') do
      local _, _, at, entry = string.find(line, '^(%d+)>(.+)$')
      if tonumber(at) and tonumber(at) > now then
        kept[#kept + 1] = line
      elseif entry and redis.call('ZSCORE', qd.index, entry) then
        kept[#kept + 1] = line
        if not found then
          local c = entry_candidate(qd, entry)
          local n = c and (tonumber(redis.call('HGET', KEYS[pool_keys + K_pool_inflight], c.tenant)) or 0)
          if c and (cap <= 0 or n < cap) then c.urgent, found = true, c end
        end
      end
    end
    local left = table.concat(kept, '\n')
    if left ~= raw then
      local _, _, first = string.find(left, '^(%d+)>')
      qd.urgent_lines, qd.urgent_at, qd.urgent_dirty = left, tonumber(first), true
    end
    if found then return found end
  end
  return nil
end

-- a candidate past its tier's queue TTL is stale (dispatched at once, no tokens taken)
local function mark_stale(qd, c)
  if c and qd.ttl > 0 and now - c.enq > qd.ttl then c.stale = true end
  return c
end
-- [candidates] a queue's next candidate by tenant fair queuing.

-- a queue's candidate: the oldest task of the active tenant first in line, with
-- its real start tag (false: none) -- first in line by lane: a scheduled head's score
-- carries the tier's lag.  A tenant in the active set is under its cap (it
-- is parked when it reaches it) and has queued work (it leaves when it has none).
-- The head is read with the tenant's next entry (c.nxt; false: none), which the
-- dispatch puts in line without a second read.  (known_tenant, known_head, known_next:
-- a tenant whose head entry -- and next, or nil -- the caller just read)
--
-- A tier whose active set was found empty is flagged ('e:<tier>' in the state hash: until
-- when; written back by [write_back]) and not read again until a tenant joins it
-- (gt_activate, the one way into an empty active set, clears the flag) or EMPTY_RECHECK_MS
-- passes: an idle tier costs a pick no command.
local function candidate(qd, known_tenant, known_head, known_next)
  local boosted = boosted_candidate(qd)                      -- [lifecycle]
  if boosted then return mark_stale(qd, boosted) end         -- [lifecycle]
  if qd.empty then return false end
  for _ = 1, MAX_ROUNDS do
    local top = redis.call('ZRANGE', qd.active, '0', '0', 'WITHSCORES')
    local tenant = top[1]
    if not tenant then
      qd.empty = true
      return false
    end
    local entry, nxt
    if tenant == known_tenant then
      entry, nxt = known_head, known_next
    else
      local heads = gt_tenant_heads(qd.index, tenant, 2)
      entry, nxt = heads[1], heads[2] or false
    end
    known_tenant = nil
    if entry then
      local _, _, tag, est, enq, w, size = string.find(entry, ENTRY)
      return mark_stale(qd, {entry = entry, nxt = nxt, tenant = tenant,
              start = gt_lane_start(tonumber(top[2]), qd.lag), tag = tag, est = tonumber(est) or 0,
              enq = tonumber(enq) or now, w = w, size = tonumber(size)})   -- [lifecycle]
    end
    redis.call('ZREM', qd.active, tenant)   -- no queued work left (defensive)
  end
  return false
end

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

-- [admission] the pools' buckets, refilled to now, and whether
-- (and when) a pool admits a queue's candidate.

-- pools with a candidate: refilled bucket levels and fair state, read once each
pools = {}
for p = 1, P do
  local k, a = K_per_pool * (p - 1), A_per_pool * (p - 1)
  local pool = {
    state = KEYS[k + K_pool_state], messages = KEYS[k + K_pool_messages],
    finish = KEYS[k + K_pool_finish], parked = KEYS[k + K_pool_parked], inflight = KEYS[k + K_pool_inflight],
    dispatched = KEYS[k + K_pool_dispatched], dispatched_at = KEYS[k + K_pool_dispatched_at],
    live = false, tcap = 0, trate = 0, rcap = 0, rrate = 0, reserve = 0, tokens = 0, requests = 0,
    blocked_until = 0, wait_until = 0, debited = 0, dispatches = 0, v = 0, touched = false,
    waits = false,
  }
  pools[p] = pool
  local live = false
  for q = 1, Q do
    if queues[q].pool == p and queues[q].c then live = true end
  end
  if live then
    pool.live = true
    pool.tcap, pool.trate = tonumber(ARGV[a + A_pool_token_capacity]), tonumber(ARGV[a + A_pool_tokens_per_ms])
    pool.rcap, pool.rrate = tonumber(ARGV[a + A_pool_request_capacity]), tonumber(ARGV[a + A_pool_requests_per_ms])
    pool.reserve = tonumber(ARGV[a + A_pool_reserve_tokens])
    local b = pool_state[p]   -- the bucket's fields, read with the fair state ([fair_state])
    local tokens, requests, ts = tonumber(b[STATE_TOKENS]), tonumber(b[STATE_REQUESTS]), tonumber(b[STATE_TS_MS])
    if not tokens then tokens, requests, ts = pool.tcap, pool.rcap, now end
    local dt = math.max(0, now - ts)
    pool.tokens = gt_refill(tokens, pool.tcap, pool.trate, dt)
    pool.requests = gt_refill(requests, pool.rcap, pool.rrate, dt)
    pool.blocked_until = tonumber(b[STATE_BLOCKED_UNTIL_MS]) or 0
    pool.wait_until = tonumber(b[STATE_WAIT_UNTIL_MS]) or 0
    pool.debited, pool.dispatches = tonumber(b[STATE_DEBITED_TOKENS]) or 0, tonumber(b[STATE_DISPATCHES]) or 0
    -- (the fair state, read with the boosts: with lanes a dispatch's start tag can be
    -- below the last one -- a scheduled head served after interactive ones -- and tv never
    -- moves back)
    pool.v = tonumber(b[STATE_V]) or 0
  end
end

-- whether a queue's candidate may use the reserve: a reserved tier's interactive work, and
-- ([lifecycle]) an inherited dispatch whose higher tier may; a reserved tier's scheduled
-- work (cron runs) leaves it to the interactive work of its tier (lanes)
local function may_use_reserve(qd)
  if qd.c.boost_reserved then return true end
  return qd.reserved and not gt_scheduled(qd.c.entry, qd.c.tenant)
end

-- ms until a pool's bucket admits a queue's candidate (0 = now)
local function admit_wait(qd, pool)
  if qd.c.stale then return 0 end           -- [lifecycle] a stale task takes no tokens
  local est = math.min(qd.c.est, pool.tcap)
  -- the others leave the reserve to reserved interactive work; a request too big to
  -- fit beside the reserve waits for a full bucket instead of waiting forever
  local headroom = 0
  if not may_use_reserve(qd) then headroom = math.min(pool.reserve, math.max(0, pool.tcap - est)) end
  local need_t = est + headroom - pool.tokens
  local need_r = 1 - pool.requests
  local w = 0
  if pool.blocked_until > now then w = pool.blocked_until - now end
  if need_t > 0 then w = math.max(w, math.ceil(need_t / pool.trate)) end
  if need_r > 0 then w = math.max(w, math.ceil(need_r / pool.rrate)) end
  return w
end
-- [scoring] the policies' scores and the queue to dispatch from.

-- Score bands: a candidate's score is its band plus its place in the band, and larger wins.
-- Every band is above any score of the bands under it (a place in a band is a wait in ms,
-- or -enqueued ms, far below 1e15).
local BAND_STALE = 3e18       -- [lifecycle] past its queue TTL: out of the way at once, no tokens
local BAND_INHERITED = 2e18   -- [lifecycle] inherited priority: before any promotion
local BAND_PROMOTED = 1e18    -- wfq: past its tier's max wait, oldest promoted first
local STRICT_WEIGHT_BAND = 1e15   -- strict: each unit of tier weight a band, oldest first in it
-- wfq, in fair order: a smaller start tag wins (per weighted token of virtual time), ties go
-- to the heavier tier, then to the older message
local WFQ_TAG_SCALE, WFQ_AGE_SCALE = 1e6, 1e-13

-- the policy's score of a candidate that is neither stale nor inherited (wait: its wait in ms)
local policy_score
if policy == 'fifo' then
  policy_score = function(qd, c) return -c.enq end
elseif policy == 'strict' then
  policy_score = function(qd, c) return qd.weight * STRICT_WEIGHT_BAND - c.enq end
elseif policy == 'aging' then
  policy_score = function(qd, c, wait) return qd.weight + qd.alpha * wait end
else   -- wfq (qd.start: set by score)
  policy_score = function(qd, c, wait, pool)
    -- promoted (past the tier's max wait) beats fair order, oldest promoted first --
    -- but only while its tier is not ahead of virtual time (start tag == V): when
    -- every tier is backlogged all heads are past their max wait, and an
    -- unconditional promotion would hand the tier with the shortest max wait
    -- (vip, 2 s) the whole pool instead of its share
    if wait > qd.max_wait and qd.start <= pool.v then return BAND_PROMOTED + wait end
    return -(qd.start - pool.v) * WFQ_TAG_SCALE + qd.weight - c.enq * WFQ_AGE_SCALE
  end
end

-- the score of a queue's candidate: larger wins
local function score(qd, pool)
  local c = qd.c
  local wait = now - c.enq
  if wfq then qd.start = math.max(pool.v, qd.f) end   -- (read by choose's bypass)
  if c.stale then return BAND_STALE + wait end        -- [lifecycle]
  if c.boost then return BAND_INHERITED + wait end    -- [lifecycle]
  return policy_score(qd, c, wait, pool)
end

-- the queue to dispatch from now (nil, wait_ms when none is admissible)
local function choose()
  local best, best_score, wait_ms = nil, nil, nil
  for q = 1, Q do queues[q].bypass = nil end
  for p = 1, P do
    local pool = pools[p]
    pool.waits = nil
    local win, win_score = nil, nil
    for q = 1, Q do
      local qd = queues[q]
      if qd.pool == p and qd.c then
        qd.score = score(qd, pool)
        if win == nil or qd.score > win_score then win, win_score = q, qd.score end
      end
    end
    if win then
      local w = admit_wait(queues[win], pool)
      -- the winner needs one of the dispatcher's general slots and only slots kept for
      -- reserved interactive work are free (general_picks spent)
      local needs_slot = general_left == 0 and not may_use_reserve(queues[win])
      if (needs_slot or (w > 0 and wfq)) and not may_use_reserve(queues[win]) then
        -- the winner waits (for tokens: its own plus the reserve; or for a general slot): a
        -- reserved tier's interactive work that fits now goes around it, as long as it is
        -- within its reservation (at most `reserve` tokens ahead of its fair share; under
        -- wfq).  v does not move for such a dispatch, so the waiting winner keeps its place.
        local alt = nil
        for q = 1, Q do
          local qd = queues[q]
          if qd.pool == p and qd.c and may_use_reserve(qd)
             and (not wfq or (qd.start - pool.v) * qd.share <= pool.reserve)
             and admit_wait(qd, pool) == 0
             and (alt == nil or qd.score > queues[alt].score) then
            alt = q
          end
        end
        if alt then
          queues[alt].bypass = true
          win, win_score, w, needs_slot = alt, queues[alt].score, 0, false
        end
      end
      if needs_slot then
        slot_limited = true   -- it waits for a general slot of this dispatcher (or another's)
      elseif w == 0 then
        if best == nil or win_score > best_score then best, best_score = win, win_score end
      else
        pool.waits = w   -- its winner waits for its bucket (tokens, requests, a drain)
        if wait_ms == nil or w < wait_ms then wait_ms = w end
      end
    end
  end
  return best, wait_ms
end
-- [dispatch] a tenant's slot taken, then the task dispatched --
-- its entry taken, the bucket debited, both fair states advanced, its lease recorded.

-- the next queue to dispatch from, with a slot of its tenant taken; a tenant
-- found at its cap (the cap was lowered, or it runs in another tier too) is
-- parked and the choice made again.  nil, wait_ms when none is admissible.
local function next_dispatch()
  local best, wait_ms
  for _ = 1, MAX_ROUNDS do
    best, wait_ms = choose()
    if best == nil then return nil, wait_ms end
    local qd = queues[best]
    local pool = pools[qd.pool]
    local c = qd.c
    local n = redis.call('HINCRBY', pool.inflight, c.tenant, '1')
    -- [lifecycle] an inherited or stale dispatch does not wait for its tenant's cap
    if qd.tenant_max <= 0 or n <= qd.tenant_max or c.boost or c.stale then return best, n end
    redis.call('HINCRBY', pool.inflight, c.tenant, '-1')
    redis.call('ZREM', qd.active, c.tenant)
    redis.call('HSET', pool.parked, c.tenant, qd.tier)
    redis.call('HSET', pool.finish, c.tenant, c.start)   -- back in line where it left
    qd.c = candidate(qd)
  end
  return nil, 0   -- MAX_ROUNDS tenants parked: more may be dispatchable, pick again at once
end

-- dispatch queue q's candidate (its tenant's slot taken: n in flight): take the
-- entry, debit the bucket and advance both fair states (in memory, written back
-- once by [write_back]), put the tenant's next task in line, record the lease;
-- unless it was the call's last, find the queue's next candidate
local lease_ms, inline_max_b = tonumber(ARGV[A_lease_ms]), tonumber(ARGV[A_inline_max_b])
local now_s = tostring(now)
local out = {0, 0}
local function dispatch(q, n, last)
  local qd = queues[q]
  local c = qd.c
  local pool = pools[qd.pool]
  if general_left > 0 and not may_use_reserve(qd) then general_left = general_left - 1 end
  local est = math.min(c.est, pool.tcap)
  if c.stale then est = 0 end       -- [lifecycle] stale: no tokens, no request taken
  local start = c.start or 0
  redis.call('ZREM', qd.index, c.entry)
  if not c.stale then               -- [lifecycle]
  pool.tokens, pool.requests = pool.tokens - est, pool.requests - 1
  -- running totals: sync_limits.lua subtracts what was dispatched after this task
  -- from the upstream's x-ratelimit-remaining, which cannot have seen it yet
  pool.debited, pool.dispatches = pool.debited + est, pool.dispatches + 1
  end                               -- [lifecycle]
  pool.touched = true
  if wfq and not c.stale then       -- [lifecycle]
    local s = math.max(pool.v, qd.f)
    -- a reserved tier going around a winner that waits for tokens leaves v alone
    -- ([lifecycle] and so does an inherited dispatch: charged to its own tier's tag only)
    if not qd.bypass and not c.boost then pool.v = s end
    qd.f = s + est / qd.share
  end
  -- tenant fair queuing: the tier's tenant virtual time moves to this start tag (never
  -- back: a scheduled head served after interactive tenants that were ahead by at most the
  -- lag leaves it where they took it), the tenant's next task starts where this one finishes
  -- ([lifecycle] a task taken out of fair order leaves the tier's tenant virtual time alone)
  if not (c.boost or c.urgent or c.stale) then qd.tv = math.max(qd.tv or qd.tv0 or start, start) end
  -- whole tokens: a small sorted set (listpack) compares integer scores without
  -- parsing them, so every ZADD/ZSCORE on the active set stays cheap
  local finish = math.ceil(start + est / math.max(tonumber(c.w) or 1, 1e-9))
  -- its next entry: read with its head (candidate), else now, with the one after it
  local next_entry, after_next = c.nxt, nil
  if next_entry == nil then
    local heads = gt_tenant_heads(qd.index, c.tenant, 2)
    next_entry, after_next = heads[1], heads[2] or false
  end
  if next_entry and not (qd.tenant_max > 0 and n >= qd.tenant_max) then
    -- its next task, in line at its finish tag, in that task's lane
    redis.call('ZADD', qd.active, gt_lane_score(finish, gt_scheduled(next_entry, c.tenant), qd.lag), c.tenant)
    qd.empty = false   -- (a boosted dispatch may bring a tenant into a tier found empty)
  else
    -- out of line (no work left, or at its cap: parked until a slot frees, lua/release.lua);
    -- where it comes back in starts from its finish tag
    redis.call('ZREM', qd.active, c.tenant)
    redis.call('HSET', pool.finish, c.tenant, finish)
    if next_entry then redis.call('HSET', pool.parked, c.tenant, qd.tier) end
    next_entry = nil
  end
  qd.taken = qd.taken + 1
  redis.call('HSET', pool.dispatched, c.tag, qd.tier .. '|' .. now_s .. '|' .. c.entry)
  redis.call('ZADD', pool.dispatched_at, now + lease_ms, c.tag)
  local size = c.size or redis.call('HSTRLEN', pool.messages, c.tag)   -- (an entry without it)
  local message = ''
  if size <= inline_max_b then message = redis.call('HGET', pool.messages, c.tag) or '' end
  local k = #out
  out[k + 1], out[k + 2], out[k + 3], out[k + 4], out[k + 5] = message, q, now, est, c.enq
  out[k + 6], out[k + 7], out[k + 8], out[k + 9], out[k + 10] =
    c.tenant, c.tag, tostring(pool.debited), pool.dispatches, size
  out[1] = out[1] + 1
  if not last then qd.c = candidate(qd, c.tenant, next_entry, after_next) end
end

local wait_ms = nil
local stopped = false   -- before max_picks: the call's other slots found nothing admissible
local max_picks = tonumber(ARGV[A_max_picks])
for k = 1, max_picks do
  local q, n = next_dispatch()
  if q == nil then wait_ms, stopped = n, true break end
  dispatch(q, n, k == max_picks)
end

-- [write_back] what the dispatches changed, written once per
-- state hash -- buckets, fair states and empty flags; and, when the call ends with a pool's
-- winner waiting for its bucket, until when a dispatcher waits for it: token refunds ring
-- the pool's bell only until then (lua/settle.lua) -- a refund nobody waits for would wake
-- an idle dispatcher for an empty pick
for p = 1, P do
  local pool = pools[p]
  local fields = empty_flags(p, {})
  if stopped and pool.waits and now + pool.waits > pool.wait_until then
    fields[#fields + 1], fields[#fields + 2] = 'wait_until_ms', now + pool.waits
  end
  if pool.touched then
    local n = #fields
    fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4], fields[n + 5] =
      'tokens', pool.tokens, 'requests', pool.requests, 'ts_ms'
    fields[n + 6], fields[n + 7], fields[n + 8], fields[n + 9], fields[n + 10] =
      now_s, 'debited_tokens', pool.debited, 'dispatches', pool.dispatches
    if wfq then fields[#fields + 1], fields[#fields + 2] = 'v', pool.v end
    for q = 1, Q do
      local qd = queues[q]
      if qd.pool == p and qd.taken and qd.taken > 0 then
        if wfq then fields[#fields + 1], fields[#fields + 2] = 'f:' .. qd.tier, qd.f end
        -- [lifecycle] (tv stays unset when only out-of-fair-order tasks were taken)
        if qd.tv then fields[#fields + 1], fields[#fields + 2] = 'tv:' .. qd.tier, qd.tv end
      end
    end
  end
  if #fields > 0 then redis.call('HSET', pool.state, unpack(fields)) end   -- one write
end

-- [lifecycle: boosts] the inheritance and deadline lines that changed
for q = 1, Q do
  local qd = queues[q]
  local state = KEYS[K_per_pool * (qd.pool - 1) + K_pool_state]
  if qd.boosts_dirty then
    if qd.boosts == '' then redis.call('HDEL', state, 'b:' .. qd.tier)
    else redis.call('HSET', state, 'b:' .. qd.tier, qd.boosts) end
  end
  if qd.urgent_dirty then
    if qd.urgent_lines == '' then redis.call('HDEL', state, 'd:' .. qd.tier, 'dn:' .. qd.tier)
    else redis.call('HSET', state, 'd:' .. qd.tier, qd.urgent_lines, 'dn:' .. qd.tier, qd.urgent_at) end
  end
end

if stopped then
  -- messages exist but none (more) is admissible: its pool needs time to refill (or
  -- every head's tenant is capped: no wait time known; poll again soon).  -1 when what is
  -- queued waits for a slot this dispatcher keeps for reserved work: it picks again when one
  -- of its tasks ends (workers/transport.py) or a bell rings.  0: pick again at once.
  -- After dispatches too: what the call's other slots face, so that the dispatcher waits
  -- instead of asking again at once for what this call just found missing
  local left = false   -- a candidate left in some queue (else -1: only a bell brings work)
  for q = 1, Q do left = left or (queues[q].c and true or false) end
  out[2] = wait_ms or ((slot_limited or not left) and -1) or 50
end
return out
