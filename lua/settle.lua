-- uses: prelude
-- settle.lua: after an upstream call, correct the pool's bucket from the
-- estimate debited at dispatch to the usage the upstream reported, lower it to
-- what the reply's rate-limit headers say is left (as lua/sync_limits.lua: one
-- call where there used to be two), update the tenant's learned completion
-- length, and ring the bell when tokens came back while a dispatcher waits for them.
--
-- KEYS[1] bucket hash of the pool (tokens, requests, ts_ms, blocked_until_ms)
-- KEYS[2] stats hash of the pool
-- KEYS[3] learned completion hash of the pool ('<tenant>|<model>' -> EWMA of completion tokens)
-- KEYS[4] the pool's bell list
-- ARGV[1] token capacity    ARGV[2] tokens per ms
-- ARGV[3] request capacity  ARGV[4] requests per ms
-- ARGV[5] estimated tokens debited at dispatch
-- ARGV[6] actual tokens charged (prompt + completion); 0 when the call never reached the upstream
-- ARGV[7] learned field '<tenant>|<model>'   ARGV[8] completion tokens   ARGV[9] EWMA weight (0 = do not learn)
-- ARGV[10] max bell tokens kept
-- ARGV[11] 1 = the upstream never saw the request: also give back its request slot, and take
--          it out of the bucket's debited_tokens / dispatches totals (following a reply's remaining takes
--          what was dispatched after a task off the upstream's reported remaining; a request
--          refunded unsent is not in flight, so it must not count there)
-- ARGV[12] stats field counting the actual tokens   ARGV[13] stats field counting completed
--          calls (the tier's, named in gateway_tasks/core/stats.py)
-- ARGV[14] remaining tokens reported   ARGV[15] remaining requests reported (-1 = not reported)
-- ARGV[16] the pool's debited_tokens and ARGV[17] its dispatches right after this task was
--          dispatched (-1 = unknown)
--
-- Returns {tokens, requests, now_ms} after the correction (as strings; now_ms on the Redis clock).

local tcap, trate = tonumber(ARGV[1]), tonumber(ARGV[2])
local rcap, rrate = tonumber(ARGV[3]), tonumber(ARGV[4])
local est, actual = tonumber(ARGV[5]), tonumber(ARGV[6])
local now = gt_now_ms()
local tokens, requests, _, wait_until = gt_bucket(KEYS[1], tcap, trate, rcap, rrate, now)
local refund = est - actual
tokens = math.min(tcap, tokens + refund)
if ARGV[11] == '1' then requests = math.min(rcap, requests + 1) end
if ARGV[14] ~= '-1' or ARGV[15] ~= '-1' then
  local totals = redis.call('HMGET', KEYS[1], 'debited_tokens', 'dispatches')
  tokens = gt_follow_remaining(tokens, tonumber(ARGV[14]), tonumber(ARGV[16]), totals[1])
  requests = gt_follow_remaining(requests, tonumber(ARGV[15]), tonumber(ARGV[17]), totals[2])
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'requests', requests, 'ts_ms', now)
if ARGV[11] == '1' and redis.call('HEXISTS', KEYS[1], 'debited_tokens') == 1 then
  redis.call('HINCRBYFLOAT', KEYS[1], 'debited_tokens', -est)
  redis.call('HINCRBY', KEYS[1], 'dispatches', -1)
end
if actual > 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[12], actual)
  redis.call('HINCRBY', KEYS[2], ARGV[13], 1)
end
local w = tonumber(ARGV[9])
if w > 0 then
  local old = tonumber(redis.call('HGET', KEYS[3], ARGV[7]))
  local c = tonumber(ARGV[8])
  local new = c
  if old then new = old + w * (c - old) end
  redis.call('HSET', KEYS[3], ARGV[7], new)
end
-- the bell only while a dispatcher waits for the bucket (pick.lua's wait_until_ms): a refund
-- nobody waits for would wake an idle one for an empty pick
if refund > 0 and wait_until >= now then
  gt_ring(KEYS[4], ARGV[10])
end
return {tostring(tokens), tostring(requests), tostring(now)}
