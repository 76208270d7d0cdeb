"""Development tooling, kept out of the runtime wheel: the `gateway-dev` command
(``cli``: the demo, the benchmarks, the chaos suite), local child processes
(``processes``, ``api_thread``, ``env_deployment``), the Redis of a dev run and its
cleanup (``run_redis``), a throw-away Redis Cluster for tests (``redis_cluster``),
lifted quotas (``quotas``) and shared statistics (``measure``).

It is its own distribution, gateway-tasks-devtools (``devtools/pyproject.toml``),
which `make install` installs editable next to gateway-tasks.  It uses the runtime
freely; nothing in the runtime (gateway_tasks, workers, beat) imports it."""
