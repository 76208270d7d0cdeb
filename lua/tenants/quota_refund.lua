-- uses: core/prelude
-- tenants/quota_refund.lua: give back what lua/tenants/quota_take.lua took for a submit that was then
-- not enqueued (the queue refused it): one task of the hour's count, its tokens to the
-- tenant's TPM bucket (capped at the bucket's size).
--
-- KEYS[1] counter: the tenant's task counter of the hour it was taken in
-- KEYS[2] bucket: the tenant's TPM bucket hash
-- ARGV[1] counted: 1: the task was counted in the counter   ARGV[2] est_tokens: its estimated tokens
-- ARGV[3] tpm: the tenant's TPM (0: none was taken)
--
-- Returns 1.

if ARGV[A_counted] == '1' and tonumber(redis.call('GET', KEYS[K_counter]) or '0') > 0 then
  redis.call('DECR', KEYS[K_counter])
end
local tpm = tonumber(ARGV[A_tpm])
if tpm > 0 then
  local now = gt_now_ms()
  local b = redis.call('HMGET', KEYS[K_bucket], 'tokens', 'ts_ms')
  local tokens, ts = tonumber(b[1]), tonumber(b[2])
  if tokens then
    tokens = gt_refill(tokens, tpm, tpm / 60000.0, math.max(0, now - ts)) + tonumber(ARGV[A_est_tokens])
    redis.call('HSET', KEYS[K_bucket], 'tokens', tostring(math.min(tpm, tokens)), 'ts_ms', math.max(now, ts))
  end
end
return 1
