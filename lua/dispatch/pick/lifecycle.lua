-- dispatch/pick/lifecycle.lua (part of pick.lua): candidates taken out of their tier's fair order --
-- inherited priority (lua/lifecycle/boost.lua), deadline-urgent (lua/dispatch/deadline.lua) -- and stale ones
-- (past their tier's queue TTL).

-- an index entry (gateway_tasks/dispatch/index_entry.py): tenant|seq|tag|est|enqueued ms|weight, then
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
                or math.floor(tonumber(redis.call('HGET', KEYS[K_per_pool * (qd.pool - 1) + K_pool_finish], tenant)) or 0)
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

-- a boosted candidate of a queue: an inherited one first (lua/lifecycle/boost.lua), then a deadline-
-- urgent one (lua/dispatch/deadline.lua); lines of tasks no longer queued are dropped (written back)
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

-- an interactive candidate past its tier's queue TTL is stale (dispatched at once, no tokens
-- taken): nobody waits for it any more.  Scheduled work (cron runs, lane="scheduled") has no
-- caller waiting on the answer's latency, so it never goes stale
local function mark_stale(qd, c)
  if c and qd.ttl > 0 and now - c.enq > qd.ttl and not gt_scheduled(c.entry, c.tenant) then c.stale = true end
  return c
end
