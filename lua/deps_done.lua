-- deps_done.lua: a task has finished (succeeded, failed, was cancelled or evicted): mark it
-- done and hand over the tasks waiting on it, once (the waiters set goes with this call).
--
-- KEYS[1] the task's done mark (string)   KEYS[2] its waiters (set of task ids)
-- ARGV[1] outcome: 'ok' (succeeded) | 'failed'   ARGV[2] the mark's TTL (ms)
--
-- Returns the ids of the tasks that were waiting on it.

redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local waiting = redis.call('SMEMBERS', KEYS[2])
redis.call('DEL', KEYS[2])
return waiting
