-- uses: core/prelude
-- upstream/withdraw.lua: take up to N queued tasks of one tier out of a pool that cannot serve
-- them now (drained by a 429, circuit open), for the caller to queue on a backup pool
-- (gateway_tasks/upstream/rescue.py).  Each task taken is written to the pool's moving journal in the
-- same call and removed from it by the caller once the backup holds it; a journal
-- record older than stale_ms (its mover died) is handed out again, re-stamped, so the
-- task is queued again rather than lost.  The tenants' active entries are left as
-- they are: pick.lua drops a tenant that has no queued work.
--
-- KEYS[1] index: the tier's (sorted set of entries; its size is the tier's queue length)
-- KEYS[2] messages: hash (tag -> message)             KEYS[3] moving: the pool's moving journal
-- ARGV[1] tier   ARGV[2] limit: most tasks taken (0 = only the stale journal records)
-- ARGV[3] stale_ms
--
-- Returns a list of JSON records {tier, tag, entry, message, ts_ms}: the stale ones first,
-- then the tasks taken now.

local tier, n, stale_ms = ARGV[A_tier], tonumber(ARGV[A_limit]), tonumber(ARGV[A_stale_ms])
local now = gt_now_ms()
local out = {}
local journal = redis.call('HGETALL', KEYS[K_moving])
for i = 1, #journal, 2 do
  local ok, record = pcall(cjson.decode, journal[i + 1])
  if ok and type(record) == 'table' and (tonumber(record.ts_ms) or 0) < now - stale_ms then
    record.ts_ms = now
    local text = cjson.encode(record)
    redis.call('HSET', KEYS[K_moving], journal[i], text)
    out[#out + 1] = text
  end
end
if n > 0 then
  for _, entry in ipairs(redis.call('ZRANGE', KEYS[K_index], 0, n - 1)) do
    local _, _, tag = string.find(entry, '^[^|]+|[^|]+|([^|]+)|')
    redis.call('ZREM', KEYS[K_index], entry)
    local message = tag and redis.call('HGET', KEYS[K_messages], tag)
    if message then
      redis.call('HDEL', KEYS[K_messages], tag)
      local text = cjson.encode({tier = tier, tag = tag, entry = entry, message = message, ts_ms = now})
      redis.call('HSET', KEYS[K_moving], tag, text)
      out[#out + 1] = text
    end
  end
end
return out
