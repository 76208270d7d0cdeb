-- uses: core/prelude
-- dispatch/evict.lua: make room in a pool whose shared queue capacity is full, for an arrival of a
-- higher tier: remove the NEWEST queued task of the lowest tier that has any (the tiers
-- are given lowest first, and only tiers below the arrival's), its index entry and its
-- message together.  The producer then stores the victim's result (Evicted) and enqueues
-- the arrival.  Cost: one reverse range read per tenant with queued work in the tier
-- scanned (O(tenants x log n)); it runs only when the pool is full.
--
-- A task a higher tier's task waits on (priority inheritance: its line in the pool's fair
-- hash, 'b:<tier>', lua/lifecycle/boost.lua) is never evicted: the newest task that is not.
--
-- KEYS[1] messages: hash (tag -> message)   KEYS[2] parked: tenants (tenant -> tier)
-- KEYS[3] fair: the pool's fair hash (its 'b:<tier>' boost lines)
-- KEYS[..] per tier (T): index active
--   each candidate tier's index (sorted set of entries) and active tenants (zset), lowest first
-- ARGV[1] T
-- ARGV[..] per tier (T): name lag_tokens
--   each candidate tier's name and scheduled lag ('' or 0: no lanes), lowest first
--
-- Returns {1, tier, tag, message} evicted, or {0} when no candidate tier has queued work.
-- Entries are '<tenant>|<seq: 16 hex digits>|<tag>|...' (gateway_tasks/dispatch/index_entry.py):
-- the newest task of a tier is the one with the largest seq among its tenants' last entries.
-- A scheduled task's seq is 's' + 16 hex digits (one sequence for both lanes), after all
-- of its tenant's interactive tasks: a tenant whose last entry is scheduled has its last
-- interactive one read too, so the newest task goes whatever its lane.  A tenant whose
-- last interactive task went waits in line in the scheduled lane (lua/core/prelude.lua).

-- the newest entry in [low, high] of an index that is not protected (nil: none)
local function newest(index_key, high, low, protected, step)
  local offset = 0
  while true do
    local got = redis.call('ZREVRANGEBYLEX', index_key, high, low, 'LIMIT', offset, step)
    for _, e in ipairs(got) do
      if not protected[e] then return e end
    end
    if #got < step then return nil end
    offset = offset + step
  end
end

for t = 1, N_tier do
  local k, a = K_per_tier * (t - 1), A_per_tier * (t - 1)
  local tier, index_key, active_key = ARGV[a + A_tier_name], KEYS[k + K_tier_index], KEYS[k + K_tier_active]
  local protected, step = {}, 1
  for line in string.gmatch(redis.call('HGET', KEYS[K_fair], 'b:' .. tier) or '', '[^\n]+') do
    local _, _, entry = string.find(line, '^[^>]+>(.+)$')
    if entry then protected[entry], step = true, 8 end
  end
  local tenants = redis.call('ZRANGE', active_key, 0, -1)
  local parked = redis.call('HGETALL', KEYS[K_parked])
  for i = 1, #parked, 2 do
    if parked[i + 1] == tier then tenants[#tenants + 1] = parked[i] end
  end
  local best, best_seq, best_tenant = nil, nil, nil
  local function consider(last, tenant)
    local _, _, seq = string.find(last, '^[^|]+|s?([^|]+)|')
    if seq and (best_seq == nil or seq > best_seq) then
      best, best_seq, best_tenant = last, seq, tenant
    end
  end
  for _, tenant in ipairs(tenants) do
    local last = newest(index_key, '[' .. tenant .. '|\255', '[' .. tenant .. '|', protected, step)
    if last then
      consider(last, tenant)
      if gt_scheduled(last, tenant) then
        local interactive = newest(index_key, '(' .. tenant .. '|s', '[' .. tenant .. '|', protected, step)
        if interactive then consider(interactive, tenant) end
      end
    end
  end
  if best then
    local _, _, tag = string.find(best, '^[^|]+|[^|]+|([^|]+)|')
    redis.call('ZREM', index_key, best)
    local message = redis.call('HGET', KEYS[K_messages], tag) or ''
    redis.call('HDEL', KEYS[K_messages], tag)
    local head, lag = gt_tenant_head(index_key, best_tenant), tonumber(ARGV[a + A_tier_lag_tokens]) or 0
    if head == nil then
      redis.call('ZREM', active_key, best_tenant)
      if redis.call('HGET', KEYS[K_parked], best_tenant) == tier then
        redis.call('HDEL', KEYS[K_parked], best_tenant)
      end
    elseif lag > 0 and gt_scheduled(head, best_tenant) and not gt_scheduled(best, best_tenant) then
      local score = tonumber(redis.call('ZSCORE', active_key, best_tenant))
      if score and not gt_lane_carries_lag(score) then
        redis.call('ZADD', active_key, gt_lane_move(score, true, lag), best_tenant)
      end
    end
    return {1, tier, tag, message}
  end
end
return {0}
