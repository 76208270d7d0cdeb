-- uses: core/prelude
-- bucket/sync_limits.lua: lower the pool's bucket to what the upstream says is left
-- (x-ratelimit-remaining-tokens / -requests).  Only ever lowers: another client
-- sharing the API key, or drift, makes the upstream know less than we think.
--
-- KEYS[1] bucket: the pool's bucket hash (tokens, requests, ts_ms, blocked_until_ms)
-- ARGV[1] token_capacity    ARGV[2] tokens_per_ms
-- ARGV[3] request_capacity  ARGV[4] requests_per_ms
-- ARGV[5] remaining_tokens: reported (-1 = not reported)
-- ARGV[6] remaining_requests: reported (-1 = not reported)
-- ARGV[7] debited_at_dispatch: the pool's debited_tokens and ARGV[8] dispatches_at_dispatch:
--         its dispatches, right after this task was dispatched (-1 = unknown): what was
--         dispatched since cannot be in the reported remaining yet, so it is taken off it
--         (else a reply would undo newer debits)
--
-- Returns {tokens, requests} after the sync (as strings).

local tcap, trate = tonumber(ARGV[A_token_capacity]), tonumber(ARGV[A_tokens_per_ms])
local rcap, rrate = tonumber(ARGV[A_request_capacity]), tonumber(ARGV[A_requests_per_ms])
local now = gt_now_ms()
local tokens, requests = gt_bucket(KEYS[K_bucket], tcap, trate, rcap, rrate, now)
local totals = redis.call('HMGET', KEYS[K_bucket], 'debited_tokens', 'dispatches')
tokens = gt_follow_remaining(tokens, tonumber(ARGV[A_remaining_tokens]), tonumber(ARGV[A_debited_at_dispatch]),
                             totals[1])
requests = gt_follow_remaining(requests, tonumber(ARGV[A_remaining_requests]),
                               tonumber(ARGV[A_dispatches_at_dispatch]), totals[2])
redis.call('HSET', KEYS[K_bucket], 'tokens', tokens, 'requests', requests, 'ts_ms', now)
return {tostring(tokens), tostring(requests)}
