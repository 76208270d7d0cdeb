-- beat/lock_renew.lua: extend the beat leader lock, only if we still hold it.
--
-- KEYS[1] lock: a string holding the owner's token
-- ARGV[1] token: ours
-- ARGV[2] ttl_ms: its new TTL
-- Returns 1 if renewed, 0 if the lock is held by someone else or expired.
if redis.call('GET', KEYS[K_lock]) == ARGV[A_token] then
  redis.call('PEXPIRE', KEYS[K_lock], ARGV[A_ttl_ms])
  return 1
end
return 0
