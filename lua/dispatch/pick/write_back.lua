-- dispatch/pick/write_back.lua (part of pick.lua): what the dispatches changed, written once per
-- state hash -- buckets, fair states and empty flags; and, when the call ends with a pool's
-- winner waiting for its bucket, until when a dispatcher waits for it: token refunds ring
-- the pool's bell only until then (lua/bucket/settle.lua) -- a refund nobody waits for would wake
-- an idle dispatcher for an empty pick
for p = 1, P do
  local pool = pools[p]
  local fields = empty_flags(p, {})
  if stopped and pool.waits and now + pool.waits > pool.wait_until then
    fields[#fields + 1], fields[#fields + 2] = 'wait_until_ms', now + pool.waits
  end
  if pool.touched then
    local n = #fields
    fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4], fields[n + 5] =
      'tokens', pool.tokens, 'requests', pool.requests, 'ts_ms'
    fields[n + 6], fields[n + 7], fields[n + 8], fields[n + 9], fields[n + 10] =
      now_s, 'debited_tokens', pool.debited, 'dispatches', pool.dispatches
    if wfq then fields[#fields + 1], fields[#fields + 2] = 'v', pool.v end
    for q = 1, Q do
      local qd = queues[q]
      if qd.pool == p and qd.taken and qd.taken > 0 then
        if wfq then fields[#fields + 1], fields[#fields + 2] = 'f:' .. qd.tier, qd.f end
        -- (tv stays unset when only out-of-fair-order tasks were taken)
        if qd.tv then fields[#fields + 1], fields[#fields + 2] = 'tv:' .. qd.tier, qd.tv end
        if qd.n_dirty then fields[#fields + 1], fields[#fields + 2] = 'n:' .. qd.tier, qd.n end
      end
    end
  end
  if #fields > 0 then redis.call('HSET', pool.state, unpack(fields)) end   -- one write
end

-- the inheritance and deadline lines that changed
for q = 1, Q do
  local qd = queues[q]
  local state = KEYS[K_per_pool * (qd.pool - 1) + K_pool_state]
  if qd.boosts_dirty then
    if qd.boosts == '' then redis.call('HDEL', state, 'b:' .. qd.tier)
    else redis.call('HSET', state, 'b:' .. qd.tier, qd.boosts) end
  end
  if qd.urgent_dirty then
    if qd.urgent_lines == '' then redis.call('HDEL', state, 'd:' .. qd.tier, 'dn:' .. qd.tier)
    else redis.call('HSET', state, 'd:' .. qd.tier, qd.urgent_lines, 'dn:' .. qd.tier, qd.urgent_at) end
  end
end
