-- deps_done.lua: a task has finished (succeeded, failed, was cancelled or evicted): mark it
-- done and hand over the tasks waiting on it, once (the waiters set goes with this call).
-- Once the mark is set no task joins the waiters (lua/depend.lua reads the mark first).
--
-- KEYS[1] the task's done mark (string)   KEYS[2] its waiters (set of task ids)
-- KEYS[3] (optional) the task's cancel mark: when set, the outcome is 'failed' whatever ARGV[1]
--         says (a task cancelled while its upstream call ran keeps no result)
-- ARGV[1] outcome: 'ok' (succeeded) | 'failed'   ARGV[2] the mark's TTL (ms)
-- ARGV[3] '1': hand the waiters over (the set goes) | '0': only say who waits (the worker's
--         settle round trip: a worker that dies before its task's end leaves them in place)
--
-- Returns {outcome marked, {ids of the tasks waiting on it}}.

local outcome = ARGV[1]
if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 1 then outcome = 'failed' end
redis.call('SET', KEYS[1], outcome, 'PX', ARGV[2])
local waiting = redis.call('SMEMBERS', KEYS[2])
if ARGV[3] == '1' then redis.call('DEL', KEYS[2]) end
return {outcome, waiting}
