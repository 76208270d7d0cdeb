-- uses: prelude
-- drain.lua: the upstream answered 429: empty the pool's bucket and admit
-- nothing to it until Retry-After has passed.
--
-- KEYS[1] bucket hash of the pool (tokens, requests, ts_ms, blocked_until_ms)
-- KEYS[2] stats hash of the pool
-- ARGV[1] retry after, ms
-- ARGV[2] stats field counting the pool's 429s (gateway_tasks/core/stats.py)
--
-- Returns the blocked-until time (ms since epoch, Redis clock).

local now = gt_now_ms()
local until_ms = now + math.max(0, tonumber(ARGV[1]))
local old = tonumber(redis.call('HGET', KEYS[1], 'blocked_until_ms')) or 0
if old > until_ms then until_ms = old end
redis.call('HSET', KEYS[1], 'tokens', 0, 'requests', 0, 'ts_ms', until_ms, 'blocked_until_ms', until_ms)
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
return until_ms
