-- uses: core/prelude
-- bucket/drain.lua: the upstream answered 429: empty the pool's bucket and admit
-- nothing to it until Retry-After has passed.
--
-- KEYS[1] bucket: the pool's bucket hash (tokens, requests, ts_ms, blocked_until_ms)
-- KEYS[2] stats: the pool's stats hash
-- ARGV[1] retry_after_ms
-- ARGV[2] stats_field: counting the pool's 429s (gateway_tasks/core/stats.py)
--
-- Returns the blocked-until time (ms since epoch, Redis clock).

local now = gt_now_ms()
local until_ms = now + math.max(0, tonumber(ARGV[A_retry_after_ms]))
local old = tonumber(redis.call('HGET', KEYS[K_bucket], 'blocked_until_ms')) or 0
if old > until_ms then until_ms = old end
redis.call('HSET', KEYS[K_bucket], 'tokens', 0, 'requests', 0, 'ts_ms', until_ms, 'blocked_until_ms', until_ms)
redis.call('HINCRBY', KEYS[K_stats], ARGV[A_stats_field], 1)
return until_ms
