-- uses: prelude
-- release.lua: a dispatched task is done with -- acked, rejected, or put back
-- (requeue after a 429 or a retryable error; restore after a crash or past the
-- visibility timeout).  Frees its tenant's in-flight slot, wakes the tenant if
-- it was parked at its cap, and either forgets the message or returns it to the
-- FRONT of its tenant's line with its original enqueue time.  Exactly once: a
-- tag that is no longer dispatched is left alone (returns 0).
--
-- KEYS[1] dispatched hash (tag -> '<tier>|<dispatch ms>|<entry>')   KEYS[2] dispatched-at zset
-- KEYS[3] messages hash     KEYS[4] in-flight (tenant -> n)   KEYS[5] parked (tenant -> tier)
-- KEYS[6] finish tags       KEYS[7] fair hash (tv:<tier>)     KEYS[8] stats hash
-- then for each tier t of the pool (T tiers), three keys from KEYS[9]: its index, its active
-- tenants, its bell (Keys.tier_bell: rung when the release made the task's tier's work
-- dispatchable -- the task put back, or its tenant unparked -- so that it wakes a dispatcher
-- serving that tier, not one of another tier's that would find nothing to pick)
-- ARGV[1] delivery tag   ARGV[2] mode: 'ack' (forget it) | 'requeue' (put it back)
-- ARGV[3] max bell tokens kept   ARGV[4] T
-- ARGV[5] the dispatch's token (its dispatch ms) or '' for whichever dispatch holds the tag
-- ARGV[6] stats field counting stale releases (gateway_tasks/core/stats.py)
-- ARGV[7] '1': only if the task's lease has expired (the sweep of a dead holder's tasks)
-- then per tier, 3 values from ARGV[8]: tier name, its max in-flight per tenant, its scheduled
-- lag (gateway_tasks/core/lanes.py: a tenant comes back in line in its head's lane)
-- Optional, KEYS[9 + 3T]: the releasing dispatcher's own bell (Keys.dispatcher_bell), rung
-- first whatever the outcome -- its slot is free -- and kept ARGV[8 + 3T] ms: it waits on it
-- while only its slots kept for reserved work were free (workers/transport.py)
--
-- Returns {1, tenant, tier} when released, {0} when the tag was not dispatched, {2} when the
-- caller named its token and the tag is dispatched again under another token or not dispatched
-- at all (this holder lost its lease; the task was restored: a duplicate, counted).

local tag, mode = ARGV[1], ARGV[2]
local own_bell = KEYS[9 + 3 * tonumber(ARGV[4])]
if own_bell and redis.call('LLEN', own_bell) == 0 then   -- one wake-up is enough
  redis.call('LPUSH', own_bell, '1')
  redis.call('PEXPIRE', own_bell, ARGV[8 + 3 * tonumber(ARGV[4])])
end
local record = redis.call('HGET', KEYS[1], tag)
if not record then
  -- a holder naming its dispatch finds none: it lost the task (its lease expired, a sweep
  -- restored it, and it may already have run again and been acked) -- a duplicate, counted
  if ARGV[5] ~= '' then
    redis.call('HINCRBY', KEYS[8], ARGV[6], 1)
    return {2}
  end
  return {0}
end
local _, _, tier, token, entry = string.find(record, '^([^|]+)|([^|]+)|(.*)$')
if ARGV[5] ~= '' and ARGV[5] ~= token then
  redis.call('HINCRBY', KEYS[8], ARGV[6], 1)
  return {2}
end
if ARGV[7] == '1' then
  local expiry_ms = tonumber(redis.call('ZSCORE', KEYS[2], tag)) or 0
  if expiry_ms > gt_now_ms() then return {0} end
end
local _, _, tenant = string.find(entry, '^([^|]+)|')
local index_key, active_key, bell_key, cap = nil, nil, nil, 0
local lag = 0
for t = 1, tonumber(ARGV[4]) do
  if ARGV[8 + 3 * (t - 1)] == tier then
    index_key, active_key, bell_key = KEYS[9 + 3 * (t - 1)], KEYS[10 + 3 * (t - 1)], KEYS[11 + 3 * (t - 1)]
    cap, lag = tonumber(ARGV[9 + 3 * (t - 1)]), tonumber(ARGV[10 + 3 * (t - 1)]) or 0
  end
end
redis.call('HDEL', KEYS[1], tag)
redis.call('ZREM', KEYS[2], tag)
local n = redis.call('HINCRBY', KEYS[4], tenant, -1)
if n <= 0 then redis.call('HDEL', KEYS[4], tenant) end
if index_key == nil then
  -- a tier no longer configured: nothing to put back into
  redis.call('HDEL', KEYS[3], tag)
  return {1, tenant, tier}
end
if mode == 'requeue' then
  redis.call('ZADD', index_key, '0', entry)
else
  redis.call('HDEL', KEYS[3], tag)
end
-- a tenant parked at its cap, or one whose task came back, becomes eligible again
-- if it has work and is not already in line (a tenant with queued work is always
-- in line or parked, so a plain ack of a tenant not parked has nothing to do), in its
-- head's lane; an interactive task put back ahead of a tenant's scheduled head makes the
-- tenant's place interactive again.  The tier's bell rings only when that made work
-- dispatchable (a plain ack wakes nobody)
local woke = false
local was_parked = redis.call('HDEL', KEYS[5], tenant) == 1
local head = (was_parked or mode == 'requeue') and gt_tenant_head(index_key, tenant)
if head then
  local score = tonumber(redis.call('ZSCORE', active_key, tenant))
  if not score then
    woke = gt_activate(active_key, KEYS[6], KEYS[5], KEYS[4], KEYS[7], tier, tenant, cap,
                       gt_scheduled(head, tenant), lag)
  elseif score % 2 == 1 and not gt_scheduled(head, tenant) then
    redis.call('ZADD', active_key, gt_lane_score(gt_lane_start(score, lag), false, lag), tenant)
  end
end
if woke or mode == 'requeue' then gt_ring(bell_key, ARGV[3]) end
return {1, tenant, tier}
