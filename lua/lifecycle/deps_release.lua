-- lifecycle/deps_release.lua: one dependency of a held task has finished -- or, named by the
-- task's own id, its submit has registered every dependency (the guard: lua/lifecycle/depend.lua);
-- when it was the last, the held record goes and its sending instructions are returned, once.
-- Idempotent: a dependency counted down already ('c:<id>' in the record) counts nothing, so
-- a finishing task that hands its waiters over again (a retried end, two ends at once) never
-- counts one twice.
--
-- KEYS[1] held: the dependent's held record (hash: pending, send, failed, deps, c:<id>)
-- ARGV[1] outcome: the dependency's, 'ok' | 'failed'   ARGV[2] dependency: its task id
--
-- Returns {1, send, failed}  released (failed: a dependency that did not succeed, or ''),
--         {0}                 still waiting, counted already, or no longer held (cancelled,
--                             expired).

if redis.call('EXISTS', KEYS[K_held]) == 0 then return {0} end
local dep = ARGV[A_dependency]
if redis.call('HSETNX', KEYS[K_held], 'c:' .. dep, 1) == 0 then return {0} end
if ARGV[A_outcome] ~= 'ok' and not redis.call('HGET', KEYS[K_held], 'failed') then
  redis.call('HSET', KEYS[K_held], 'failed', dep)
end
-- 'deps' keeps the ids it still waits on (the chain gateway_tasks/lifecycle/inherit.py walks)
local left = {}
for d in string.gmatch(redis.call('HGET', KEYS[K_held], 'deps') or '', '[^\n]+') do
  if d ~= dep then left[#left + 1] = d end
end
redis.call('HSET', KEYS[K_held], 'deps', table.concat(left, '\n'))
if redis.call('HINCRBY', KEYS[K_held], 'pending', -1) > 0 then return {0} end
local held = redis.call('HMGET', KEYS[K_held], 'send', 'failed')
redis.call('DEL', KEYS[K_held])
return {1, held[1], held[2] or ''}
