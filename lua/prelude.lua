-- prelude.lua: functions shared by the scripts whose first line is "-- uses: prelude".
-- The loader (gateway_tasks/core/scripts.py) loads such a script as this file
-- followed by the script, so these locals are in scope there.  No KEYS, no ARGV:
-- every key a function touches is passed to it by the script.

-- Redis TIME in whole milliseconds since the epoch.
local function gt_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A continuous bucket's level after elapsed_ms of refill at rate_per_ms, capped at cap.
local function gt_refill(level, cap, rate_per_ms, elapsed_ms)
  return math.min(cap, level + elapsed_ms * rate_per_ms)
end

-- A pool's bucket hash (tokens, requests, ts_ms, blocked_until_ms) refilled to now_ms:
-- returns tokens, requests, blocked_until_ms.  A bucket never written is full.
local function gt_bucket(key, tcap, trate, rcap, rrate, now_ms)
  local b = redis.call('HMGET', key, 'tokens', 'requests', 'ts_ms', 'blocked_until_ms')
  local tokens, requests, ts = tonumber(b[1]), tonumber(b[2]), tonumber(b[3])
  if not tokens then tokens, requests, ts = tcap, rcap, now_ms end
  local dt = math.max(0, now_ms - ts)
  return gt_refill(tokens, tcap, trate, dt), gt_refill(requests, rcap, rrate, dt), tonumber(b[4]) or 0
end

-- Ring the bell list: one wake-up token, keeping at most max_tokens.
local function gt_ring(bell_key, max_tokens)
  redis.call('LPUSH', bell_key, '1')
  redis.call('LTRIM', bell_key, 0, tonumber(max_tokens) - 1)
end
