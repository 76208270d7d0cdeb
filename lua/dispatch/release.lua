-- uses: core/prelude
-- dispatch/release.lua: a dispatched task is done with -- acked, rejected, or put back
-- (requeue after a 429 or a retryable error; restore after a crash or past the
-- visibility timeout).  Frees its tenant's in-flight slot, wakes the tenant if
-- it was parked at its cap, and either forgets the message or returns it to the
-- FRONT of its tenant's line with its original enqueue time.  Exactly once: a
-- tag that is no longer dispatched is left alone (returns 0).
--
-- KEYS[1] dispatched: hash (tag -> '<tier>|<dispatch ms>|<entry>')   KEYS[2] dispatched_at: zset
-- KEYS[3] messages: hash     KEYS[4] inflight: (tenant -> n)   KEYS[5] parked: (tenant -> tier)
-- KEYS[6] finish: tags       KEYS[7] fair: hash (tv:<tier>)    KEYS[8] stats: hash
-- KEYS[..] per tier (T): index active bell
--   each tier of the pool: its index, its active tenants, its bell (Keys.tier_bell: rung when
--   the release made the task's tier's work dispatchable -- the task put back, or its tenant
--   unparked -- so that it wakes a dispatcher serving that tier, not one of another tier's
--   that would find nothing to pick)
-- KEYS[..] own_bell?: the releasing dispatcher's own bell (Keys.dispatcher_bell), rung first
--   whatever the outcome -- its slot is free -- and kept own_bell_ttl_ms: it waits on it while
--   only its slots kept for reserved work were free (gateway_tasks/dispatch/transport.py)
-- ARGV[1] tag: the delivery tag   ARGV[2] mode: 'ack' (forget it) | 'requeue' (put it back)
-- ARGV[3] bell_max: max bell tokens kept   ARGV[4] T
-- ARGV[5] token: the dispatch's token (its dispatch ms) or '' for whichever dispatch holds the tag
-- ARGV[6] stale_field: the stats field counting stale releases (gateway_tasks/core/stats.py)
-- ARGV[7] expired_only: '1': only if the task's lease has expired (the sweep of a dead holder's tasks)
-- ARGV[..] per tier (T): name tenant_max_inflight lag_tokens
--   each tier's name, its max in-flight per tenant, its scheduled lag (gateway_tasks/dispatch/lanes.py:
--   a tenant comes back in line in its head's lane)
-- ARGV[..] own_bell_ttl_ms?
--
-- Returns {1, tenant, tier} when released, {0} when the tag was not dispatched, {2} when the
-- caller named its token and the tag is dispatched again under another token or not dispatched
-- at all (this holder lost its lease; the task was restored: a duplicate, counted).

local tag, mode = ARGV[A_tag], ARGV[A_mode]
local own_bell = KEYS[K_own_bell]
if own_bell and redis.call('LLEN', own_bell) == 0 then   -- one wake-up is enough
  redis.call('LPUSH', own_bell, '1')
  redis.call('PEXPIRE', own_bell, ARGV[A_own_bell_ttl_ms])
end
local record = redis.call('HGET', KEYS[K_dispatched], tag)
if not record then
  -- a holder naming its dispatch finds none: it lost the task (its lease expired, a sweep
  -- restored it, and it may already have run again and been acked) -- a duplicate, counted
  if ARGV[A_token] ~= '' then
    redis.call('HINCRBY', KEYS[K_stats], ARGV[A_stale_field], 1)
    return {2}
  end
  return {0}
end
local _, _, tier, token, entry = string.find(record, '^([^|]+)|([^|]+)|(.*)$')
if ARGV[A_token] ~= '' and ARGV[A_token] ~= token then
  redis.call('HINCRBY', KEYS[K_stats], ARGV[A_stale_field], 1)
  return {2}
end
if ARGV[A_expired_only] == '1' then
  local expiry_ms = tonumber(redis.call('ZSCORE', KEYS[K_dispatched_at], tag)) or 0
  if expiry_ms > gt_now_ms() then return {0} end
end
local _, _, tenant = string.find(entry, '^([^|]+)|')
local index_key, active_key, bell_key, cap = nil, nil, nil, 0
local lag = 0
for t = 1, N_tier do
  local k, a = K_per_tier * (t - 1), A_per_tier * (t - 1)
  if ARGV[a + A_tier_name] == tier then
    index_key, active_key, bell_key = KEYS[k + K_tier_index], KEYS[k + K_tier_active], KEYS[k + K_tier_bell]
    cap, lag = tonumber(ARGV[a + A_tier_tenant_max_inflight]), tonumber(ARGV[a + A_tier_lag_tokens]) or 0
  end
end
redis.call('HDEL', KEYS[K_dispatched], tag)
redis.call('ZREM', KEYS[K_dispatched_at], tag)
local n = redis.call('HINCRBY', KEYS[K_inflight], tenant, -1)
if n <= 0 then redis.call('HDEL', KEYS[K_inflight], tenant) end
if index_key == nil then
  -- a tier no longer configured: nothing to put back into
  redis.call('HDEL', KEYS[K_messages], tag)
  return {1, tenant, tier}
end
if mode == 'requeue' then
  redis.call('ZADD', index_key, '0', entry)
else
  redis.call('HDEL', KEYS[K_messages], tag)
end
-- a tenant parked at its cap, or one whose task came back, becomes eligible again
-- if it has work and is not already in line (a tenant with queued work is always
-- in line or parked, so a plain ack of a tenant not parked has nothing to do), in its
-- head's lane; an interactive task put back ahead of a tenant's scheduled head makes the
-- tenant's place interactive again.  The tier's bell rings only when that made work
-- dispatchable (a plain ack wakes nobody)
local woke = false
local was_parked = redis.call('HDEL', KEYS[K_parked], tenant) == 1
local head = (was_parked or mode == 'requeue') and gt_tenant_head(index_key, tenant)
if head then
  local score = tonumber(redis.call('ZSCORE', active_key, tenant))
  if not score then
    woke = gt_activate(active_key, KEYS[K_finish], KEYS[K_parked], KEYS[K_inflight], KEYS[K_fair], tier, tenant, cap,
                       gt_scheduled(head, tenant), lag)
  elseif gt_lane_carries_lag(score) and not gt_scheduled(head, tenant) then
    redis.call('ZADD', active_key, gt_lane_move(score, false, lag), tenant)
  end
end
if woke or mode == 'requeue' then gt_ring(bell_key, ARGV[A_bell_max]) end
return {1, tenant, tier}
