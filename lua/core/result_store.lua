-- core/result_store.lua: store a task's result meta and publish it, unless the stored status is
-- already SUCCESS.  Celery's Redis backend reads the meta back before every write (so that a
-- lost worker's late write cannot overwrite a success): a round trip of its own, and a window
-- between the read and the write.  Here the check and the write are one atomic call.
--
-- KEYS[1] result: the task's result key (the backend's get_key_for_task)
-- ARGV[1] meta: encoded (JSON; Celery's meta has 'status' as its first field)
-- ARGV[2] expires_s: its expiry (0: none)
-- ARGV[3] reply_channel?: published there as well (the channel of the API process waiting for the
--         task: gateway_tasks/rest/result_waiter.py; absent or '': none)
--
-- Returns 1 when stored and published, 0 when the stored success was kept.

local head = redis.call('GETRANGE', KEYS[K_result], 0, 63)
if head ~= '' then
  local _, _, status = string.find(head, '^{%s*"status"%s*:%s*"(%u+)"')
  if status == nil then
    -- not status-first (written by another encoder): read the whole meta
    local ok, meta = pcall(cjson.decode, redis.call('GET', KEYS[K_result]))
    status = ok and type(meta) == 'table' and meta.status or nil
  end
  if status == 'SUCCESS' then return 0 end
end
local ttl = tonumber(ARGV[A_expires_s]) or 0
if ttl > 0 then
  redis.call('SET', KEYS[K_result], ARGV[A_meta], 'EX', ttl)
else
  redis.call('SET', KEYS[K_result], ARGV[A_meta])
end
redis.call('PUBLISH', KEYS[K_result], ARGV[A_meta])
local reply = ARGV[A_reply_channel]
if reply and reply ~= '' then
  redis.call('PUBLISH', reply, ARGV[A_meta])
end
return 1
