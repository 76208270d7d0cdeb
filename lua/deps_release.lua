-- deps_release.lua: one dependency of a held task has finished; when it was the last, the
-- held record goes and its sending instructions are returned, once.
--
-- KEYS[1] the dependent's held record (hash: pending, send, failed)
-- ARGV[1] the dependency's outcome: 'ok' | 'failed'   ARGV[2] the dependency's task id
--
-- Returns {1, send, failed}  released (failed: a dependency that did not succeed, or ''),
--         {0}                 still waiting, or no longer held (cancelled, expired).

if redis.call('EXISTS', KEYS[1]) == 0 then return {0} end
if ARGV[1] ~= 'ok' and not redis.call('HGET', KEYS[1], 'failed') then
  redis.call('HSET', KEYS[1], 'failed', ARGV[2])
end
if redis.call('HINCRBY', KEYS[1], 'pending', -1) > 0 then return {0} end
local held = redis.call('HMGET', KEYS[1], 'send', 'failed')
redis.call('DEL', KEYS[1])
return {1, held[1], held[2] or ''}
