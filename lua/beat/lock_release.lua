-- beat/lock_release.lua: delete the beat leader lock, only if we hold it.
--
-- KEYS[1] lock: a string holding the owner's token
-- ARGV[1] token: ours
-- Returns 1 if released, 0 if it was not ours (or already expired).
if redis.call('GET', KEYS[K_lock]) == ARGV[A_token] then
  redis.call('DEL', KEYS[K_lock])
  return 1
end
return 0
