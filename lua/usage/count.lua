-- usage/count.lua: add to one tenant's usage counters of one clock hour, and keep them for
-- the retention from the hour's end (gateway_tasks/usage/counters.py).
--
-- KEYS[1] hour: the tenant's counters of the hour (a hash, under the tenant's hash tag)
-- ARGV[1] expire_at_ms: when the hour's counters go (the hour's end + the retention)
-- ARGV[2] counts...: field, increment, field, increment, ...
--
-- Returns 1.
for i = A_counts, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[K_hour], ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIREAT', KEYS[K_hour], ARGV[A_expire_at_ms])
return 1
