-- overload/defer_release.lua: claim one held deferred task for its release, exactly once: its held
-- record goes and how to send it is returned (the caller sends it on its queue, then takes
-- its id out of its pool's deferred set).  However many workers release at once, one gets
-- it; a task cancelled meanwhile (its record dropped), or one held on its dependencies (a
-- record without deferred_until_ms), is nobody's to release.
--
-- KEYS[1] held: the task's held record (hash: send, deferred_until_ms, ...)
-- ARGV: none
--
-- Returns how to send it (JSON), or false: not held deferred (any more).

local send = redis.call('HGET', KEYS[K_held], 'send')
if not send or redis.call('HEXISTS', KEYS[K_held], 'deferred_until_ms') == 0 then return false end
redis.call('DEL', KEYS[K_held])
return send
