-- uses: prelude
-- enqueue.lua: push one Celery message onto its tier queue, stamped with Redis
-- TIME, unless the queue is at its length limit (tail drop); ring the bell so
-- an idle dispatcher wakes up.
--
-- KEYS[1] the queue's Redis list (kombu's key: consumers RPOP the tail)
-- KEYS[2] bell list (wake-up tokens)
-- ARGV[1] the message: a kombu JSON envelope, an object ('{...}')
-- ARGV[2] max queue length (the tier's queue_max_len)
-- ARGV[3] max bell tokens kept
--
-- Returns {1, enqueued_ms, queue length}  or  {0, queue length} when full.

local len = redis.call('LLEN', KEYS[1])
if len >= tonumber(ARGV[2]) then
  return {0, len}
end
local now = gt_now_ms()
local body = ARGV[1]
-- '{' .. '"gt_enq_ms": N, ' .. rest: the envelope keeps every other byte as sent
local payload = '{"gt_enq_ms": ' .. now .. ', ' .. string.sub(body, 2)
len = redis.call('LPUSH', KEYS[1], payload)
gt_ring(KEYS[2], ARGV[3])
return {1, now, len}
