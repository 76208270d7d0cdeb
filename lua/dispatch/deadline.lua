-- dispatch/deadline.lua: deadline boost -- a queued task close to its deadline is promoted inside
-- its tier.  Records, in its pool's fair hash, when the task becomes urgent: field
-- 'd:<tier>' holds '<urgent from ms>><entry>' lines sorted by time, field 'dn:<tier>' the
-- first line's time, so lua/dispatch/pick.lua reads the lines only once one is due; it dispatches
-- a due task ahead of its tier's fair order and drops lines whose task is no longer queued.
--
-- KEYS[1] fair: the pool's fair hash
-- ARGV[1] tier: the task's tier   ARGV[2] urgent_from_ms: when it becomes urgent (Redis clock)
-- ARGV[3] entry: its index entry
-- ARGV[4] max_lines: most lines kept per tier (past it, the latest-due are not recorded)
--
-- Returns 1 recorded, 0 not (the tier has as many lines as it keeps).

local field, first = 'd:' .. ARGV[A_tier], 'dn:' .. ARGV[A_tier]
local at = math.floor(tonumber(ARGV[A_urgent_from_ms]))   -- whole ms: the lines parse back as integers
local lines = {}
for l in string.gmatch(redis.call('HGET', KEYS[K_fair], field) or '', '[^\n]+') do lines[#lines + 1] = l end
if #lines >= tonumber(ARGV[A_max_lines]) then return 0 end
local pos = #lines + 1
for i, l in ipairs(lines) do
  if (tonumber(string.match(l, '^(%d+)>')) or 0) > at then pos = i break end
end
table.insert(lines, pos, at .. '>' .. ARGV[A_entry])
redis.call('HSET', KEYS[K_fair], field, table.concat(lines, '\n'), first, string.match(lines[1], '^(%d+)>') or at)
return 1
