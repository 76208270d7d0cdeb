"""A tenant's own usage: counters per clock hour in Redis (``gateway_tasks.usage.counters``)."""
