-- overload/defer_hold.lua: hold a deferred task -- accepted, not queued -- until its release.
-- The task's held record is the one a task waiting on its depends_on has (Keys.held: how to
-- send it, as lua/lifecycle/depend.lua keeps it), with when and why it was deferred.  Written
-- first, in the task's slot; the caller then adds its id to its pool's deferred set of its
-- tier (Keys.deferred, in the pool's slot), scored by when it is released at the latest
-- (gateway_tasks/overload/deferral.py releases it then, or sooner when the level falls).
--
-- KEYS[1] held: the task's held record (hash: send, deferred_until_ms, tier, reason, level)
-- ARGV[1] send: how to send it (JSON)   ARGV[2] until_ms: released by then
-- ARGV[3] tier   ARGV[4] reason: the reason code   ARGV[5] level: the load level that deferred it
-- ARGV[6] ttl_ms: the held record's TTL (past its release time)
--
-- Returns 1.

redis.call('HSET', KEYS[K_held], 'send', ARGV[A_send], 'deferred_until_ms', ARGV[A_until_ms],
           'tier', ARGV[A_tier], 'reason', ARGV[A_reason], 'level', ARGV[A_level])
redis.call('PEXPIRE', KEYS[K_held], ARGV[A_ttl_ms])
return 1
