-- uses: prelude
-- sync_limits.lua: lower the pool's bucket to what the upstream says is left
-- (x-ratelimit-remaining-tokens / -requests).  Only ever lowers: another client
-- sharing the API key, or drift, makes the upstream know less than we think.
--
-- KEYS[1] bucket hash of the pool (tokens, requests, ts_ms, blocked_until_ms)
-- ARGV[1] token capacity    ARGV[2] tokens per ms
-- ARGV[3] request capacity  ARGV[4] requests per ms
-- ARGV[5] remaining tokens reported (-1 = not reported)
-- ARGV[6] remaining requests reported (-1 = not reported)
-- ARGV[7] the pool's debited_tokens and ARGV[8] its dispatches right after this task was
--         dispatched (-1 = unknown): what was dispatched since cannot be in the reported
--         remaining yet, so it is taken off it (else a reply would undo newer debits)
--
-- Returns {tokens, requests} after the sync (as strings).

local tcap, trate = tonumber(ARGV[1]), tonumber(ARGV[2])
local rcap, rrate = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = gt_now_ms()
local tokens, requests = gt_bucket(KEYS[1], tcap, trate, rcap, rrate, now)
local totals = redis.call('HMGET', KEYS[1], 'debited_tokens', 'dispatches')
tokens = gt_follow_remaining(tokens, tonumber(ARGV[5]), tonumber(ARGV[7]), totals[1])
requests = gt_follow_remaining(requests, tonumber(ARGV[6]), tonumber(ARGV[8]), totals[2])
redis.call('HSET', KEYS[1], 'tokens', tokens, 'requests', requests, 'ts_ms', now)
return {tostring(tokens), tostring(requests)}
