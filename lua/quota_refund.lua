-- uses: prelude
-- quota_refund.lua: give back what lua/quota_take.lua took for a submit that was then
-- not enqueued (the queue refused it): one task of the hour's count, its tokens to the
-- tenant's TPM bucket (capped at the bucket's size).
--
-- KEYS[1] the tenant's task counter of the hour it was taken in   KEYS[2] the tenant's TPM bucket hash
-- ARGV[1] 1: the task was counted in KEYS[1]   ARGV[2] its estimated tokens
-- ARGV[3] the tenant's TPM (0: none was taken)
--
-- Returns 1.

if ARGV[1] == '1' and tonumber(redis.call('GET', KEYS[1]) or '0') > 0 then
  redis.call('DECR', KEYS[1])
end
local tpm = tonumber(ARGV[3])
if tpm > 0 then
  local now = gt_now_ms()
  local b = redis.call('HMGET', KEYS[2], 'tokens', 'ts_ms')
  local tokens, ts = tonumber(b[1]), tonumber(b[2])
  if tokens then
    tokens = gt_refill(tokens, tpm, tpm / 60000.0, math.max(0, now - ts)) + tonumber(ARGV[2])
    redis.call('HSET', KEYS[2], 'tokens', tostring(math.min(tpm, tokens)), 'ts_ms', math.max(now, ts))
  end
end
return 1
