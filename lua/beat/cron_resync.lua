-- beat/cron_resync.lua: move a cron entry in the due sorted set to the fire time its hash
-- says, only if its score is still the one the caller read (a score that moved
-- meanwhile was set by another beat process or a registration: leave it).
--
-- KEYS[1] due: sorted set of due entries (entry id -> next actual fire ms)
-- ARGV[1] entry_id
-- ARGV[2] read_score_ms: the score the caller read
-- ARGV[3] new_score_ms
-- Returns 1 if moved, 0 if the score had changed (or the entry is gone).
local score = redis.call('ZSCORE', KEYS[K_due], ARGV[A_entry_id])
if not score or tonumber(score) ~= tonumber(ARGV[A_read_score_ms]) then
  return 0
end
redis.call('ZADD', KEYS[K_due], 'XX', ARGV[A_new_score_ms], ARGV[A_entry_id])
return 1
