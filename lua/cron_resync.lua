-- cron_resync.lua: move a cron entry in the due sorted set to the fire time its hash
-- says, only if its score is still the one the caller read (a score that moved
-- meanwhile was set by another beat process or a registration: leave it).
--
-- KEYS[1]  sorted set of due entries (entry id -> next actual fire ms)
-- ARGV[1]  entry id
-- ARGV[2]  the score the caller read (ms)
-- ARGV[3]  the new score (ms)
-- Returns 1 if moved, 0 if the score had changed (or the entry is gone).
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
return 1
