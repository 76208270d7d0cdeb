-- dispatch/pick/dispatch.lua (part of pick.lua): a tenant's slot taken, then the task dispatched --
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
    -- an inherited or stale dispatch does not wait for its tenant's cap
    if qd.tenant_max <= 0 or n <= qd.tenant_max or c.boost or c.stale then return best, n end
    redis.call('HINCRBY', pool.inflight, c.tenant, '-1')
    redis.call('ZREM', qd.active, c.tenant)
    redis.call('HSET', pool.parked, c.tenant, qd.tier)
    redis.call('HSET', pool.finish, c.tenant, gt_with_tie(c.start, c.tie))   -- back in line where it left
    qd.c = candidate(qd)
  end
  return nil, 0   -- MAX_ROUNDS tenants parked: more may be dispatchable, pick again at once
end

-- dispatch queue q's candidate (its tenant's slot taken: n in flight): take the
-- entry, debit the bucket and advance both fair states (in memory, written back
-- once by pick/write_back), put the tenant's next task in line, record the lease;
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
  if c.stale then est = 0 end       -- stale: no tokens, no request taken
  local start = c.start or 0
  redis.call('ZREM', qd.index, c.entry)
  if not c.stale then
  pool.tokens, pool.requests = pool.tokens - est, pool.requests - 1
  -- running totals: sync_limits.lua subtracts what was dispatched after this task
  -- from the upstream's x-ratelimit-remaining, which cannot have seen it yet
  pool.debited, pool.dispatches = pool.debited + est, pool.dispatches + 1
  end
  pool.touched = true
  if wfq and not c.stale then
    local s = math.max(pool.v, qd.f)
    -- a reserved tier going around a winner that waits for tokens leaves v alone
    -- (and so does an inherited dispatch: charged to its own tier's tag only)
    -- (and a deadline-urgent one lifted across tiers: pick/scoring lift)
    if not qd.bypass and not c.boost and not c.lifted then pool.v = s end
    qd.f = s + est / qd.share
  end
  -- tenant fair queuing, start-time fair queuing's virtual time: the start tag of the task
  -- in service -- dispatched in fair order, the smallest (tag, arrival) in line -- so the
  -- tier's tenant virtual time moves to this start tag (never back: a scheduled head served
  -- after interactive tenants that were ahead by at most the lag leaves it where they took
  -- it), the tenant's next task starts where this one finishes
  -- (a task taken out of fair order leaves the tier's tenant virtual time alone)
  if not (c.boost or c.urgent or c.stale) then qd.tv = math.max(qd.tv or qd.tv0 or start, start) end
  -- whole tokens (the score's fraction is the tie-breaker)
  local finish = math.ceil(start + est / math.max(tonumber(c.w) or 1, 1e-9))
  -- its next entry: read with its head (candidate), else now, with the one after it
  local next_entry, after_next = c.nxt, nil
  if next_entry == nil then
    local heads = gt_tenant_heads(qd.index, c.tenant, 2)
    next_entry, after_next = heads[1], heads[2] or false
  end
  -- its place among the tenants at its finish tag: after those that took it before (gt_tie)
  qd.n, qd.n_dirty = qd.n + 1, true
  local tie = gt_tie(qd.n)
  if next_entry and not (qd.tenant_max > 0 and n >= qd.tenant_max) then
    -- its next task, in line at its finish tag, in that task's lane
    redis.call('ZADD', qd.active, gt_lane_score(finish, gt_scheduled(next_entry, c.tenant), qd.lag, tie), c.tenant)
    qd.empty = false   -- (a boosted dispatch may bring a tenant into a tier found empty)
  else
    -- out of line (no work left, or at its cap: parked until a slot frees, lua/dispatch/release.lua);
    -- where it comes back in starts from its finish tag, at the place it took there
    redis.call('ZREM', qd.active, c.tenant)
    redis.call('HSET', pool.finish, c.tenant, gt_with_tie(finish, tie))
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
