-- overload_commit.lua: commit one load-level decision for the whole deployment.
-- Every worker's controller computes the decision (gateway_tasks/core/overload_levels.py)
-- from the state it read; the first to commit a given version wins, the others are
-- refused and read again next tick, so there is one level and one history.
--
-- KEYS[1] state hash (level, version, ts_ms, since_ms, reason, signals, seen:<k>, changes)
-- KEYS[2] history list (JSON level changes, newest first)
-- KEYS[3] samples list (JSON counter samples, newest first)
-- ARGV[1] the state version the decision was computed from (compare-and-set)
-- ARGV[2] least ms between two decisions (one decided more recently: refused)
-- ARGV[3] the decision's time, ms (Redis TIME, read by the worker; also the sample's)
-- ARGV[4] the new level   ARGV[5] its reason   ARGV[6] the signals (JSON)
-- ARGV[7] the counter sample (JSON)   ARGV[8] samples kept   ARGV[9] history entries kept
-- ARGV[10] L (levels)   ARGV[11 .. 10+L] seen:<k> for k = 1..L ('' = never)
--
-- Returns {1, new version, changed (1/0), old level}  committed,
--         {0, current version}                          refused.

local version = tonumber(redis.call('HGET', KEYS[1], 'version')) or 0
if tostring(version) ~= ARGV[1] then return {0, version} end
local now = tonumber(ARGV[3])
local last = tonumber(redis.call('HGET', KEYS[1], 'ts_ms')) or 0
if last > 0 and now - last < tonumber(ARGV[2]) then return {0, version} end

local old = tonumber(redis.call('HGET', KEYS[1], 'level')) or 0
local new = tonumber(ARGV[4])
version = version + 1
redis.call('HSET', KEYS[1], 'version', version, 'ts_ms', now, 'level', new,
           'reason', ARGV[5], 'signals', ARGV[6])
local L = tonumber(ARGV[10])
for k = 1, L do
  redis.call('HSET', KEYS[1], 'seen:' .. k, ARGV[10 + k])
end
local changed = 0
if new ~= old or redis.call('HEXISTS', KEYS[1], 'since_ms') == 0 then
  redis.call('HSET', KEYS[1], 'since_ms', now)
end
if new ~= old then
  changed = 1
  redis.call('HINCRBY', KEYS[1], 'changes', 1)
  redis.call('LPUSH', KEYS[2], cjson.encode({ts_ms = now, from = old, to = new, reason = ARGV[5]}))
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[9]) - 1)
end
redis.call('LPUSH', KEYS[3], ARGV[7])
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[8]) - 1)
return {1, version, changed, old}
