-- lifecycle/deps_done.lua: a task has finished (succeeded, failed, was cancelled or evicted): mark it
-- done and say which tasks wait on it.  Once the mark is set no task joins the waiters
-- (lua/lifecycle/deps_join.lua reads the mark first, in this slot): the set is final.  The
-- caller counts each waiter down (lua/lifecycle/deps_release.lua, once per pair whatever
-- happens) and deletes the set after: a finish cut short leaves it to a retried one.
--
-- KEYS[1] done: the task's done mark (string)   KEYS[2] waiters: its waiters (set of task ids)
-- KEYS[3] lifted: the tasks it lends its tier to (set; gateway_tasks/lifecycle/inherit.py takes
--         them back at its end)
-- KEYS[4] lift: the tiers lent to it (hash; it needs them no more)
-- KEYS[5] cancelled?: the task's cancel mark: when set, the outcome is 'failed' whatever
--         outcome says (a task cancelled while its upstream call ran keeps no result)
-- ARGV[1] outcome: 'ok' (succeeded) | 'failed'   ARGV[2] ttl_ms: the mark's TTL
--
-- Returns {outcome marked, {ids of the tasks waiting on it}, how many tasks it lends its tier to}.

local outcome = ARGV[A_outcome]
if KEYS[K_cancelled] and redis.call('EXISTS', KEYS[K_cancelled]) == 1 then outcome = 'failed' end
redis.call('SET', KEYS[K_done], outcome, 'PX', ARGV[A_ttl_ms])
redis.call('DEL', KEYS[K_lift])
return {outcome, redis.call('SMEMBERS', KEYS[K_waiters]), redis.call('SCARD', KEYS[K_lifted])}
