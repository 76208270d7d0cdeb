"""Development tooling: the OpenAI-compatible upstream simulator, ``make demo``,
the benchmarks, local child processes (``processes``), free ports (``ports``),
the embedded Redis (``redis_server``) and shared statistics (``measure``).
Nothing in the runtime (core, producer, interfaces, workers, beat) imports
this package."""
