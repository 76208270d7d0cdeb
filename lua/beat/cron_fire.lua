-- beat/cron_fire.lua: settle one (cron entry, nominal time) -- claim it for a fire or skip it, at
-- most once -- and move the entry to its next fire time, atomically, in the beat's slot.  A
-- claimed run's tenant's hourly quota is taken next, in the tenant's slot
-- (lua/tenants/quota_take.lua), and lua/beat/cron_admitted.lua counts it fired or skipped for
-- the quota; either way the run stays settled (its idempotency key stays): never fired twice
-- (beat/engine.py).
--
-- KEYS[1] due: sorted set of due entries (entry id -> next actual fire ms)
-- KEYS[2] entry: the entry's hash
-- KEYS[3] fired: idempotency key of (entry, nominal time): SET NX with a TTL
-- KEYS[4] stats: hash of beat outcome counters
-- KEYS[5] payload: the entry's payload (string, returned when the run is claimed)
-- ARGV[1] entry_id
-- ARGV[2] planned_score_ms: the sorted-set score the caller planned from; if the entry has
--          moved since (another beat process settled it, or it was updated)
--          nothing is done
-- ARGV[3] nominal_ms: nominal time being settled
-- ARGV[4] next_nominal_ms
-- ARGV[5] next_fire_ms: next actual fire time, the new score
-- ARGV[6] action: "fire", or the reason to skip without firing ("misfire", "unknown_tenant", ...),
--          or "orphan": the caller found no hash; only drop the dangling member
-- ARGV[7] now_ms
-- ARGV[8] idempotency_ttl_ms
-- ARGV[9] tier: the tenant's, stored for listing
-- ARGV[10] jitter_offset_s: of the next nominal time, stored for listing
-- ARGV[11] duplicate_outcome: "duplicate" (already settled: only rescheduled)
--          -- outcome names are counted in the stats hash and stored as the entry's
--          last_status; gateway_tasks/core/stats.py defines them (CRON_*)
-- Returns {status, payload}: status is "claimed" (to fire once its quota is taken: not
-- counted yet), the duplicate outcome, the skip reason, or "moved" / "gone" (nothing done);
-- payload is the entry's payload JSON when claimed, else "".
local score = redis.call('ZSCORE', KEYS[K_due], ARGV[A_entry_id])
if not score then
  return {'gone', ''}
end
if tonumber(score) ~= tonumber(ARGV[A_planned_score_ms]) then
  return {'moved', ''}
end
if redis.call('EXISTS', KEYS[K_entry]) == 0 then
  redis.call('ZREM', KEYS[K_due], ARGV[A_entry_id])
  return {'gone', ''}
end
if ARGV[A_action] == 'orphan' then
  return {'moved', ''}
end

local CLAIMED, DUPLICATE = 'claimed', ARGV[A_duplicate_outcome]
local status
if not redis.call('SET', KEYS[K_fired], ARGV[A_now_ms], 'NX', 'PX', ARGV[A_idempotency_ttl_ms]) then
  status = DUPLICATE
elseif ARGV[A_action] ~= 'fire' then
  status = ARGV[A_action]
else
  status = CLAIMED
end

redis.call('ZADD', KEYS[K_due], 'XX', ARGV[A_next_fire_ms], ARGV[A_entry_id])
redis.call('HSET', KEYS[K_entry], 'next_nominal_ms', ARGV[A_next_nominal_ms], 'next_fire_ms', ARGV[A_next_fire_ms],
           'settled_nominal_ms', ARGV[A_nominal_ms], 'tier', ARGV[A_tier], 'jitter_offset_s', ARGV[A_jitter_offset_s])
if status == CLAIMED then
  return {status, redis.call('GET', KEYS[K_payload]) or ''}
end
if status ~= DUPLICATE then
  redis.call('HSET', KEYS[K_entry], 'last_status', status, 'last_skip_ms', ARGV[A_now_ms])
  redis.call('HINCRBY', KEYS[K_entry], 'skipped_count', 1)
end
redis.call('HINCRBY', KEYS[K_stats], status, 1)
return {status, ''}
