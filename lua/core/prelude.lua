-- core/prelude.lua: functions shared by the scripts whose first line is "-- uses: core/prelude".
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
-- returns tokens, requests, blocked_until_ms, and until when a dispatcher waits for the
-- bucket (wait_until_ms, written by pick.lua; 0: unknown).  A bucket never written is full.
local function gt_bucket(key, tcap, trate, rcap, rrate, now_ms)
  local b = redis.call('HMGET', key, 'tokens', 'requests', 'ts_ms', 'blocked_until_ms', 'wait_until_ms')
  local tokens, requests, ts = tonumber(b[1]), tonumber(b[2]), tonumber(b[3])
  if not tokens then tokens, requests, ts = tcap, rcap, now_ms end
  local dt = math.max(0, now_ms - ts)
  return gt_refill(tokens, tcap, trate, dt), gt_refill(requests, rcap, rrate, dt), tonumber(b[4]) or 0,
         tonumber(b[5]) or 0
end

-- A bucket level lowered to what the upstream reported left (x-ratelimit-remaining-*):
-- only ever lowers.  The reply cannot have seen what was dispatched after its task, so the
-- pool's running totals since (now - at the task's dispatch) are taken off the report first.
-- remaining / at_dispatch = -1: not reported / unknown.  totals: HMGET of the bucket's
-- debited_tokens, dispatches.
local function gt_follow_remaining(level, remaining, at_dispatch, total_now)
  if remaining < 0 then return level end
  if at_dispatch >= 0 then remaining = remaining - math.max(0, (tonumber(total_now) or 0) - at_dispatch) end
  if remaining < level then return math.max(0, remaining) end
  return level
end

-- Ring the bell list: one wake-up token, keeping at most max_tokens.
local function gt_ring(bell_key, max_tokens)
  redis.call('LPUSH', bell_key, '1')
  redis.call('LTRIM', bell_key, '0', tonumber(max_tokens) - 1)
end

-- Lanes inside a tier (gateway_tasks/dispatch/lanes.py).  A tenant's score in its tier's
-- active set is 2 * start tag when its head (next task) is interactive, 2 * (start tag +
-- lag) + 1 when it is scheduled: scheduled heads go after interactive tenants by `lag`
-- weighted tokens of virtual time, and the parity of the score's whole part says whether
-- it carried the lag.
--
-- Ties (gateway_tasks/dispatch/lanes.py, "Ties"): start tags are whole weighted tokens and many
-- tenants share one (every newcomer joins at the tier's virtual time), so the score's
-- fraction is the tie-breaker: the order in which tenants took their tags (the tier's
-- counter 'n:<tier>' in the fair hash, one step per tag given), so equal tags go in arrival
-- order, not by tenant id.  GT_TIE_BITS bits of the counter, fewer once the whole part is so
-- large that the sum would not be exact (2^(52 - bits) and up): ties then fall back to
-- the member name, the order stays exact.
local GT_TIE_BITS = 20
local GT_TIE_SPAN = 2 ^ GT_TIE_BITS

-- The tie-breaker of the n-th tag given in a tier, in [0, 1).
local function gt_tie(n)
  return (n % GT_TIE_SPAN) / GT_TIE_SPAN
end

-- A whole number with a tie-breaker as its fraction, kept to the bits that stay exact beside it.
local function gt_with_tie(whole, tie)
  if not tie or tie <= 0 then return whole end
  local bits, room = GT_TIE_BITS, 2 ^ (52 - GT_TIE_BITS)
  while bits > 0 and math.abs(whole) >= room do bits, room = bits - 1, room * 2 end
  if bits == 0 then return whole end
  local span = 2 ^ bits
  return whole + math.floor(tie * span) / span
end

local function gt_lane_score(start, scheduled, lag, tie)
  local base = 2 * start
  if scheduled and lag > 0 then base = 2 * (start + lag) + 1 end
  return gt_with_tie(base, tie)
end

-- Whether a score's head is in the scheduled lane (it carries the lag).
local function gt_lane_carries_lag(score)
  return math.floor(score) % 2 == 1
end

-- A tenant's real start tag, from its score in the active set.
local function gt_lane_start(score, lag)
  local base = math.floor(score)
  if base % 2 == 1 then return (base - 1) / 2 - lag end
  return base / 2
end

-- A tenant's score moved to the other lane, its start tag and its place among ties kept.
local function gt_lane_move(score, scheduled, lag)
  return gt_lane_score(gt_lane_start(score, lag), scheduled, lag, score - math.floor(score))
end

-- Whether a tenant's index entry is in the scheduled lane: its seq starts with 's'.
local function gt_scheduled(entry, tenant)
  return string.byte(entry, #tenant + 2) == 115
end

-- Tenant fair queuing inside a tier: make a tenant with queued work eligible.
-- Under its cap it joins the tier's active set at start tag max(tier virtual
-- time, its last finish tag) -- an idle tenant banks no credit, a busy one keeps
-- its place: at its finish tag, among the tenants there in the order they took the tag
-- (the finish hash keeps the tag's tie-breaker as its fraction); at the virtual time, behind
-- the tenants there now (gt_tie) -- in its head's lane (scheduled: the tier's lag
-- behind); at its cap it is parked until a slot frees.
--
-- The one way into a tier's active set (every other ZADD re-scores a member): it clears
-- the tier's empty flag ('e:<tier>' in the fair hash: until when pick.lua, which found the set
-- empty, does not read it again; 0 = cleared).
local function gt_activate(active_key, finish_key, parked_key, inflight_key, fair_key,
                           tier, tenant, cap, scheduled, lag)
  local n = tonumber(redis.call('HGET', inflight_key, tenant)) or 0
  if cap > 0 and n >= cap then
    redis.call('HSET', parked_key, tenant, tier)
    return false
  end
  local fair = redis.call('HMGET', fair_key, 'tv:' .. tier, 'e:' .. tier)
  local v = tonumber(fair[1]) or 0
  local f = tonumber(redis.call('HGET', finish_key, tenant)) or 0
  local start, tie = math.floor(f), f - math.floor(f)
  if start < v or tie <= 0 then
    -- at the virtual time (or a finish tag without its place): behind the tenants there now
    start, tie = math.max(v, start), gt_tie(redis.call('HINCRBY', fair_key, 'n:' .. tier, 1))
  end
  redis.call('ZADD', active_key, gt_lane_score(start, scheduled, lag, tie), tenant)
  if (tonumber(fair[2]) or 0) > 0 then redis.call('HSET', fair_key, 'e:' .. tier, '0') end
  return true
end

-- A tenant's first n index entries (its oldest queued tasks), oldest first.
local function gt_tenant_heads(index_key, tenant, n)
  return redis.call('ZRANGEBYLEX', index_key, '[' .. tenant .. '|', '[' .. tenant .. '|\255',
                    'LIMIT', '0', tostring(n))
end

-- The first index entry of a tenant (its oldest queued task), or nil.
local function gt_tenant_head(index_key, tenant)
  return gt_tenant_heads(index_key, tenant, 1)[1]
end
