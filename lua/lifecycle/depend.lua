-- lifecycle/depend.lua: hold a task until the tasks it depends on have finished -- the first of
-- its submit's single-slot steps (gateway_tasks/lifecycle/depends.py ``hold``): its held record,
-- pending one per dependency plus one, the guard.  Each dependency is then registered in its
-- own slot (lua/lifecycle/deps_join.lua); the guard is counted down last
-- (lua/lifecycle/deps_release.lua with the task's own id), so nothing releases the task before
-- every dependency is registered, and a submit cut short leaves a record nobody releases
-- (it expires).
--
-- KEYS[1] held: the dependent's held record (hash: pending, send, failed, tier, deps, c:<id>)
-- ARGV[1] send: how to send it (JSON)   ARGV[2] ttl_ms
-- ARGV[3] tier: the tier the dependent waits at (its effective tier; read by
--   gateway_tasks/lifecycle/inherit.py, which lends it down the chain)
-- ARGV[4] deps...: the ids of its dependencies
--
-- Returns the pending count (its dependencies and the guard).

local deps = {unpack(ARGV, A_deps)}
redis.call('DEL', KEYS[K_held])
redis.call('HSET', KEYS[K_held], 'pending', #deps + 1, 'send', ARGV[A_send], 'tier', ARGV[A_tier],
           'deps', table.concat(deps, '\n'))
redis.call('PEXPIRE', KEYS[K_held], ARGV[A_ttl_ms])
return #deps + 1
