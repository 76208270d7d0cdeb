-- dispatch/fair_merge.lua: carry a pool's fair-queuing state from the hash it lived in before
-- 2026-12-05 ('<pool>:fair') into the pool's state hash, where pick.lua now reads it
-- beside the bucket, and delete the old hash.  A worker runs it once per pool it
-- consumes, before its first pick; with no old hash it does nothing.
--
-- KEYS[1] old: the old fair hash   KEYS[2] state: the pool's state hash (bucket + fair state)
-- No ARGV.
--
-- Field by field, against what the state hash may already hold (picks made by
-- upgraded workers since):
--   'v', 'f:<tier>', 'tv:<tier>' virtual times: the larger (they never move back)
--   'b:<tier>' inheritance lines: both sets, each line once
--   'd:<tier>' deadline lines: both sets, each line once, sorted by their urgent time
--   'dn:<tier>' first deadline-urgent time: the earlier
--   any other field: kept where the state hash has it, else copied
-- Returns the number of fields merged (0: there was no old hash).

local old = redis.call('HGETALL', KEYS[K_old])
if #old == 0 then return 0 end

local function union(a, b, by_time)
  local seen, out = {}, {}
  for _, text in ipairs({a or '', b or ''}) do
    for line in string.gmatch(text, '[^\n]+') do
      if not seen[line] then seen[line] = true out[#out + 1] = line end
    end
  end
  if by_time then
    table.sort(out, function(x, y)
      return (tonumber(string.match(x, '^(%d+)>')) or 0) < (tonumber(string.match(y, '^(%d+)>')) or 0)
    end)
  end
  return table.concat(out, '\n')
end

local merged = {}
for i = 1, #old, 2 do
  local field, value = old[i], old[i + 1]
  local now = redis.call('HGET', KEYS[K_state], field)
  local kind = string.match(field, '^(%a+):') or field
  local out = value
  if now then
    if kind == 'v' or kind == 'f' or kind == 'tv' then
      out = (tonumber(now) or 0) >= (tonumber(value) or 0) and now or value
    elseif kind == 'b' or kind == 'd' then
      out = union(now, value, kind == 'd')
    elseif kind == 'dn' then
      out = (tonumber(now) or math.huge) <= (tonumber(value) or math.huge) and now or value
    else
      out = now
    end
  end
  merged[#merged + 1], merged[#merged + 2] = field, out
end
redis.call('HSET', KEYS[K_state], unpack(merged))
redis.call('DEL', KEYS[K_old])
return #merged / 2
