-- cron_record.lua: store fields of a cron entry's last run (task id, error...), only
-- if the entry still exists, so a cron deleted meanwhile is not resurrected.
--
-- KEYS[1]  the entry's hash
-- ARGV     field, value, field, value, ...
-- Returns 1 if written, 0 if the entry is gone.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
