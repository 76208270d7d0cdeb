-- beat_lock_renew.lua: extend the beat leader lock, only if we still hold it.
--
-- KEYS[1]  the lock (a string holding the owner's token)
-- ARGV[1]  our token
-- ARGV[2]  new TTL (ms)
-- Returns 1 if renewed, 0 if the lock is held by someone else or expired.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
