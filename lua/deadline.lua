-- deadline.lua: deadline boost -- a queued task close to its deadline is promoted inside
-- its tier.  Records, in its pool's fair hash, when the task becomes urgent: field
-- 'd:<tier>' holds '<urgent from ms>><entry>' lines sorted by time, field 'dn:<tier>' the
-- first line's time, so lua/pick.lua reads the lines only once one is due; it dispatches
-- a due task ahead of its tier's fair order and drops lines whose task is no longer queued.
--
-- KEYS[1] the pool's fair hash
-- ARGV[1] the task's tier   ARGV[2] when it becomes urgent (ms, Redis clock)   ARGV[3] its entry
-- ARGV[4] most lines kept per tier (past it, the latest-due are not recorded)
--
-- Returns 1 recorded, 0 not (the tier has as many lines as it keeps).

local field, first = 'd:' .. ARGV[1], 'dn:' .. ARGV[1]
local at = math.floor(tonumber(ARGV[2]))   -- whole ms: the lines parse back as integers
local lines = {}
for l in string.gmatch(redis.call('HGET', KEYS[1], field) or '', '[^\n]+') do lines[#lines + 1] = l end
if #lines >= tonumber(ARGV[4]) then return 0 end
local pos = #lines + 1
for i, l in ipairs(lines) do
  if (tonumber(string.match(l, '^(%d+)>')) or 0) > at then pos = i break end
end
table.insert(lines, pos, at .. '>' .. ARGV[3])
redis.call('HSET', KEYS[1], field, table.concat(lines, '\n'), first, string.match(lines[1], '^(%d+)>') or at)
return 1
