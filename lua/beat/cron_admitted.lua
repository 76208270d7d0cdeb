-- beat/cron_admitted.lua: a run lua/beat/cron_fire.lua claimed, once its tenant's hourly quota
-- answered (lua/tenants/quota_take.lua, in the tenant's slot): counted fired -- noted as the
-- entry's last fire, then fired -- or skipped for the quota, on the entry (if it still
-- exists) and in the stats.
--
-- KEYS[1] entry: the entry's hash   KEYS[2] stats: hash of beat outcome counters
-- ARGV[1] status: the fired outcome or the quota one   ARGV[2] nominal_ms: the run's nominal time
-- ARGV[3] now_ms   ARGV[4] fired_outcome: "fired" (gateway_tasks/core/stats.py CRON_FIRED)
--
-- Returns 1 if the entry was written, 0 if it is gone.

local status = ARGV[A_status]
redis.call('HINCRBY', KEYS[K_stats], status, 1)
if redis.call('EXISTS', KEYS[K_entry]) == 0 then return 0 end
if status == ARGV[A_fired_outcome] then
  redis.call('HSET', KEYS[K_entry], 'last_status', status, 'last_nominal_ms', ARGV[A_nominal_ms],
             'last_fire_ms', ARGV[A_now_ms])
  redis.call('HINCRBY', KEYS[K_entry], 'fired_count', 1)
else
  redis.call('HSET', KEYS[K_entry], 'last_status', status, 'last_skip_ms', ARGV[A_now_ms])
  redis.call('HINCRBY', KEYS[K_entry], 'skipped_count', 1)
end
return 1
