-- uses: prelude
-- pick.lua: choose the next task for a dispatcher -- between tiers by policy,
-- between a tier's tenants by tenant fair queuing -- admit it through its
-- pool's TPM/RPM bucket, and record it as dispatched: all in one atomic call.
-- It reads small index entries only (lua/enqueue.lua), never a message body:
-- its cost does not grow with prompt size, queue depth or the number of tenants
-- (O(log n) sorted-set steps).
--
-- for each pool p (P pools), ten keys KEYS[10(p-1)+1] .. KEYS[10p] (the first pool's: KEYS[1] ..
-- KEYS[10]), all under the pool's hash tag:
--   bucket hash (tokens, requests, ts_ms, blocked_until_ms, debited_tokens, dispatches)   fair hash (v, f:<tier>, tv:<tier>)
--   stats hash   messages hash (tag -> message)   finish tags (tenant -> F)
--   parked tenants (tenant -> tier)   in-flight (tenant -> n)
--   dispatched hash (tag -> '<tier>|<dispatch ms>|<entry>')   dispatched-at zset (tag -> lease
--   expiry, s)   depth (tier -> n)
-- then for each queue q (Q queues, each one tier of one pool), two keys from KEYS[10P+2(q-1)+1]:
--   the tier's index (sorted set of entries)   the tier's active tenants (zset tenant -> start tag)
--
-- ARGV[1] policy: fifo | strict | aging | wfq      ARGV[2] P   ARGV[3] Q
-- ARGV[4] lease ms: the dispatcher's hold on the task; past it (not renewed) anyone may restore it
-- then per pool, 5 values: token_capacity, tokens_per_ms, request_capacity, requests_per_ms,
--                          reserve_tokens (head-room only reserved tiers may use)
-- then per queue, 11 values: pool index (1-based), tier, base_weight, alpha_per_ms, share,
--                          max_wait_ms, reserved (1 = may use the reserve), tenant_max_inflight,
--                          and the pool stats fields its dispatches count in: dispatched,
--                          estimated tokens, queue wait ms (gateway_tasks/core/stats.py)
--
-- Returns {1, message, queue index, now_ms, est_tokens, enqueued_ms, tenant, tag,
--          pool tokens debited so far, pool dispatches so far}  dispatched
--         (now_ms is also the dispatch's token: release and renew name it),
--         {0, wait_ms}  nothing admissible now (wait_ms = -1: every queue is empty).

local policy = ARGV[1]
local P = tonumber(ARGV[2])
local Q = tonumber(ARGV[3])
local lease_ms = tonumber(ARGV[4])
local PARKS_PER_PICK = 8  -- capped tenants parked by one call at most (each once per cap)

local now = gt_now_ms()

-- pools: refilled bucket levels (not yet written back)
local pools = {}
local a = 5
for p = 1, P do
  local base = 10 * (p - 1)
  local pool = {
    bucket = KEYS[base + 1], fair = KEYS[base + 2], stats = KEYS[base + 3],
    messages = KEYS[base + 4], finish = KEYS[base + 5], parked = KEYS[base + 6],
    inflight = KEYS[base + 7], dispatched = KEYS[base + 8], dispatched_at = KEYS[base + 9],
    depth = KEYS[base + 10],
    tcap = tonumber(ARGV[a]), trate = tonumber(ARGV[a + 1]),
    rcap = tonumber(ARGV[a + 2]), rrate = tonumber(ARGV[a + 3]),
    reserve = tonumber(ARGV[a + 4]),
  }
  a = a + 5
  pool.tokens, pool.requests, pool.blocked_until =
    gt_bucket(pool.bucket, pool.tcap, pool.trate, pool.rcap, pool.rrate, now)
  pool.v = tonumber(redis.call('HGET', pool.fair, 'v')) or 0
  pools[p] = pool
end

local qbase = 10 * P

-- the candidate of a queue: the oldest task of the active tenant with the
-- smallest start tag; tenants found at their cap are parked (out of the set
-- until a slot frees: lua/release.lua), so a capped tenant never blocks its tier
local function candidate(qd, pool)
  for _ = 1, PARKS_PER_PICK do
    local top = redis.call('ZRANGE', qd.active, 0, 0, 'WITHSCORES')
    if #top == 0 then return nil end
    local tenant, start = top[1], tonumber(top[2])
    local n = tonumber(redis.call('HGET', pool.inflight, tenant)) or 0
    local entry = nil
    if qd.tenant_max <= 0 or n < qd.tenant_max then entry = gt_tenant_head(qd.index, tenant) end
    if entry then
      local _, _, seq, tag, est, enq, w = string.find(entry, '^[^|]+|([^|]+)|([^|]+)|([^|]+)|([^|]+)|([^|]+)$')
      return {entry = entry, tenant = tenant, start = start, tag = tag, est = tonumber(est) or 0,
              enq = tonumber(enq) or now, tweight = math.max(tonumber(w) or 1, 1e-9)}
    end
    redis.call('ZREM', qd.active, tenant)
    if n > 0 and qd.tenant_max > 0 and n >= qd.tenant_max then
      redis.call('HSET', pool.parked, tenant, qd.tier)
    end
  end
  return nil
end

-- per queue: parameters and candidate
local queues = {}
local any_message = false
for q = 1, Q do
  local qd = {
    pool = tonumber(ARGV[a]), tier = ARGV[a + 1], weight = tonumber(ARGV[a + 2]),
    alpha = tonumber(ARGV[a + 3]), share = tonumber(ARGV[a + 4]),
    max_wait = tonumber(ARGV[a + 5]), reserved = ARGV[a + 6] == '1',
    tenant_max = tonumber(ARGV[a + 7]),
    dispatched_field = ARGV[a + 8], est_tokens_field = ARGV[a + 9], wait_ms_field = ARGV[a + 10],
  }
  qd.index, qd.active = KEYS[qbase + 2 * q - 1], KEYS[qbase + 2 * q]
  a = a + 11
  qd.c = candidate(qd, pools[qd.pool])
  if qd.c then any_message = true end
  queues[q] = qd
end

if not any_message then return {0, -1} end

-- the policy's score of a candidate: larger wins
local function score(qd, pool)
  local c = qd.c
  local wait = now - c.enq
  if policy == 'fifo' then return -c.enq end
  if policy == 'strict' then return qd.weight * 1e15 - c.enq end
  if policy == 'aging' then return qd.weight + qd.alpha * wait end
  -- wfq
  local f = tonumber(redis.call('HGET', pool.fair, 'f:' .. qd.tier)) or 0
  qd.start = math.max(pool.v, f)
  -- promoted (past the tier's max wait) beats fair order, oldest promoted first --
  -- but only while its tier is not ahead of virtual time (start tag == V): when
  -- every tier is backlogged all heads are past their max wait, and an
  -- unconditional promotion would hand the tier with the shortest max wait
  -- (vip, 2 s) the whole pool instead of its share
  if wait > qd.max_wait and qd.start <= pool.v then return 1e18 + wait end
  -- smaller start tag wins; ties go to the heavier tier, then the older message
  return -(qd.start - pool.v) * 1e6 + qd.weight - c.enq * 1e-13
end

-- ms until a pool's bucket admits a queue's candidate (0 = now)
local function admit_wait(qd, pool)
  local est = math.min(qd.c.est, pool.tcap)
  -- non-reserved tiers leave the reserve to vip; a request too big to fit
  -- beside the reserve waits for a full bucket instead of waiting forever
  local headroom = 0
  if not qd.reserved then headroom = math.min(pool.reserve, math.max(0, pool.tcap - est)) end
  local need_t = est + headroom - pool.tokens
  local need_r = 1 - pool.requests
  local w = 0
  if pool.blocked_until > now then w = pool.blocked_until - now end
  if need_t > 0 then w = math.max(w, math.ceil(need_t / pool.trate)) end
  if need_r > 0 then w = math.max(w, math.ceil(need_r / pool.rrate)) end
  return w
end

-- the winner of each pool, then whether its bucket admits it now
local best, best_score, wait_ms = nil, nil, nil
for p = 1, P do
  local pool = pools[p]
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
    if w > 0 and policy == 'wfq' and not queues[win].reserved then
      -- the winner waits for tokens (its own plus the reserve): a reserved tier
      -- that fits now goes around it, as long as it is within its reservation
      -- (at most `reserve` tokens ahead of its fair share).  v does not move
      -- for such a dispatch, so the waiting winner keeps its place.
      local alt = nil
      for q = 1, Q do
        local qd = queues[q]
        if qd.pool == p and qd.c and qd.reserved
           and (qd.start - pool.v) * qd.share <= pool.reserve
           and admit_wait(qd, pool) == 0
           and (alt == nil or qd.score > queues[alt].score) then
          alt = q
        end
      end
      if alt then
        queues[alt].bypass = true
        win, win_score, w = alt, queues[alt].score, 0
      end
    end
    if w == 0 then
      if best == nil or win_score > best_score then best, best_score = win, win_score end
    elseif wait_ms == nil or w < wait_ms then
      wait_ms = w
    end
  end
end

if best == nil then
  -- messages exist but none is admissible: every head's tenant is capped (no
  -- wait time known; poll again soon) or its pool needs time to refill
  return {0, wait_ms or 50}
end

-- dispatch: take the entry, debit the bucket, advance both fair states, record it
local qd = queues[best]
local c = qd.c
local pool = pools[qd.pool]
redis.call('ZREM', qd.index, c.entry)
redis.call('HINCRBY', pool.depth, qd.tier, -1)
local est = math.min(c.est, pool.tcap)
redis.call('HSET', pool.bucket, 'tokens', pool.tokens - est, 'requests', pool.requests - 1, 'ts_ms', now)
-- running totals: sync_limits.lua subtracts what was dispatched after this task
-- from the upstream's x-ratelimit-remaining, which cannot have seen it yet
local debited = redis.call('HINCRBYFLOAT', pool.bucket, 'debited_tokens', est)
local dispatches = redis.call('HINCRBY', pool.bucket, 'dispatches', 1)
if policy == 'wfq' then
  local f = tonumber(redis.call('HGET', pool.fair, 'f:' .. qd.tier)) or 0
  local start = math.max(pool.v, f)
  if qd.bypass then
    redis.call('HSET', pool.fair, 'f:' .. qd.tier, start + est / qd.share)
  else
    redis.call('HSET', pool.fair, 'v', start, 'f:' .. qd.tier, start + est / qd.share)
  end
end
-- tenant fair queuing: the tier's tenant virtual time moves to this start tag,
-- the tenant's next task starts where this one finishes
local finish = c.start + est / c.tweight
redis.call('HSET', pool.fair, 'tv:' .. qd.tier, c.start)
redis.call('HSET', pool.finish, c.tenant, finish)
local n = redis.call('HINCRBY', pool.inflight, c.tenant, 1)
if gt_tenant_head(qd.index, c.tenant) then
  if qd.tenant_max > 0 and n >= qd.tenant_max then
    redis.call('ZREM', qd.active, c.tenant)
    redis.call('HSET', pool.parked, c.tenant, qd.tier)
  else
    redis.call('ZADD', qd.active, finish, c.tenant)
  end
else
  redis.call('ZREM', qd.active, c.tenant)
end
redis.call('HINCRBY', pool.stats, qd.dispatched_field, 1)
redis.call('HINCRBY', pool.stats, qd.est_tokens_field, est)
redis.call('HINCRBY', pool.stats, qd.wait_ms_field, now - c.enq)
redis.call('HSET', pool.dispatched, c.tag, qd.tier .. '|' .. now .. '|' .. c.entry)
redis.call('ZADD', pool.dispatched_at, (now + lease_ms) / 1000, c.tag)
local message = redis.call('HGET', pool.messages, c.tag) or ''
return {1, message, best, now, est, c.enq, c.tenant, c.tag, debited, dispatches}
