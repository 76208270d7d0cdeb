"""Tenant crons: a Celery beat scheduler storing per-tenant cron entries in Redis.

* ``beat.api``: register_cron / list_crons / delete_cron (Python API);
* ``beat.cli``: ``gateway cron add|list|delete``;
* ``beat.scheduler.TenantCronScheduler``: ``celery beat --scheduler
  beat.scheduler:TenantCronScheduler`` -- several replicas, one active;
* ``beat.engine.CronEngine``: the same loop without Celery (tests, ``gateway-dev cron-bench``);
* ``beat.jitter`` / ``beat.schedule``: pure jitter and cron-time maths;
* ``beat.store``: the Redis layout; ``beat.lock``: the leader lock (and its script calls);
* ``beat.cron_calls``: typed calls of cron_fire.lua, cron_admitted.lua, cron_resync.lua, cron_record.lua;
"""
