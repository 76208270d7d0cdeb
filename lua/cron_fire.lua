-- cron_fire.lua: settle one (cron entry, nominal time) -- fire it or skip it, at most once --
-- and move the entry to its next fire time, atomically.
--
-- KEYS[1]  sorted set of due entries (entry id -> next actual fire ms)
-- KEYS[2]  the entry's hash
-- KEYS[3]  idempotency key of (entry, nominal time): SET NX with a TTL
-- KEYS[4]  the tenant's counter of cron tasks fired in the current clock hour
-- KEYS[5]  hash of beat outcome counters
-- KEYS[6]  the entry's payload (string, returned when the run is admitted)
-- ARGV[1]  entry id
-- ARGV[2]  the sorted-set score the caller planned from (ms); if the entry has
--          moved since (another beat process settled it, or it was updated)
--          nothing is done
-- ARGV[3]  nominal time being settled (ms)
-- ARGV[4]  next nominal time (ms)
-- ARGV[5]  next actual fire time (ms), the new score
-- ARGV[6]  "fire", or the reason to skip without firing ("misfire", "unknown_tenant", ...),
--          or "orphan": the caller found no hash; only drop the dangling member
-- ARGV[7]  the tier's max tasks per hour
-- ARGV[8]  now (ms)
-- ARGV[9]  idempotency key TTL (ms)
-- ARGV[10] hourly counter TTL (ms)
-- ARGV[11] the tenant's tier, stored for listing
-- ARGV[12] jitter offset (s) of the next nominal time, stored for listing
-- ARGV[13] the outcome "fired", ARGV[14] the outcome "quota" (the tenant's hourly
--          quota is spent), ARGV[15] the outcome "duplicate" (already settled: only
--          rescheduled) -- outcome names are counted in KEYS[5] and stored as the
--          entry's last_status; gateway_tasks/core/stats.py defines them (CRON_*)
-- Returns {status, count, payload}: status is one of the three outcomes, the skip
-- reason, or "moved" / "gone" (nothing done); count is the tenant's fired count in
-- this hour after a fire; payload is the entry's payload JSON when fired, else "".
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then
  return {'gone', 0, ''}
end
if tonumber(score) ~= tonumber(ARGV[2]) then
  return {'moved', 0, ''}
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return {'gone', 0, ''}
end
if ARGV[6] == 'orphan' then
  return {'moved', 0, ''}
end

local FIRED, QUOTA, DUPLICATE = ARGV[13], ARGV[14], ARGV[15]
local status
local count = 0
if not redis.call('SET', KEYS[3], ARGV[8], 'NX', 'PX', ARGV[9]) then
  status = DUPLICATE
elseif ARGV[6] ~= 'fire' then
  status = ARGV[6]
else
  count = tonumber(redis.call('GET', KEYS[4]) or '0')
  if count >= tonumber(ARGV[7]) then
    status = QUOTA
  else
    count = redis.call('INCR', KEYS[4])
    if count == 1 then
      redis.call('PEXPIRE', KEYS[4], ARGV[10])
    end
    status = FIRED
  end
end

redis.call('ZADD', KEYS[1], 'XX', ARGV[5], ARGV[1])
redis.call('HSET', KEYS[2], 'next_nominal_ms', ARGV[4], 'next_fire_ms', ARGV[5],
           'settled_nominal_ms', ARGV[3], 'tier', ARGV[11], 'jitter_offset_s', ARGV[12])
if status == FIRED then
  redis.call('HSET', KEYS[2], 'last_status', FIRED, 'last_nominal_ms', ARGV[3],
             'last_fire_ms', ARGV[8])
  redis.call('HINCRBY', KEYS[2], 'fired_count', 1)
elseif status ~= DUPLICATE then
  redis.call('HSET', KEYS[2], 'last_status', status, 'last_skip_ms', ARGV[8])
  redis.call('HINCRBY', KEYS[2], 'skipped_count', 1)
end
redis.call('HINCRBY', KEYS[5], status, 1)
if status == FIRED then
  return {status, count, redis.call('GET', KEYS[6]) or ''}
end
return {status, count, ''}
