-- depend.lua: hold a task until the tasks it depends on have finished.  For each
-- dependency not finished yet (no done mark), the task joins the dependency's waiters;
-- the task's held record keeps how many it waits for and how to send it.  Atomic with
-- lua/deps_done.lua: each (dependency, dependent) pair is counted exactly once.
--
-- KEYS[1] the dependent's held record (hash: pending, send, failed)
-- then for each dependency d (D of them), two keys from KEYS[2]: its done mark (string), its waiters (set)
-- ARGV[1] D   ARGV[2] the dependent's task id   ARGV[3] how to send it (JSON)   ARGV[4] TTL (ms)
-- then D dependency task ids
--
-- Returns {pending, failed}: pending = dependencies still running (0: send it now),
-- failed = the id of a finished dependency that did not succeed ('' if none).

local D = tonumber(ARGV[1])
local pending, failed = 0, ''
for d = 1, D do
  local done_key, waiters_key = KEYS[2 * d], KEYS[2 * d + 1]
  local mark = redis.call('GET', done_key)
  if mark then
    if mark ~= 'ok' and failed == '' then failed = ARGV[4 + d] end
  else
    redis.call('SADD', waiters_key, ARGV[2])
    redis.call('PEXPIRE', waiters_key, ARGV[4])
    pending = pending + 1
  end
end
if pending > 0 then
  redis.call('HSET', KEYS[1], 'pending', pending, 'send', ARGV[3])
  if failed ~= '' then redis.call('HSET', KEYS[1], 'failed', failed) end
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return {pending, failed}
