-- lifecycle/depend.lua: hold a task until the tasks it depends on have finished.  For each
-- dependency not finished yet (no done mark), the task joins the dependency's waiters;
-- the task's held record keeps how many it waits for and how to send it.  Atomic with
-- lua/lifecycle/deps_done.lua: each (dependency, dependent) pair is counted exactly once.
--
-- KEYS[1] held: the dependent's held record (hash: pending, send, failed, tier, deps)
-- KEYS[2] per dependency (D): done waiters
--   each dependency's done mark (string) and its waiters (set)
-- ARGV[1] D   ARGV[2] task_id: the dependent's   ARGV[3] send: how to send it (JSON)
-- ARGV[4] ttl_ms   ARGV[5] tier: the tier the dependent waits at (its effective tier; read by
--   gateway_tasks/lifecycle/inherit.py, which lends it down the chain)
-- ARGV[..] per dependency (D): id
--   each dependency's task id
--
-- Returns {pending, failed}: pending = dependencies still running (0: send it now),
-- failed = the id of a finished dependency that did not succeed ('' if none).

local pending, failed, waiting_on = 0, '', {}
for d = 1, N_dependency do
  local k = K_per_dependency * (d - 1)
  local done_key, waiters_key = KEYS[k + K_dependency_done], KEYS[k + K_dependency_waiters]
  local mark = redis.call('GET', done_key)
  if mark then
    if mark ~= 'ok' and failed == '' then failed = ARGV[A_per_dependency * (d - 1) + A_dependency_id] end
  else
    redis.call('SADD', waiters_key, ARGV[A_task_id])
    redis.call('PEXPIRE', waiters_key, ARGV[A_ttl_ms])
    pending = pending + 1
    waiting_on[pending] = ARGV[A_per_dependency * (d - 1) + A_dependency_id]
  end
end
if pending > 0 then
  redis.call('HSET', KEYS[K_held], 'pending', pending, 'send', ARGV[A_send], 'tier', ARGV[A_tier],
             'deps', table.concat(waiting_on, '\n'))
  if failed ~= '' then redis.call('HSET', KEYS[K_held], 'failed', failed) end
  redis.call('PEXPIRE', KEYS[K_held], ARGV[A_ttl_ms])
end
return {pending, failed}
