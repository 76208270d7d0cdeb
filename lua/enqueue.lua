-- uses: prelude
-- enqueue.lua: queue one task of a tier on a pool -- a small index entry into the
-- tier's index for its message, which the caller wrote into the pool's message hash
-- in the same MULTI (gateway_tasks/core/enqueue.py: the body never passes through
-- Lua) -- unless the tier is at its queue length limit (tail drop: the message is
-- taken back out); make its tenant active (or park it when the tenant is at its
-- concurrency cap); ring the pool's bell.
--
-- KEYS[1] messages hash (tag -> message)     KEYS[2] the tier's index (sorted set; its size is
--                                            the tier's queue length)
-- KEYS[3] the tier's active tenants (zset)   KEYS[4] finish tags (tenant -> F)
-- KEYS[5] parked tenants (tenant -> tier)    KEYS[6] in-flight (tenant -> n)
-- KEYS[7] enqueue sequence                   KEYS[8] fair hash (tv:<tier>)
-- KEYS[9] bell list
-- ARGV[1] tier   ARGV[2] tenant   ARGV[3] delivery tag   ARGV[4] est tokens
-- ARGV[5] tenant weight (> 0)
-- ARGV[6] the tier's queue_max_len   ARGV[7] the tier's max in-flight per tenant
-- ARGV[8] max bell tokens kept
-- ARGV[9] enqueue time (ms) to record: '' = now on the Redis clock (a given one: tools, tests)
--
-- Returns {1, enqueued_ms, depth}  or  {0, depth} when the tier's queue is full; an error
-- when the message is not in the messages hash (not written first: nothing is queued).

local tier, tenant, tag = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HEXISTS', KEYS[1], tag) == 0 then
  return redis.error_reply('enqueue.lua: message ' .. tag .. ' is not in the messages hash; '
                           .. 'write it in the same MULTI first (gateway_tasks.core.enqueue.enqueue)')
end
local depth = redis.call('ZCARD', KEYS[2])
if depth >= tonumber(ARGV[6]) then
  redis.call('HDEL', KEYS[1], tag)
  return {0, depth}
end
local now = tonumber(ARGV[9]) or gt_now_ms()
local seq = redis.call('INCR', KEYS[7])
local entry = tenant .. '|' .. string.format('%016x', seq) .. '|' .. tag .. '|' .. ARGV[4]
              .. '|' .. now .. '|' .. ARGV[5]
redis.call('ZADD', KEYS[2], '0', entry)
if not redis.call('ZSCORE', KEYS[3], tenant) and redis.call('HEXISTS', KEYS[5], tenant) == 0 then
  gt_activate(KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[8], tier, tenant, tonumber(ARGV[7]))
end
gt_ring(KEYS[9], ARGV[8])
return {1, now, depth + 1}
