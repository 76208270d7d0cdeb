-- lifecycle/boost.lua: priority inheritance -- a queued task of a lower tier that a higher tier's
-- held task waits on (depends_on) is to be dispatched at the higher tier's priority.
-- Records it in its pool's fair hash, field 'b:<its tier>': one '<higher tier>><entry>'
-- per line; lua/dispatch/pick.lua dispatches those first (charged to their own tenant and tier)
-- and drops lines whose task is no longer queued.
--
-- KEYS[1] fair: the pool's fair hash
-- ARGV[1] tier: the boosted task's tier   ARGV[2] inherits: the tier it inherits
-- ARGV[3] entry: its index entry
-- ARGV[4] max_boosts: most boosts kept per tier (the oldest go first when there are more)
--
-- Returns the number of boosts now recorded for the tier.

local field = 'b:' .. ARGV[A_tier]
local line = ARGV[A_inherits] .. '>' .. ARGV[A_entry]
local kept = {}
for l in string.gmatch(redis.call('HGET', KEYS[K_fair], field) or '', '[^\n]+') do
  if l ~= line then kept[#kept + 1] = l end
end
kept[#kept + 1] = line
local max = tonumber(ARGV[A_max_boosts])
while #kept > max do table.remove(kept, 1) end
redis.call('HSET', KEYS[K_fair], field, table.concat(kept, '\n'))
return #kept
