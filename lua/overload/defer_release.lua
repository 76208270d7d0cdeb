-- overload/defer_release.lua: release held deferred tasks, each exactly once: its id leaves its
-- tier's deferred set and its held record goes, and how to send it is returned (the caller
-- sends it on its queue).  A cancelled task (its record dropped) leaves the set and is skipped.
--
-- KEYS[1] deferred: the tier's deferred set (zset: task id -> deferred_until_ms)
-- KEYS[..] per candidate (C): held
--   each candidate's held record (hash: send, ...)
-- ARGV[1] C
-- ARGV[..] per candidate (C): id
--   each candidate's task id (read from the set by the caller: due, or all when the level fell)
--
-- Returns {id1, send1, id2, send2, ...} of the tasks released by this call.

local out = {}
for c = 1, N_candidate do
  local id = ARGV[A_per_candidate * (c - 1) + A_candidate_id]
  local held = KEYS[K_per_candidate * (c - 1) + K_candidate_held]
  if redis.call('ZREM', KEYS[K_deferred], id) == 1 then
    local send = redis.call('HGET', held, 'send')
    if send and redis.call('HEXISTS', held, 'deferred_until_ms') == 1 then
      redis.call('DEL', held)
      out[#out + 1] = id
      out[#out + 1] = send
    end
  end
end
return out
