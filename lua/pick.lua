-- uses: prelude
-- pick.lua: choose the next message for a dispatcher, admit it through its
-- pool's TPM/RPM bucket, and record it as unacked -- all in one atomic call.
--
-- KEYS[1]                 kombu unacked hash          (delivery tag -> [payload, exchange, routing key])
-- KEYS[2]                 kombu unacked index zset    (delivery tag -> seconds)
-- KEYS[3]                 in-flight hash              (tenant -> tasks dispatched, not finished)
-- then for each pool p (P pools), three keys:
--   KEYS[3+3(p-1)+1]      bucket hash   (tokens, requests, ts_ms, blocked_until_ms)
--   KEYS[3+3(p-1)+2]      fair hash     (v, f:<tier>)  WFQ virtual time and finish tags
--   KEYS[3+3(p-1)+3]      stats hash    (counters)
-- then for each queue q (Q queues): KEYS[3+3P+q] the queue's Redis list
--
-- ARGV[1] policy: fifo | strict | aging | wfq
-- ARGV[2] P   ARGV[3] Q   ARGV[4] lookahead (messages examined per queue for the tenant cap)
-- then per pool, 5 values: token_capacity, tokens_per_ms, request_capacity, requests_per_ms,
--                          reserve_tokens (head-room only reserved tiers may use)
-- then per queue, 11 values: pool index (1-based), tier, base_weight, alpha_per_ms, share,
--                          max_wait_ms, reserved (1 = may use the reserve), tenant_max_inflight,
--                          and the pool stats fields its dispatches count in: dispatched,
--                          estimated tokens, queue wait ms (gateway_tasks/core/stats.py)
--
-- Returns {1, payload, queue index, now_ms, est_tokens}  a message was dispatched,
--         {0, wait_ms}  nothing admissible now (wait_ms = -1: every queue is empty).
--
-- Messages carry (set by enqueue.lua / the producer): top-level gt_enq_ms (Redis
-- TIME at enqueue) and headers gt_est_tokens, gt_tenant.

local policy = ARGV[1]
local P = tonumber(ARGV[2])
local Q = tonumber(ARGV[3])
local lookahead = tonumber(ARGV[4])

local now = gt_now_ms()

-- pools: refilled bucket levels (not yet written back)
local pools = {}
local a = 5
for p = 1, P do
  local base = 3 + 3 * (p - 1)
  local pool = {
    bucket = KEYS[base + 1], fair = KEYS[base + 2], stats = KEYS[base + 3],
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

local inflight_key = KEYS[3]
local qbase = 3 + 3 * P

-- the candidate of each queue: its oldest message whose tenant is under its cap
local function candidate(q, qd)
  local key = KEYS[qbase + q]
  local items = redis.call('LRANGE', key, -lookahead, -1)
  for i = #items, 1, -1 do
    local raw = items[i]
    local ok, m = pcall(cjson.decode, raw)
    local tenant, est, enq = '', 0, now
    if ok and type(m) == 'table' then
      enq = tonumber(m['gt_enq_ms']) or now
      local h = m['headers']
      if type(h) == 'table' then
        est = tonumber(h['gt_est_tokens']) or 0
        tenant = h['gt_tenant'] or ''
        if type(tenant) ~= 'string' then tenant = '' end
      end
    end
    local capped = false
    if tenant ~= '' and qd.tenant_max > 0 then
      local n = tonumber(redis.call('HGET', inflight_key, tenant)) or 0
      capped = n >= qd.tenant_max
    end
    if not capped then
      return {raw = raw, msg = ok and m or nil, enq = enq, est = est, tenant = tenant,
              tail = (i == #items), key = key}
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
  a = a + 11
  if redis.call('LLEN', KEYS[qbase + q]) > 0 then
    any_message = true
    qd.c = candidate(q, qd)
  end
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

-- dispatch: take the message, debit the bucket, advance fair state, record unacked
local qd = queues[best]
local c = qd.c
local pool = pools[qd.pool]
if c.tail then
  redis.call('RPOP', c.key)
else
  redis.call('LREM', c.key, -1, c.raw)
end
local est = math.min(c.est, pool.tcap)
redis.call('HSET', pool.bucket, 'tokens', pool.tokens - est, 'requests', pool.requests - 1, 'ts_ms', now)
if policy == 'wfq' then
  local f = tonumber(redis.call('HGET', pool.fair, 'f:' .. qd.tier)) or 0
  local start = math.max(pool.v, f)
  if qd.bypass then
    redis.call('HSET', pool.fair, 'f:' .. qd.tier, start + est / qd.share)
  else
    redis.call('HSET', pool.fair, 'v', start, 'f:' .. qd.tier, start + est / qd.share)
  end
end
if c.tenant ~= '' then redis.call('HINCRBY', inflight_key, c.tenant, 1) end
redis.call('HINCRBY', pool.stats, qd.dispatched_field, 1)
redis.call('HINCRBY', pool.stats, qd.est_tokens_field, est)
redis.call('HINCRBY', pool.stats, qd.wait_ms_field, now - c.enq)

local tag, ex, rk = nil, '', ''
if c.msg then
  local props = c.msg['properties']
  if type(props) == 'table' then
    tag = props['delivery_tag']
    local di = props['delivery_info']
    if type(di) == 'table' then
      ex = di['exchange'] or ''
      rk = di['routing_key'] or ''
    end
  end
end
if type(tag) == 'string' then
  redis.call('HSET', KEYS[1], tag, '[' .. c.raw .. ',' .. cjson.encode(ex) .. ',' .. cjson.encode(rk) .. ']')
  redis.call('ZADD', KEYS[2], now / 1000, tag)
end
return {1, c.raw, best, now, est}
