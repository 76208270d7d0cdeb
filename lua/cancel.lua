-- uses: prelude
-- cancel.lua: cancel one task.  Marks it cancelled (the worker, a requeue and the lease
-- sweep check the mark, so it never runs or comes back); if it is still queued, removes
-- its index entry and its message together, so no dispatcher can take it; if it is
-- dispatched, says so (the caller revokes it).
--
-- KEYS[1] messages hash (tag -> message)    KEYS[2] the tier's index (sorted set)
-- KEYS[3] the tier's active tenants (zset)  KEYS[4] parked tenants (tenant -> tier)
-- KEYS[5] dispatched hash (tag -> record)   KEYS[6] the task's cancelled mark (string)
-- ARGV[1] the task's index entry as found by the caller ('' when it found none)
-- ARGV[2] its delivery tag   ARGV[3] its tier   ARGV[4] its tenant
-- ARGV[5] the mark's TTL (ms); the mark's value is what the task was: 'queued' | 'running'
-- ARGV[6] the tier's scheduled lag (gateway_tasks/core/lanes.py; '' or 0 = no lanes)
--
-- Returns 1 removed while queued, 2 dispatched (running: revoke it), 0 neither (finished,
-- or never enqueued).

local tag, tier, tenant = ARGV[2], ARGV[3], ARGV[4]
local outcome = 0
if ARGV[1] ~= '' and redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[1], tag)
  -- a tenant left without queued work leaves its tier's line (pick.lua would drop it lazily);
  -- one whose last interactive task went waits in line in the scheduled lane now
  local head, lag = gt_tenant_head(KEYS[2], tenant), tonumber(ARGV[6]) or 0
  if head == nil then
    redis.call('ZREM', KEYS[3], tenant)
    if redis.call('HGET', KEYS[4], tenant) == tier then redis.call('HDEL', KEYS[4], tenant) end
  elseif lag > 0 and gt_scheduled(head, tenant) and not gt_scheduled(ARGV[1], tenant) then
    local score = tonumber(redis.call('ZSCORE', KEYS[3], tenant))
    if score and score % 2 == 0 then
      redis.call('ZADD', KEYS[3], gt_lane_score(gt_lane_start(score, lag), true, lag), tenant)
    end
  end
  outcome = 1
elseif redis.call('HEXISTS', KEYS[5], tag) == 1 then
  outcome = 2
end
if outcome ~= 0 then
  redis.call('SET', KEYS[6], outcome == 1 and 'queued' or 'running', 'PX', ARGV[5])
end
return outcome
