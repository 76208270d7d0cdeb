-- overload/commit.lua: commit one load-level decision for the whole deployment.
-- Every worker's controller computes the decision (gateway_tasks/overload/levels.py)
-- from the state it read; the first to commit a given version wins, the others are
-- refused and read again next tick, so there is one level and one history.
--
-- KEYS[1] state: hash (level, version, ts_ms, since_ms, reason, signals, seen:<k>, changes)
-- KEYS[2] history: list (JSON level changes, newest first)
-- KEYS[3] samples: list (JSON counter samples, newest first)
-- KEYS[4] held: hash (tenant -> JSON {level, until_ms, reason}: the tenants held at the level
--         they cause, gateway_tasks/overload/attribution.py), replaced whole by each decision
-- ARGV[1] version: the state version the decision was computed from (compare-and-set)
-- ARGV[2] min_spacing_ms: least ms between two decisions (one decided more recently: refused)
-- ARGV[3] now_ms: the decision's time (Redis TIME, read by the worker; also the sample's)
-- ARGV[4] level: the new level   ARGV[5] reason: its reason   ARGV[6] signals (JSON)
-- ARGV[7] sample: the counter sample (JSON)   ARGV[8] samples_kept
-- ARGV[9] history_kept: history entries kept
-- ARGV[10] held_entries: JSON object tenant -> its held entry (JSON text); {} = nobody held
-- ARGV[11] L: levels
-- ARGV[..] per level_k (L): seen
--   seen:<k> for k = 1..L ('' = never)
--
-- Returns {1, new version, changed (1/0), old level}  committed,
--         {0, current version}                          refused.

local version = tonumber(redis.call('HGET', KEYS[K_state], 'version')) or 0
if tostring(version) ~= ARGV[A_version] then return {0, version} end
local now = tonumber(ARGV[A_now_ms])
local last = tonumber(redis.call('HGET', KEYS[K_state], 'ts_ms')) or 0
if last > 0 and now - last < tonumber(ARGV[A_min_spacing_ms]) then return {0, version} end

local old = tonumber(redis.call('HGET', KEYS[K_state], 'level')) or 0
local new = tonumber(ARGV[A_level])
version = version + 1
redis.call('HSET', KEYS[K_state], 'version', version, 'ts_ms', now, 'level', new,
           'reason', ARGV[A_reason], 'signals', ARGV[A_signals])
for k = 1, N_level_k do
  redis.call('HSET', KEYS[K_state], 'seen:' .. k, ARGV[A_level_k_seen + A_per_level_k * (k - 1)])
end
local changed = 0
if new ~= old or redis.call('HEXISTS', KEYS[K_state], 'since_ms') == 0 then
  redis.call('HSET', KEYS[K_state], 'since_ms', now)
end
if new ~= old then
  changed = 1
  redis.call('HINCRBY', KEYS[K_state], 'changes', 1)
  redis.call('LPUSH', KEYS[K_history], cjson.encode({ts_ms = now, from = old, to = new, reason = ARGV[A_reason]}))
  redis.call('LTRIM', KEYS[K_history], 0, tonumber(ARGV[A_history_kept]) - 1)
end
redis.call('DEL', KEYS[K_held])
for tenant, entry in pairs(cjson.decode(ARGV[A_held_entries])) do
  redis.call('HSET', KEYS[K_held], tenant, entry)
end
redis.call('LPUSH', KEYS[K_samples], ARGV[A_sample])
redis.call('LTRIM', KEYS[K_samples], 0, tonumber(ARGV[A_samples_kept]) - 1)
return {1, version, changed, old}
