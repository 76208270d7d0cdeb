-- uses: core/prelude
-- tenants/quota_take.lua: admit one submit against its tenant's quotas, atomically -- the
-- tenant's tasks in the current clock hour (the tier's max_tasks_per_hour; the same
-- counter beat counts cron fires in, with this script) and, when set, the tenant's own TPM
-- bucket.  Takes both or neither, so parallel submits never exceed either quota.
--
-- KEYS[1] counter: the tenant's task counter of the current clock hour (integer, TTL)
-- KEYS[2] bucket: the tenant's TPM bucket hash (tokens, ts_ms)
-- ARGV[1] max_per_hour: max tasks per hour (0: do not count here -- a cron fire, counted by
--         beat, with this script, when it claimed the run)
-- ARGV[2] counter_ttl_ms
-- ARGV[3] est_tokens: the task's estimated tokens     ARGV[4] tpm: the tenant's TPM (0: no TPM quota)
-- (the TPM bucket refills on the Redis clock; the caller names the counter's hour from its own,
-- as beat does for cron fires: the two agree but for clock skew at the turn of an hour)
--
-- Returns {1, count}                       taken (count: tasks this hour, 0 when not counted)
--         {0, 'tasks_per_hour', count}     the hour's quota is spent
--         {0, 'tenant_tpm', wait_ms}       the TPM bucket holds fewer tokens; wait_ms until it will

local max_per_hour, est, tpm = tonumber(ARGV[A_max_per_hour]), tonumber(ARGV[A_est_tokens]), tonumber(ARGV[A_tpm])
local count = 0
if max_per_hour > 0 then
  count = tonumber(redis.call('GET', KEYS[K_counter]) or '0')
  if count >= max_per_hour then return {0, 'tasks_per_hour', count} end
end
if tpm > 0 then
  local now = gt_now_ms()
  local b = redis.call('HMGET', KEYS[K_bucket], 'tokens', 'ts_ms')
  local tokens, ts = tonumber(b[1]), tonumber(b[2])
  if not tokens then tokens, ts = tpm, now end
  local rate = tpm / 60000.0
  tokens = gt_refill(tokens, tpm, rate, math.max(0, now - ts))
  if tokens < est then
    return {0, 'tenant_tpm', math.ceil((est - tokens) / rate)}
  end
  redis.call('HSET', KEYS[K_bucket], 'tokens', tostring(tokens - est), 'ts_ms', now)
  redis.call('PEXPIRE', KEYS[K_bucket], 120000)
end
if max_per_hour > 0 then
  count = redis.call('INCR', KEYS[K_counter])
  if count == 1 then redis.call('PEXPIRE', KEYS[K_counter], ARGV[A_counter_ttl_ms]) end
end
return {1, count}
