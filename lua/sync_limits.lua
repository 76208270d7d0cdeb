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
local rt, rr = tonumber(ARGV[5]), tonumber(ARGV[6])
local since_t, since_r = tonumber(ARGV[7]), tonumber(ARGV[8])
local totals = redis.call('HMGET', KEYS[1], 'debited_tokens', 'dispatches')
if rt >= 0 and since_t >= 0 then rt = rt - math.max(0, (tonumber(totals[1]) or 0) - since_t) end
if rr >= 0 and since_r >= 0 then rr = rr - math.max(0, (tonumber(totals[2]) or 0) - since_r) end
if ARGV[5] ~= '-1' and rt < tokens then tokens = math.max(0, rt) end
if ARGV[6] ~= '-1' and rr < requests then requests = math.max(0, rr) end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'requests', requests, 'ts_ms', now)
return {tostring(tokens), tostring(requests)}
