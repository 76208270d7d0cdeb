-- dispatch/pick/admission.lua (part of pick.lua): the pools' buckets, refilled to now, and whether
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
    local b = pool_state[p]   -- the bucket's fields, read with the fair state (pick/fair_state)
    -- the reserve is held back only while reserved work is expected: it arrived lately ...
    if now - (tonumber(b[STATE_RSV_MS]) or -math.huge) >= (tonumber(ARGV[a + A_pool_reserve_hold_ms]) or 0) then
      pool.reserve = 0
      for q = 1, Q do
        local qd = queues[q]
        if qd.pool == p and qd.c and ARGV[qd.a + A_queue_reserved] == '1' and not gt_scheduled(qd.c.entry, qd.c.tenant) then
          pool.reserve = tonumber(ARGV[a + A_pool_reserve_tokens])   -- ... or is queued here now
        end
      end
    end
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
-- an inherited dispatch whose higher tier may; a reserved tier's scheduled
-- work (cron runs) leaves it to the interactive work of its tier (lanes)
local function may_use_reserve(qd)
  if qd.c.boost_reserved then return true end
  return qd.reserved and not gt_scheduled(qd.c.entry, qd.c.tenant)
end

-- ms until a pool's bucket admits a queue's candidate (0 = now)
local function admit_wait(qd, pool)
  if qd.c.stale then return 0 end           -- a stale task takes no tokens
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
