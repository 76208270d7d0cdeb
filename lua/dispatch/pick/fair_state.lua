-- dispatch/pick/fair_state.lua (part of pick.lua): each pool's state hash, read once.
--
-- each queue's inheritance lines and first deadline-urgent time, with the
-- pool's fair state (virtual time, each tier's finish tag, tenant virtual time and tie
-- counter, its empty flag) and its bucket's fields (used once the pool has a candidate): one HMGET of its state
-- hash per pool.  pool_state[p]: the reply, the pool's fields at STATE_*; qd.field_at: where
-- a queue's own fields start in it.
local STATE_V, STATE_TOKENS, STATE_REQUESTS, STATE_TS_MS, STATE_BLOCKED_UNTIL_MS = 1, 2, 3, 4, 5
local STATE_DEBITED_TOKENS, STATE_DISPATCHES, STATE_WAIT_UNTIL_MS, STATE_RSV_MS = 6, 7, 8, 9
local pool_state = {}
for p = 1, P do
  local fields, mine = {'v', 'tokens', 'requests', 'ts_ms', 'blocked_until_ms', 'debited_tokens', 'dispatches',
                        'wait_until_ms', 'rsv_ms'}, {}
  for q = 1, Q do
    local qd = queues[q]
    if qd.pool == p then
      local n = #fields
      fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4], fields[n + 5], fields[n + 6] =
        'b:' .. qd.tier, 'dn:' .. qd.tier, 'f:' .. qd.tier, 'tv:' .. qd.tier, 'e:' .. qd.tier, 'n:' .. qd.tier
      qd.field_at = n + 1
      mine[#mine + 1] = qd
    end
  end
  if #mine > 0 then
    local got = redis.call('HMGET', KEYS[K_per_pool * (p - 1) + K_pool_state], unpack(fields))
    pool_state[p] = got
    for _, qd in ipairs(mine) do
      local j = qd.field_at
      qd.boosts, qd.urgent_at = got[j] or false, tonumber(got[j + 1])
      qd.f, qd.tv0 = tonumber(got[j + 2]) or 0, tonumber(got[j + 3])
      qd.was_empty = (tonumber(got[j + 4]) or 0) > now
      qd.n = tonumber(got[j + 5]) or 0
      qd.empty = qd.was_empty
    end
  end
end

-- the state hash fields of pool p's tiers whose empty flag changed (candidate), appended;
-- a tier found empty has its bell emptied: its tokens wake nobody for anything now (work
-- that comes rings it again, as an unparked tenant or a task put back do)
local function empty_flags(p, fields)
  for q = 1, Q do
    local qd = queues[q]
    if qd.pool == p and qd.empty ~= qd.was_empty then
      fields[#fields + 1], fields[#fields + 2] = 'e:' .. qd.tier, qd.empty and (now + EMPTY_RECHECK_MS) or 0
      if qd.empty then redis.call('DEL', qd.bell) end
    end
  end
  return fields
end
