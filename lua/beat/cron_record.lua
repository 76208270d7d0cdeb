-- beat/cron_record.lua: store fields of a cron entry's last run (task id, error...), only
-- if the entry still exists, so a cron deleted meanwhile is not resurrected.
--
-- KEYS[1] entry: the entry's hash
-- ARGV[1] fields...: field, value, field, value, ...
-- Returns 1 if written, 0 if the entry is gone.
if redis.call('EXISTS', KEYS[K_entry]) == 0 then
  return 0
end
redis.call('HSET', KEYS[K_entry], unpack(ARGV, A_fields))
return 1
