-- uses: core/prelude
-- bucket/take.lua: admit one request through a pool's bucket outside pick.lua -- a
-- reserved-tier call failing over to this (backup) pool -- debiting it now if it
-- has room; the caller settles it afterwards like any dispatch (lua/bucket/settle.lua).
-- A reserved tier may use the whole bucket, the reserve included.
--
-- KEYS[1] bucket: the pool's bucket hash (tokens, requests, ts_ms, blocked_until_ms,
--         debited_tokens, dispatches)
-- ARGV[1] token_capacity    ARGV[2] tokens_per_ms
-- ARGV[3] request_capacity  ARGV[4] requests_per_ms
-- ARGV[5] est_tokens: tokens to debit (the request's estimate)
--
-- Returns {1, debited_tokens, dispatches}  admitted (the pool's running totals after it,
--                                           for lua/bucket/sync_limits.lua),
--         {0, wait_ms}                      not now (blocked by a 429, or refilling).

local tcap, trate = tonumber(ARGV[A_token_capacity]), tonumber(ARGV[A_tokens_per_ms])
local rcap, rrate = tonumber(ARGV[A_request_capacity]), tonumber(ARGV[A_requests_per_ms])
local est = math.min(tonumber(ARGV[A_est_tokens]), tcap)
local now = gt_now_ms()
local tokens, requests, blocked_until = gt_bucket(KEYS[K_bucket], tcap, trate, rcap, rrate, now)
local w = 0
if blocked_until > now then w = blocked_until - now end
if est > tokens then w = math.max(w, math.ceil((est - tokens) / trate)) end
if requests < 1 then w = math.max(w, math.ceil((1 - requests) / rrate)) end
if w > 0 then return {0, w} end
redis.call('HSET', KEYS[K_bucket], 'tokens', tokens - est, 'requests', requests - 1, 'ts_ms', now)
local debited = redis.call('HINCRBYFLOAT', KEYS[K_bucket], 'debited_tokens', est)
local dispatches = redis.call('HINCRBY', KEYS[K_bucket], 'dispatches', 1)
return {1, tostring(debited), dispatches}
