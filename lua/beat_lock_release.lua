-- beat_lock_release.lua: delete the beat leader lock, only if we hold it.
--
-- KEYS[1]  the lock (a string holding the owner's token)
-- ARGV[1]  our token
-- Returns 1 if released, 0 if it was not ours (or already expired).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
