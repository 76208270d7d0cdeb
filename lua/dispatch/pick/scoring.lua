-- dispatch/pick/scoring.lua (part of pick.lua): the policies' scores and the queue to dispatch from.

-- Score bands: a candidate's score is its band plus its place in the band, and larger wins.
-- Every band is above any score of the bands under it (a place in a band is a wait in ms,
-- or -enqueued ms, far below 1e15).
local BAND_STALE = 3e18       -- past its queue TTL: out of the way at once, no tokens
local BAND_INHERITED = 2e18   -- inherited priority: before any promotion
local BAND_PROMOTED = 1e18    -- wfq: past its tier's max wait, oldest promoted first
local STRICT_WEIGHT_BAND = 1e15   -- strict: each unit of tier weight a band, oldest first in it
-- wfq, in fair order: a smaller start tag wins (per weighted token of virtual time), ties go
-- to the heavier tier, then to the older message
local WFQ_TAG_SCALE, WFQ_AGE_SCALE = 1e6, 1e-13

-- the policy's score of a candidate that is neither stale nor inherited (wait: its wait in ms)
local policy_score
if policy == 'fifo' then
  policy_score = function(qd, c) return -c.enq end
elseif policy == 'strict' then
  policy_score = function(qd, c) return qd.weight * STRICT_WEIGHT_BAND - c.enq end
elseif policy == 'aging' then
  -- weight + alpha x wait, the bonus capped when the preset caps it (gateway_tasks/dispatch/priority.py)
  policy_score = function(qd, c, wait)
    local bonus = qd.alpha * math.max(0, wait)
    if qd.aging_cap >= 0 and bonus > qd.aging_cap then bonus = qd.aging_cap end
    return qd.weight + bonus
  end
else   -- wfq (qd.start: set by score)
  policy_score = function(qd, c, wait, pool)
    -- promoted (past the tier's max wait) beats fair order, oldest promoted first --
    -- but only while its tier is not ahead of virtual time (start tag == V): when
    -- every tier is backlogged all heads are past their max wait, and an
    -- unconditional promotion would hand the tier with the shortest max wait
    -- (vip, 2 s) the whole pool instead of its share
    if wait > qd.max_wait and qd.start <= pool.v then return BAND_PROMOTED + wait end
    return -(qd.start - pool.v) * WFQ_TAG_SCALE + qd.weight - c.enq * WFQ_AGE_SCALE
  end
end

-- the score of a queue's candidate: larger wins
local function score(qd, pool)
  local c = qd.c
  local wait = now - c.enq
  if wfq then qd.start = math.max(pool.v, qd.f) end   -- (read by choose's bypass)
  if c.stale then return BAND_STALE + wait end
  if c.boost then return BAND_INHERITED + wait end
  return policy_score(qd, c, wait, pool)
end

-- Deadline boost across tiers (gateway_tasks/dispatch/priority.py): a deadline-urgent candidate
-- (pick/lifecycle) competes at its urgent band, the others at their tier's band, lower first,
-- the older first in one band.  Whether urgent candidate u goes before the policy's winner w
-- (a stale or inherited winner keeps its place: those bands go first)
local function lifted_before(u, w)
  if w.c.stale or w.c.boost then return false end
  local wp = w.prio
  if w.c.urgent and w.urgent_prio >= 0 then wp = w.urgent_prio end
  return u.urgent_prio < wp or (u.urgent_prio == wp and u.c.enq < w.c.enq)
end

-- the queue of a pool whose urgent candidate goes before its policy's winner win (else win);
-- such a dispatch is charged to its own tier and leaves the pool's virtual time alone, takes
-- no reserve unless its tier may, and needs one of the dispatcher's general slots (choose)
local function lift(p, win)
  local best = nil
  for q = 1, Q do
    local qd = queues[q]
    if q ~= win and qd.pool == p and qd.c and qd.c.urgent and not qd.c.stale and qd.urgent_prio >= 0
       and lifted_before(qd, queues[win])
       and (best == nil or lifted_before(qd, queues[best])) then
      best = q
    end
  end
  if best then queues[best].c.lifted = true return best end
  return win
end

-- the queue to dispatch from now (nil, wait_ms when none is admissible)
local function choose()
  local best, best_score, wait_ms = nil, nil, nil
  for q = 1, Q do
    queues[q].bypass = nil
    if queues[q].c then queues[q].c.lifted = nil end
  end
  for p = 1, P do
    local pool = pools[p]
    pool.waits = nil
    local win, win_score = nil, nil
    for q = 1, Q do
      local qd = queues[q]
      if qd.pool == p and qd.c then
        qd.score = score(qd, pool)
        if win == nil or qd.score > win_score then win, win_score = q, qd.score end
      end
    end
    if win then
      win = lift(p, win)
      win_score = queues[win].score
      local w = admit_wait(queues[win], pool)
      -- the winner needs one of the dispatcher's general slots and only slots kept for
      -- reserved interactive work are free (general_picks spent)
      local needs_slot = general_left == 0 and not may_use_reserve(queues[win])
      if (needs_slot or (w > 0 and wfq)) and not may_use_reserve(queues[win]) then
        -- the winner waits (for tokens: its own plus the reserve; or for a general slot): a
        -- reserved tier's interactive work that fits now goes around it, as long as it is
        -- within its reservation (at most `reserve` tokens ahead of its fair share; under
        -- wfq).  v does not move for such a dispatch, so the waiting winner keeps its place.
        local alt = nil
        for q = 1, Q do
          local qd = queues[q]
          if qd.pool == p and qd.c and may_use_reserve(qd)
             and (not wfq or (qd.start - pool.v) * qd.share <= pool.reserve)
             and admit_wait(qd, pool) == 0
             and (alt == nil or qd.score > queues[alt].score) then
            alt = q
          end
        end
        if alt then
          queues[alt].bypass = true
          win, win_score, w, needs_slot = alt, queues[alt].score, 0, false
        end
      end
      if needs_slot then
        slot_limited = true   -- it waits for a general slot of this dispatcher (or another's)
      elseif w == 0 then
        if best == nil or win_score > best_score then best, best_score = win, win_score end
      else
        pool.waits = w   -- its winner waits for its bucket (tokens, requests, a drain)
        if wait_ms == nil or w < wait_ms then wait_ms = w end
      end
    end
  end
  return best, wait_ms
end
