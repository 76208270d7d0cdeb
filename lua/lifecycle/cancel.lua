-- uses: core/prelude
-- lifecycle/cancel.lua: cancel one task in its pool.  If it is still queued, removes its index
-- entry and its message together, so no dispatcher can take it; if it is dispatched, says so
-- (the caller revokes it).  The caller then marks it cancelled (``Keys.cancelled``, under the
-- task's own tag, outside this pool's slot): the worker, a requeue and the lease sweep check
-- the mark, so a task found running never comes back; a queued one is gone already.
--
-- KEYS[1] messages: hash (tag -> message)    KEYS[2] index: the tier's (sorted set)
-- KEYS[3] active: the tier's active tenants (zset)  KEYS[4] parked: tenants (tenant -> tier)
-- KEYS[5] dispatched: hash (tag -> record)
-- ARGV[1] entry: the task's index entry as found by the caller ('' when it found none)
-- ARGV[2] tag: its delivery tag   ARGV[3] tier   ARGV[4] tenant
-- ARGV[5] lag_tokens: the tier's scheduled lag (gateway_tasks/dispatch/lanes.py; '' or 0 = no lanes)
--
-- Returns 1 removed while queued, 2 dispatched (running: revoke it), 0 neither (finished,
-- or never enqueued).

local tag, tier, tenant = ARGV[A_tag], ARGV[A_tier], ARGV[A_tenant]
local outcome = 0
if ARGV[A_entry] ~= '' and redis.call('ZREM', KEYS[K_index], ARGV[A_entry]) == 1 then
  redis.call('HDEL', KEYS[K_messages], tag)
  -- a tenant left without queued work leaves its tier's line (pick.lua would drop it lazily);
  -- one whose last interactive task went waits in line in the scheduled lane now
  local head, lag = gt_tenant_head(KEYS[K_index], tenant), tonumber(ARGV[A_lag_tokens]) or 0
  if head == nil then
    redis.call('ZREM', KEYS[K_active], tenant)
    if redis.call('HGET', KEYS[K_parked], tenant) == tier then redis.call('HDEL', KEYS[K_parked], tenant) end
  elseif lag > 0 and gt_scheduled(head, tenant) and not gt_scheduled(ARGV[A_entry], tenant) then
    local score = tonumber(redis.call('ZSCORE', KEYS[K_active], tenant))
    if score and not gt_lane_carries_lag(score) then
      redis.call('ZADD', KEYS[K_active], gt_lane_move(score, true, lag), tenant)
    end
  end
  outcome = 1
elseif redis.call('HEXISTS', KEYS[K_dispatched], tag) == 1 then
  outcome = 2
end
return outcome
