-- lifecycle/deps_join.lua: a held task joins the waiters of one of its dependencies, in the
-- dependency's slot -- unless the dependency has finished (its done mark is set): then its
-- outcome is returned and the dependent's submit counts it down itself
-- (lua/lifecycle/deps_release.lua).  Atomic with lua/lifecycle/deps_done.lua, which sets the mark
-- in the same slot: each (dependency, dependent) pair is counted down once, by the
-- dependency's end or by the dependent's submit.
--
-- KEYS[1] done: the dependency's done mark (string)   KEYS[2] waiters: its waiters (set)
-- ARGV[1] dependent: the held task's id   ARGV[2] ttl_ms: the waiters set's TTL
--
-- Returns '' (joined: the dependency's end releases it) or the done mark ('ok' | 'failed').

local mark = redis.call('GET', KEYS[K_done])
if mark then return mark end
redis.call('SADD', KEYS[K_waiters], ARGV[A_dependent])
redis.call('PEXPIRE', KEYS[K_waiters], ARGV[A_ttl_ms])
return ''
