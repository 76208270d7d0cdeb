-- uses: core/prelude
-- dispatch/renew.lua: a live dispatcher extends the lease of the tasks it still holds.
-- A tag is extended only while it is still this holder's dispatch (same token)
-- and younger than the visibility timeout -- the last resort for a task whose
-- holder keeps renewing but never finishes.
--
-- KEYS[1] dispatched: hash (tag -> '<tier>|<dispatch ms>|<entry>')   KEYS[2] dispatched_at: zset
-- ARGV[1] lease_ms   ARGV[2] visibility_timeout_ms
-- ARGV[3] held...: pairs of delivery tag, dispatch token (its dispatch ms)
--
-- Returns how many leases were extended.
--
-- Renewals must go on while Redis is at its maxmemory (noeviction): a lease that lapses
-- there lets another worker restore and run the task again.  Redis refuses a script at
-- its first command that may grow memory (ZADD) unless the script has written already;
-- the ZREM below writes without growing anything (the member '' is never a tag), so the
-- renewals -- ZADD XX, which only rewrites existing scores -- are let through.

local now = gt_now_ms()
local expiry_ms = now + tonumber(ARGV[A_lease_ms])
local oldest = now - tonumber(ARGV[A_visibility_timeout_ms])
local renewed = 0
redis.call('ZREM', KEYS[K_dispatched_at], '')
for i = A_held, #ARGV, 2 do
  local record = redis.call('HGET', KEYS[K_dispatched], ARGV[i])
  if record then
    local _, _, token = string.find(record, '^[^|]+|([^|]+)|')
    if token == ARGV[i + 1] and tonumber(token) >= oldest then
      redis.call('ZADD', KEYS[K_dispatched_at], 'XX', expiry_ms, ARGV[i])
      renewed = renewed + 1
    end
  end
end
return renewed
