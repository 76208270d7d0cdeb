-- uses: core/prelude
-- upstream/circuit.lua: a pool's circuit breaker, one transition per call.
--   closed     calls go to the upstream; consecutive failures are counted
--   open       after failure_threshold consecutive failures: nothing is called for open_ms,
--              and the pool's bucket is blocked (blocked_until_ms) so pick.lua holds its queues
--   half_open  open_ms passed: the next caller is the probe (one at a time; a probe that
--              never reports back is replaced after probe_timeout_ms); its success closes
--              the circuit (failback), its failure opens it again
--
-- KEYS[1] circuit: hash (state, failures, open_until_ms, probe_until_ms)
-- KEYS[2] bucket: the pool's bucket hash (blocked_until_ms is raised while the circuit holds calls)
-- KEYS[3] stats: the pool's stats hash
-- ARGV[1] op: allow | success | failure
-- ARGV[2] failure_threshold   ARGV[3] open_ms   ARGV[4] probe_timeout_ms
-- ARGV[5] opens_field: the stats field counting openings
-- ARGV[6] closes_field: the stats field counting closings
--
-- Returns {state, verdict, until_ms, failures}:
--   allow:   verdict 'call' (closed), 'probe' (this caller probes), 'wait' (held until until_ms)
--   success: 'ok' (was closed), 'closed' (a probe closed it: failback)
--   failure: 'counted' (still closed), 'opened' (it opened now), 'open' (was open already)

local now = gt_now_ms()
local op = ARGV[A_op]
local c = redis.call('HMGET', KEYS[K_circuit], 'state', 'failures', 'open_until_ms', 'probe_until_ms')
local state = c[1] or 'closed'
local failures = tonumber(c[2]) or 0
local open_until = tonumber(c[3]) or 0
local probe_until = tonumber(c[4]) or 0
local open_ms, probe_ms = tonumber(ARGV[A_open_ms]), tonumber(ARGV[A_probe_timeout_ms])

local function hold(until_ms)
  local old = tonumber(redis.call('HGET', KEYS[K_bucket], 'blocked_until_ms')) or 0
  if until_ms > old then redis.call('HSET', KEYS[K_bucket], 'blocked_until_ms', until_ms) end
end

local function open()
  open_until = now + open_ms
  redis.call('HSET', KEYS[K_circuit], 'state', 'open', 'failures', failures, 'open_until_ms', open_until)
  redis.call('HINCRBY', KEYS[K_stats], ARGV[A_opens_field], 1)
  hold(open_until)
end

if op == 'allow' then
  if state == 'closed' then return {state, 'call', 0, failures} end
  if state == 'open' and now < open_until then
    hold(open_until)
    return {state, 'wait', open_until, failures}
  end
  if state == 'half_open' and now < probe_until then
    local until_ms = math.min(probe_until, now + open_ms)
    hold(until_ms)
    return {state, 'wait', until_ms, failures}
  end
  -- open long enough, or the last probe was lost: this caller probes
  probe_until = now + probe_ms
  redis.call('HSET', KEYS[K_circuit], 'state', 'half_open', 'probe_until_ms', probe_until)
  return {'half_open', 'probe', probe_until, failures}
elseif op == 'success' then
  if state == 'closed' then
    if failures > 0 then redis.call('HSET', KEYS[K_circuit], 'failures', 0) end
    return {'closed', 'ok', 0, 0}
  end
  redis.call('HSET', KEYS[K_circuit], 'state', 'closed', 'failures', 0, 'open_until_ms', 0, 'probe_until_ms', 0)
  redis.call('HINCRBY', KEYS[K_stats], ARGV[A_closes_field], 1)
  return {'closed', 'closed', 0, 0}
elseif op == 'failure' then
  failures = failures + 1
  if state == 'half_open' or (state == 'closed' and failures >= tonumber(ARGV[A_failure_threshold])) then
    open()
    return {'open', 'opened', open_until, failures}
  end
  redis.call('HSET', KEYS[K_circuit], 'failures', failures)
  if state == 'open' then return {'open', 'open', open_until, failures} end
  return {'closed', 'counted', 0, failures}
end
return redis.error_reply('circuit.lua: unknown op ' .. tostring(op))
