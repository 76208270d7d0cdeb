-- uses: core/prelude
-- bucket/drain.lua: the upstream answered 429: admit nothing to the pool until Retry-After
-- has passed, and from then on what the refused request needed.  An upstream's Retry-After
-- is the time until that request fits (a bucket's refill, or a sliding window's oldest
-- charges expiring), so dispatch resumes exactly then -- with the request put back, which
-- goes first in its tenant's line -- and the bucket refills from there.
--
-- KEYS[1] bucket: the pool's bucket hash (tokens, requests, ts_ms, blocked_until_ms)
-- KEYS[2] stats: the pool's stats hash
-- ARGV[1] retry_after_ms
-- ARGV[2] stats_field: counting the pool's 429s (gateway_tasks/core/stats.py)
-- ARGV[3] est_tokens?: what the refused request was debited (at most the bucket's capacity):
--         the bucket holds that much at Retry-After (0: empty then)
--
-- Returns the blocked-until time (ms since epoch, Redis clock).

local now = gt_now_ms()
local until_ms = now + math.max(0, tonumber(ARGV[A_retry_after_ms]))
local old = tonumber(redis.call('HGET', KEYS[K_bucket], 'blocked_until_ms')) or 0
if old > until_ms then until_ms = old end
local est = math.max(0, tonumber(ARGV[A_est_tokens]) or 0)
redis.call('HSET', KEYS[K_bucket], 'tokens', est, 'requests', 1, 'ts_ms', until_ms, 'blocked_until_ms', until_ms)
redis.call('HINCRBY', KEYS[K_stats], ARGV[A_stats_field], 1)
return until_ms
