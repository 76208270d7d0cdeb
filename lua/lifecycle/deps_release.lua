-- lifecycle/deps_release.lua: one dependency of a held task has finished; when it was the last, the
-- held record goes and its sending instructions are returned, once.
--
-- KEYS[1] held: the dependent's held record (hash: pending, send, failed)
-- ARGV[1] outcome: the dependency's, 'ok' | 'failed'   ARGV[2] dependency: its task id
--
-- Returns {1, send, failed}  released (failed: a dependency that did not succeed, or ''),
--         {0}                 still waiting, or no longer held (cancelled, expired).

if redis.call('EXISTS', KEYS[K_held]) == 0 then return {0} end
if ARGV[A_outcome] ~= 'ok' and not redis.call('HGET', KEYS[K_held], 'failed') then
  redis.call('HSET', KEYS[K_held], 'failed', ARGV[A_dependency])
end
if redis.call('HINCRBY', KEYS[K_held], 'pending', -1) > 0 then return {0} end
local held = redis.call('HMGET', KEYS[K_held], 'send', 'failed')
redis.call('DEL', KEYS[K_held])
return {1, held[1], held[2] or ''}
