"""`gateway-dev chaos`: the fault suite.

Each fault runs against real processes started for it (``deployment``): a
private Redis with AOF everysec, Celery workers, beat replicas, the upstream
simulator and the REST API.  Every fault module (``worker_kill``,
``kill_points``, ``redis_restart``, ``redis_down``, ``upstream_errors``,
``rate_limit_storm``, ``beat_leader``, ``memory``, ``overload``) returns an
``outcome.Outcome``; ``suite`` runs them, ``table`` prints them, ``command``
is the CLI.  Upstream calls are counted per task id at the simulator
(``GET /calls``); the workers' kill -9 points come from ``gateway_tasks.core.faults``.
"""
