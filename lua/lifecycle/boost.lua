-- lifecycle/boost.lua: priority inheritance -- a queued task of a lower tier that a higher tier's
-- task waits on (depends_on, down a chain of held tasks) or was submitted for (on_behalf_of) is
-- dispatched at the higher tier's priority, or no longer when that waiter is gone.
-- Records it in its pool's fair hash, field 'b:<its tier>': one '<higher tier>><entry>'
-- per line; lua/dispatch/pick.lua dispatches those first (charged to their own tenant and tier)
-- and drops lines whose task is no longer queued; lua/dispatch/evict.lua never evicts them.
--
-- KEYS[1] fair: the pool's fair hash
-- ARGV[1] tier: the boosted task's tier   ARGV[2] inherits: the tier it inherits ('': none
--   any more -- its line goes)
-- ARGV[3] entry: its index entry
-- ARGV[4] max_boosts: most boosts kept per tier (the oldest go first when there are more)
--
-- Returns the number of boosts now recorded for the tier.

local field = 'b:' .. ARGV[A_tier]
local entry = ARGV[A_entry]
local suffix = '>' .. entry
local kept = {}
for l in string.gmatch(redis.call('HGET', KEYS[K_fair], field) or '', '[^\n]+') do
  if string.sub(l, -#suffix) ~= suffix then kept[#kept + 1] = l end
end
if ARGV[A_inherits] ~= '' then kept[#kept + 1] = ARGV[A_inherits] .. suffix end
local max = tonumber(ARGV[A_max_boosts])
while #kept > max do table.remove(kept, 1) end
if #kept == 0 then redis.call('HDEL', KEYS[K_fair], field)
else redis.call('HSET', KEYS[K_fair], field, table.concat(kept, '\n')) end
return #kept
