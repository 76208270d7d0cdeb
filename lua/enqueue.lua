-- uses: prelude
-- enqueue.lua: queue one task of a tier on a pool -- a small index entry into the
-- tier's index for its message, which the caller wrote into the pool's message hash
-- in the same MULTI (gateway_tasks/core/enqueue.py: the body never passes through
-- Lua) -- unless the tier is at its queue length limit (tail drop: the message is
-- taken back out); make its tenant active (or park it when the tenant is at its
-- concurrency cap), in its head's lane; ring the tier's bell.  A scheduled task's seq
-- is 's' + 16 hex digits, so it queues behind its tenant's interactive tasks; an
-- interactive task of a tenant in line behind its scheduled head becomes that head, and
-- the tenant moves up by the lag (the score's parity says it carried it: no read).
--
-- KEYS[1] messages hash (tag -> message)     KEYS[2] the tier's index (sorted set; its size is
--                                            the tier's queue length)
-- KEYS[3] the tier's active tenants (zset)   KEYS[4] finish tags (tenant -> F)
-- KEYS[5] parked tenants (tenant -> tier)    KEYS[6] in-flight (tenant -> n)
-- KEYS[7] enqueue sequence                   KEYS[8] fair hash (tv:<tier>)
-- KEYS[9] the tier's bell list (Keys.tier_bell)   KEYS[10] reserved-work bell list (rung as well for a reserved tier's
--                    interactive task: dispatchers whose other slots are full wait on it)
-- [lifecycle] KEYS[11..] every tier's index of the pool (the shared capacity counts them all;
--                       passed only when ARGV[10] sets one)
-- ARGV[1] tier   ARGV[2] tenant   ARGV[3] delivery tag   ARGV[4] est tokens
-- ARGV[5] tenant weight (> 0)
-- ARGV[6] the tier's queue_max_len   ARGV[7] the tier's max in-flight per tenant
-- ARGV[8] max bell tokens kept
-- ARGV[9] enqueue time (ms) to record: '' = now on the Redis clock (a given one: tools, tests)
-- ARGV[10] the pool's shared queue capacity, all tiers together ('' or 0 = none)
-- ARGV[11] the task's lane: 'scheduled' | 'interactive' (gateway_tasks/core/lanes.py)
-- ARGV[12] the tier's scheduled lag (weighted tokens; 0 = no lanes: nothing is marked)
-- ARGV[13] '1': the tier may use the pool's reserve (its interactive work rings KEYS[10] too)
-- ARGV[14] the message's size in bytes, kept in the entry (pick.lua then hands a small message
--          back without asking its length); '' = not known (an entry of six fields)
-- ARGV[15] the task's ref key's index in KEYS (0 or absent: none) -- Keys.task_ref_in, under the
--          pool's tag: written once the task is queued, '<pool>|<tier>|<tenant>|<tag>|<entry>'
--          (gateway_tasks/core/cancel.py TaskRef; ARGV[16] its pool name, ARGV[17] its TTL, ms)
--
-- Returns {1, enqueued_ms, depth, index entry}  or  {0, depth} when the tier's queue is full,
-- {0, depth, 1} when the pool's shared capacity is (the producer may then evict: lua/evict.lua;
-- the message is taken back out either way); an error when the message is not in the
-- messages hash (not written first: nothing is queued).

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
-- [lifecycle: shared capacity] begin
local capacity = tonumber(ARGV[10]) or 0
if capacity > 0 then
  local total = 0
  for k = 11, #KEYS do total = total + redis.call('ZCARD', KEYS[k]) end
  if total >= capacity then
    redis.call('HDEL', KEYS[1], tag)
    return {0, depth, 1}
  end
end
-- [lifecycle: shared capacity] end
local now = tonumber(ARGV[9]) or gt_now_ms()
local lag = tonumber(ARGV[12]) or 0
local scheduled = ARGV[11] == 'scheduled' and lag > 0
local seq = redis.call('INCR', KEYS[7])
local entry = tenant .. '|' .. (scheduled and 's' or '') .. string.format('%016x', seq) .. '|' .. tag
              .. '|' .. ARGV[4] .. '|' .. now .. '|' .. ARGV[5]
if ARGV[14] and ARGV[14] ~= '' then entry = entry .. '|' .. ARGV[14] end
redis.call('ZADD', KEYS[2], '0', entry)
local score = tonumber(redis.call('ZSCORE', KEYS[3], tenant))
if score then
  if not scheduled and score % 2 == 1 then   -- its head was scheduled: this task is its head now
    redis.call('ZADD', KEYS[3], gt_lane_score(gt_lane_start(score, lag), false, lag), tenant)
  end
elseif redis.call('HEXISTS', KEYS[5], tenant) == 0 then
  gt_activate(KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[8], tier, tenant, tonumber(ARGV[7]), scheduled, lag)
end
gt_ring(KEYS[9], ARGV[8])
-- at most one token: nobody waits on it most of the time, and stale tokens would each cost a
-- dispatcher that starts waiting on it an empty pick
if ARGV[13] == '1' and not scheduled then gt_ring(KEYS[10], 1) end
local ref = tonumber(ARGV[15]) or 0
if ref > 0 then
  redis.call('SET', KEYS[ref], ARGV[16] .. '|' .. tier .. '|' .. tenant .. '|' .. tag .. '|' .. entry,
             'PX', ARGV[17])
end
return {1, now, depth + 1, entry}   -- [lifecycle] the entry: cancel finds the task by it
