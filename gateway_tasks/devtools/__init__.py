"""Development tooling: the OpenAI-compatible upstream simulator, ``make demo``,
the benchmarks, local child processes (``processes``), free ports (``ports``),
the embedded Redis (``redis_server``), a throw-away Redis Cluster for tests
(``redis_cluster``) and shared statistics (``measure``).
Nothing in the runtime (core, producer, interfaces, workers, beat) imports
this package."""
