-- dispatch/pick/candidates.lua (part of pick.lua): a queue's next candidate by tenant fair queuing.

-- a queue's candidate: the oldest task of the active tenant first in line, with
-- its real start tag and its place among equal tags (c.tie; false: none) -- first in line by lane: a scheduled head's score
-- carries the tier's lag.  A tenant in the active set is under its cap (it
-- is parked when it reaches it) and has queued work (it leaves when it has none).
-- The head is read with the tenant's next entry (c.nxt; false: none), which the
-- dispatch puts in line without a second read.  (known_tenant, known_head, known_next:
-- a tenant whose head entry -- and next, or nil -- the caller just read)
--
-- A tier whose active set was found empty is flagged ('e:<tier>' in the state hash: until
-- when; written back by pick/write_back) and not read again until a tenant joins it
-- (gt_activate, the one way into an empty active set, clears the flag) or EMPTY_RECHECK_MS
-- passes: an idle tier costs a pick no command.
local function candidate(qd, known_tenant, known_head, known_next)
  local boosted = boosted_candidate(qd)
  if boosted then return mark_stale(qd, boosted) end
  if qd.empty then return false end
  for _ = 1, MAX_ROUNDS do
    local top = redis.call('ZRANGE', qd.active, '0', '0', 'WITHSCORES')
    local tenant = top[1]
    if not tenant then
      qd.empty = true
      return false
    end
    local entry, nxt
    if tenant == known_tenant then
      entry, nxt = known_head, known_next
    else
      local heads = gt_tenant_heads(qd.index, tenant, 2)
      entry, nxt = heads[1], heads[2] or false
    end
    known_tenant = nil
    if entry then
      local _, _, tag, est, enq, w, size = string.find(entry, ENTRY)
      local score = tonumber(top[2])
      return mark_stale(qd, {entry = entry, nxt = nxt, tenant = tenant, tie = score - math.floor(score),
              start = gt_lane_start(score, qd.lag), tag = tag, est = tonumber(est) or 0,
              enq = tonumber(enq) or now, w = w, size = tonumber(size)})
    end
    redis.call('ZREM', qd.active, tenant)   -- no queued work left (defensive)
  end
  return false
end
