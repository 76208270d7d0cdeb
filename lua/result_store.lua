-- result_store.lua: store a task's result meta and publish it, unless the stored status is
-- already SUCCESS.  Celery's Redis backend reads the meta back before every write (so that a
-- lost worker's late write cannot overwrite a success): a round trip of its own, and a window
-- between the read and the write.  Here the check and the write are one atomic call.
--
-- KEYS[1] the task's result key (the backend's get_key_for_task)
-- ARGV[1] the encoded meta (JSON; Celery's meta has 'status' as its first field)
-- ARGV[2] its expiry in seconds (0: none)
--
-- Returns 1 when stored and published, 0 when the stored success was kept.

local head = redis.call('GETRANGE', KEYS[1], 0, 63)
if head ~= '' then
  local _, _, status = string.find(head, '^{%s*"status"%s*:%s*"(%u+)"')
  if status == nil then
    -- not status-first (written by another encoder): read the whole meta
    local ok, meta = pcall(cjson.decode, redis.call('GET', KEYS[1]))
    status = ok and type(meta) == 'table' and meta.status or nil
  end
  if status == 'SUCCESS' then return 0 end
end
local ttl = tonumber(ARGV[2]) or 0
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
