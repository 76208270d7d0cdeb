-- uses: core/prelude
-- dispatch/enqueue.lua: queue one task of a tier on a pool -- a small index entry into the
-- tier's index for its message, which the caller wrote into the pool's message hash
-- in the same MULTI (gateway_tasks/dispatch/enqueue.py: the body never passes through
-- Lua) -- unless the tier is at its queue length limit (tail drop: the message is
-- taken back out); make its tenant active (or park it when the tenant is at its
-- concurrency cap), in its head's lane; ring the tier's bell.  A scheduled task's seq
-- is 's' + 16 hex digits, so it queues behind its tenant's interactive tasks; an
-- interactive task of a tenant in line behind its scheduled head becomes that head, and
-- the tenant moves up by the lag (the score's parity says it carried it: no read).
--
-- KEYS[1] messages: hash (tag -> message)   KEYS[2] index: the tier's (sorted set; its size is the
--                                         tier's queue length)
-- KEYS[3] active: the tier's active tenants (zset)   KEYS[4] finish: tags (tenant -> F)
-- KEYS[5] parked: tenants (tenant -> tier)    KEYS[6] inflight: (tenant -> n)
-- KEYS[7] seq: the enqueue sequence           KEYS[8] fair: hash (tv:<tier>; rsv_ms: a reserved
--                                               tier's last interactive arrival)
-- KEYS[9] bell: the tier's bell list (Keys.tier_bell)
-- KEYS[10] reserved_bell: the reserved-work bell list (rung as well for a reserved tier's
--          interactive task: dispatchers whose other slots are full wait on it)
-- KEYS[11] demand: [capacity] the pool and tier's demand history of the clock hour (Keys.demand)
-- KEYS[..] per capacity_tier (C): index
--   every tier's index of the pool (the shared capacity counts them all; passed
--   only when pool_capacity sets one)
-- KEYS[..] task_ref?: the task's ref key (Keys.task_ref_in, under the pool's tag): written once
--   the task is queued, '<pool>|<tier>|<tenant>|<tag>|<entry>' (gateway_tasks/lifecycle/cancel.py
--   TaskRef); absent: none
-- ARGV[1] tier   ARGV[2] tenant   ARGV[3] tag: the delivery tag   ARGV[4] est_tokens
-- ARGV[5] weight: the tenant's (> 0)
-- ARGV[6] queue_max_len: the tier's   ARGV[7] tenant_max_inflight: the tier's max in-flight per tenant
-- ARGV[8] bell_max: max bell tokens kept
-- ARGV[9] enqueued_ms: the enqueue time to record: '' = now on the Redis clock (a given one:
--         tools, tests)
-- ARGV[10] pool_capacity: the pool's shared queue capacity, all tiers together ('' or 0 = none)
-- ARGV[11] lane: the task's, 'scheduled' | 'interactive' (gateway_tasks/dispatch/lanes.py)
-- ARGV[12] lag_tokens: the tier's scheduled lag (weighted tokens; 0 = no lanes: nothing is marked)
-- ARGV[13] reserved: '1': the tier may use the pool's reserve (its interactive work rings the
--          reserved bell too)
-- ARGV[14] C: how many tiers' indexes the shared capacity counts
-- ARGV[15] message_b: the message's size in bytes, kept in the entry (pick.lua then hands a small
--          message back without asking its length); '' = not known (an entry of six fields)
-- ARGV[16] demand_minute: [capacity] the minute of the hour the arrival is counted in ('' = not
--          counted: the same arrival again): fields 'r<minute>' += 1, 't<minute>' += est_tokens
--          (gateway_tasks.core.keys.demand_fields), refused arrivals too (demand not served)
-- ARGV[17] demand_ttl_s: the history's retention
-- ARGV[18] ref_pool?: the pool name written in the task's ref   ARGV[19] ref_ttl_ms?: its TTL
-- ARGV[20] event_channel?: where the task-sent event goes once the task is queued (Celery's event
--          channel; '' or absent: no event)
-- ARGV[21] event?: the event's message (gateway_tasks/dispatch/message.py: a submit's one publish,
--          made in this call)
-- Returns {1, enqueued_ms, depth, index entry}  or  {0, depth} when the tier's queue is full,
-- {0, depth, 1} when the pool's shared capacity is (the producer may then evict: lua/dispatch/evict.lua;
-- the message is taken back out either way); an error when the message is not in the
-- messages hash (not written first: nothing is queued).

local tier, tenant, tag = ARGV[A_tier], ARGV[A_tenant], ARGV[A_tag]
if redis.call('HEXISTS', KEYS[K_messages], tag) == 0 then
  return redis.error_reply('enqueue.lua: message ' .. tag .. ' is not in the messages hash; '
                           .. 'write it in the same MULTI first (gateway_tasks.dispatch.enqueue.enqueue)')
end
local minute = ARGV[A_demand_minute]   -- [capacity]
if minute ~= '' then
  redis.call('HINCRBY', KEYS[K_demand], 'r' .. minute, 1)
  redis.call('HINCRBY', KEYS[K_demand], 't' .. minute, ARGV[A_est_tokens])
  redis.call('EXPIRE', KEYS[K_demand], ARGV[A_demand_ttl_s])
end
local depth = redis.call('ZCARD', KEYS[K_index])
if depth >= tonumber(ARGV[A_queue_max_len]) then
  redis.call('HDEL', KEYS[K_messages], tag)
  return {0, depth}
end
-- begin
local capacity = tonumber(ARGV[A_pool_capacity]) or 0
if capacity > 0 then
  local total = 0
  for t = 1, N_capacity_tier do
    total = total + redis.call('ZCARD', KEYS[K_capacity_tier_index + K_per_capacity_tier * (t - 1)])
  end
  if total >= capacity then
    redis.call('HDEL', KEYS[K_messages], tag)
    return {0, depth, 1}
  end
end
-- end
local now = tonumber(ARGV[A_enqueued_ms]) or gt_now_ms()
local lag = tonumber(ARGV[A_lag_tokens]) or 0
local scheduled = ARGV[A_lane] == 'scheduled' and lag > 0
local seq = redis.call('INCR', KEYS[K_seq])
local entry = tenant .. '|' .. (scheduled and 's' or '') .. string.format('%016x', seq) .. '|' .. tag
              .. '|' .. ARGV[A_est_tokens] .. '|' .. now .. '|' .. ARGV[A_weight]
if ARGV[A_message_b] and ARGV[A_message_b] ~= '' then entry = entry .. '|' .. ARGV[A_message_b] end
redis.call('ZADD', KEYS[K_index], '0', entry)
local score = tonumber(redis.call('ZSCORE', KEYS[K_active], tenant))
if score then
  if not scheduled and gt_lane_carries_lag(score) then   -- its head was scheduled: this task is its head now
    redis.call('ZADD', KEYS[K_active], gt_lane_move(score, false, lag), tenant)
  end
elseif redis.call('HEXISTS', KEYS[K_parked], tenant) == 0 then
  gt_activate(KEYS[K_active], KEYS[K_finish], KEYS[K_parked], KEYS[K_inflight], KEYS[K_fair], tier, tenant,
              tonumber(ARGV[A_tenant_max_inflight]), scheduled, lag)
end
gt_ring(KEYS[K_bell], ARGV[A_bell_max])
-- at most one token: nobody waits on it most of the time, and stale tokens would each cost a
-- dispatcher that starts waiting on it an empty pick
-- a reserved tier's interactive arrival also marks when reserved work was last seen on the pool:
-- pick.lua holds the pool's reserve back from other tiers only for Pool.reserve_hold_s after it
if ARGV[A_reserved] == '1' and not scheduled then
  gt_ring(KEYS[K_reserved_bell], 1)
  redis.call('HSET', KEYS[K_fair], 'rsv_ms', now)
end
local ref = KEYS[K_task_ref]
if ref then
  redis.call('SET', ref, ARGV[A_ref_pool] .. '|' .. tier .. '|' .. tenant .. '|' .. tag .. '|' .. entry,
             'PX', ARGV[A_ref_ttl_ms])
end
local channel = ARGV[A_event_channel]
if channel and channel ~= '' then
  redis.call('PUBLISH', channel, ARGV[A_event])
end
return {1, now, depth + 1, entry}   -- the entry: cancel finds the task by it
