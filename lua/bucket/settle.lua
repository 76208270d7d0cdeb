-- uses: core/prelude
-- bucket/settle.lua: after an upstream call, correct the pool's bucket from the
-- estimate debited at dispatch to the usage the upstream reported, lower it to
-- what the reply's rate-limit headers say is left (as lua/bucket/sync_limits.lua: one
-- call where there used to be two), update the tenant's learned completion
-- length, and ring the bell when tokens that came back end a dispatcher's wait for them.
--
-- KEYS[1] bucket: the pool's bucket hash (tokens, requests, ts_ms, blocked_until_ms)
-- KEYS[2] stats: the pool's stats hash
-- KEYS[3] learned: the pool's learned completions ('<tenant>|<model>' -> EWMA of completion tokens)
-- KEYS[4] bell: the pool's bell list
-- ARGV[1] token_capacity    ARGV[2] tokens_per_ms
-- ARGV[3] request_capacity  ARGV[4] requests_per_ms
-- ARGV[5] est_tokens: debited at dispatch
-- ARGV[6] actual_tokens: charged (prompt + completion); 0 when the call never reached the upstream
-- ARGV[7] learned_field: '<tenant>|<model>'   ARGV[8] completion_tokens
-- ARGV[9] learn_weight: EWMA weight (0 = do not learn)
-- ARGV[10] bell_max: max bell tokens kept
-- ARGV[11] unsent: 1 = the upstream never saw the request: also give back its request slot, and
--          take it out of the bucket's debited_tokens / dispatches totals (following a reply's
--          remaining takes what was dispatched after a task off the upstream's reported
--          remaining; a request refunded unsent is not in flight, so it must not count there)
-- ARGV[12] actual_tokens_field: the stats field counting the actual tokens
-- ARGV[13] completed_field: the stats field counting completed calls (the tier's, named in
--          gateway_tasks/core/stats.py)
-- ARGV[14] remaining_tokens: reported   ARGV[15] remaining_requests: reported (-1 = not reported)
-- ARGV[16] debited_at_dispatch: the pool's debited_tokens and ARGV[17] dispatches_at_dispatch:
--          its dispatches, right after this task was dispatched (-1 = unknown)
-- ARGV[18] keep_unused: 1 = the pool's upstream counts a strict window (Pool.window): it keeps
--          what it charged at admission (prompt + max_tokens), so a reply shorter than its
--          estimate gives nothing back (a usage above it is still charged)
--
-- Returns {tokens, requests, now_ms} after the correction (as strings; now_ms on the Redis clock).

local tcap, trate = tonumber(ARGV[A_token_capacity]), tonumber(ARGV[A_tokens_per_ms])
local rcap, rrate = tonumber(ARGV[A_request_capacity]), tonumber(ARGV[A_requests_per_ms])
local est, actual = tonumber(ARGV[A_est_tokens]), tonumber(ARGV[A_actual_tokens])
local now = gt_now_ms()
local tokens, requests, _, wait_until = gt_bucket(KEYS[K_bucket], tcap, trate, rcap, rrate, now)
local refund = est - actual
if refund > 0 and ARGV[A_keep_unused] == '1' and ARGV[A_unsent] ~= '1' then refund = 0 end
tokens = math.min(tcap, tokens + refund)
if ARGV[A_unsent] == '1' then requests = math.min(rcap, requests + 1) end
if ARGV[A_remaining_tokens] ~= '-1' or ARGV[A_remaining_requests] ~= '-1' then
  local totals = redis.call('HMGET', KEYS[K_bucket], 'debited_tokens', 'dispatches')
  tokens = gt_follow_remaining(tokens, tonumber(ARGV[A_remaining_tokens]), tonumber(ARGV[A_debited_at_dispatch]),
                               totals[1])
  requests = gt_follow_remaining(requests, tonumber(ARGV[A_remaining_requests]),
                                 tonumber(ARGV[A_dispatches_at_dispatch]), totals[2])
end
redis.call('HSET', KEYS[K_bucket], 'tokens', tokens, 'requests', requests, 'ts_ms', now)
if ARGV[A_unsent] == '1' and redis.call('HEXISTS', KEYS[K_bucket], 'debited_tokens') == 1 then
  redis.call('HINCRBYFLOAT', KEYS[K_bucket], 'debited_tokens', -est)
  redis.call('HINCRBY', KEYS[K_bucket], 'dispatches', -1)
end
if actual > 0 then
  redis.call('HINCRBY', KEYS[K_stats], ARGV[A_actual_tokens_field], actual)
  redis.call('HINCRBY', KEYS[K_stats], ARGV[A_completed_field], 1)
end
local w = tonumber(ARGV[A_learn_weight])
if w > 0 then
  local old = tonumber(redis.call('HGET', KEYS[K_learned], ARGV[A_learned_field]))
  local c = tonumber(ARGV[A_completion_tokens])
  local new = c
  if old then new = old + w * (c - old) end
  redis.call('HSET', KEYS[K_learned], ARGV[A_learned_field], new)
end
-- the bell only while a dispatcher waits for the bucket (pick.lua's wait_until_ms), and only once
-- the refunds bring that wait to an end: the waiting winner is admitted refund / rate sooner, so
-- wait_until_ms moves that much earlier, and the bell rings when it is due -- a refund that only
-- shortens the wait would wake the dispatcher for an empty pick (it wakes at its timer anyway)
if refund > 0 and wait_until >= now then
  local sooner = wait_until - refund / trate
  redis.call('HSET', KEYS[K_bucket], 'wait_until_ms', sooner)
  if sooner <= now then gt_ring(KEYS[K_bell], ARGV[A_bell_max]) end
end
return {tostring(tokens), tostring(requests), tostring(now)}
