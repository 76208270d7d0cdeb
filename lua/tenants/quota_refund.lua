-- uses: core/prelude
-- tenants/quota_refund.lua: the one place a tenant's quotas are given back or settled after
-- lua/tenants/quota_take.lua: a submit that was then not enqueued gives back its task of the
-- hour and its tokens; a task that ended settles its TPM bucket from its estimate to the
-- usage the upstream reported (tokens = estimate - actual: positive gives back what it did not
-- use, capped at the bucket's size; negative charges what it used beyond its estimate -- the
-- bucket may go below zero, and the tenant's next submit waits until it has refilled).
--
-- KEYS[1] counter: the tenant's task counter of the hour it was taken in
-- KEYS[2] bucket: the tenant's TPM bucket hash
-- ARGV[1] counted: 1: the task was counted in the counter   ARGV[2] tokens: tokens to give back
--         (negative: to charge)
-- ARGV[3] tpm: the tenant's TPM (0: none was taken)
--
-- Returns 1.

if ARGV[A_counted] == '1' and tonumber(redis.call('GET', KEYS[K_counter]) or '0') > 0 then
  redis.call('DECR', KEYS[K_counter])
end
local tpm, delta = tonumber(ARGV[A_tpm]), tonumber(ARGV[A_tokens])
if tpm > 0 and delta ~= 0 then
  local now = gt_now_ms()
  local rate = tpm / 60000.0
  local b = redis.call('HMGET', KEYS[K_bucket], 'tokens', 'ts_ms')
  local tokens, ts = tonumber(b[1]), tonumber(b[2])
  if not tokens then
    if delta > 0 then return 1 end   -- no bucket: it is full (quota_take.lua starts one full)
    tokens, ts = tpm, now
  end
  tokens = math.min(tpm, gt_refill(tokens, tpm, rate, math.max(0, now - ts)) + delta)
  redis.call('HSET', KEYS[K_bucket], 'tokens', tostring(tokens), 'ts_ms', math.max(now, ts))
  -- a missing bucket reads as full: keep it until it has refilled (a debt may take longer than
  -- quota_take.lua's two minutes)
  redis.call('PEXPIRE', KEYS[K_bucket], math.max(120000, math.ceil((tpm - tokens) / rate) + 60000))
end
return 1
