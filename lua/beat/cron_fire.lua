-- beat/cron_fire.lua: settle one (cron entry, nominal time) -- fire it or skip it, at most once --
-- and move the entry to its next fire time, atomically.
--
-- KEYS[1] due: sorted set of due entries (entry id -> next actual fire ms)
-- KEYS[2] entry: the entry's hash
-- KEYS[3] fired: idempotency key of (entry, nominal time): SET NX with a TTL
-- KEYS[4] quota: the tenant's counter of cron tasks fired in the current clock hour
-- KEYS[5] stats: hash of beat outcome counters
-- KEYS[6] payload: the entry's payload (string, returned when the run is admitted)
-- ARGV[1] entry_id
-- ARGV[2] planned_score_ms: the sorted-set score the caller planned from; if the entry has
--          moved since (another beat process settled it, or it was updated)
--          nothing is done
-- ARGV[3] nominal_ms: nominal time being settled
-- ARGV[4] next_nominal_ms
-- ARGV[5] next_fire_ms: next actual fire time, the new score
-- ARGV[6] action: "fire", or the reason to skip without firing ("misfire", "unknown_tenant", ...),
--          or "orphan": the caller found no hash; only drop the dangling member
-- ARGV[7] max_per_hour: the tier's max tasks per hour
-- ARGV[8] now_ms
-- ARGV[9] idempotency_ttl_ms
-- ARGV[10] quota_ttl_ms: the hourly counter's TTL
-- ARGV[11] tier: the tenant's, stored for listing
-- ARGV[12] jitter_offset_s: of the next nominal time, stored for listing
-- ARGV[13] fired_outcome: "fired"
-- ARGV[14] quota_outcome: "quota" (the tenant's hourly quota is spent)
-- ARGV[15] duplicate_outcome: "duplicate" (already settled: only rescheduled)
--          -- outcome names are counted in the stats hash and stored as the entry's
--          last_status; gateway_tasks/core/stats.py defines them (CRON_*)
-- Returns {status, count, payload}: status is one of the three outcomes, the skip
-- reason, or "moved" / "gone" (nothing done); count is the tenant's fired count in
-- this hour after a fire; payload is the entry's payload JSON when fired, else "".
local score = redis.call('ZSCORE', KEYS[K_due], ARGV[A_entry_id])
if not score then
  return {'gone', 0, ''}
end
if tonumber(score) ~= tonumber(ARGV[A_planned_score_ms]) then
  return {'moved', 0, ''}
end
if redis.call('EXISTS', KEYS[K_entry]) == 0 then
  redis.call('ZREM', KEYS[K_due], ARGV[A_entry_id])
  return {'gone', 0, ''}
end
if ARGV[A_action] == 'orphan' then
  return {'moved', 0, ''}
end

local FIRED, QUOTA, DUPLICATE = ARGV[A_fired_outcome], ARGV[A_quota_outcome], ARGV[A_duplicate_outcome]
local status
local count = 0
if not redis.call('SET', KEYS[K_fired], ARGV[A_now_ms], 'NX', 'PX', ARGV[A_idempotency_ttl_ms]) then
  status = DUPLICATE
elseif ARGV[A_action] ~= 'fire' then
  status = ARGV[A_action]
else
  count = tonumber(redis.call('GET', KEYS[K_quota]) or '0')
  if count >= tonumber(ARGV[A_max_per_hour]) then
    status = QUOTA
  else
    count = redis.call('INCR', KEYS[K_quota])
    if count == 1 then
      redis.call('PEXPIRE', KEYS[K_quota], ARGV[A_quota_ttl_ms])
    end
    status = FIRED
  end
end

redis.call('ZADD', KEYS[K_due], 'XX', ARGV[A_next_fire_ms], ARGV[A_entry_id])
redis.call('HSET', KEYS[K_entry], 'next_nominal_ms', ARGV[A_next_nominal_ms], 'next_fire_ms', ARGV[A_next_fire_ms],
           'settled_nominal_ms', ARGV[A_nominal_ms], 'tier', ARGV[A_tier], 'jitter_offset_s', ARGV[A_jitter_offset_s])
if status == FIRED then
  redis.call('HSET', KEYS[K_entry], 'last_status', FIRED, 'last_nominal_ms', ARGV[A_nominal_ms],
             'last_fire_ms', ARGV[A_now_ms])
  redis.call('HINCRBY', KEYS[K_entry], 'fired_count', 1)
elseif status ~= DUPLICATE then
  redis.call('HSET', KEYS[K_entry], 'last_status', status, 'last_skip_ms', ARGV[A_now_ms])
  redis.call('HINCRBY', KEYS[K_entry], 'skipped_count', 1)
end
redis.call('HINCRBY', KEYS[K_stats], status, 1)
if status == FIRED then
  return {status, count, redis.call('GET', KEYS[K_payload]) or ''}
end
return {status, count, ''}
