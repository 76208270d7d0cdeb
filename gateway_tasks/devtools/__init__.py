"""Development tooling: the OpenAI-compatible upstream simulator, ``make demo``,
the benchmarks, local child processes and the embedded Redis.  Nothing in the
runtime (core, producer, interfaces, workers, beat) imports this package."""
