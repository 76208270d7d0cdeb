"""The shared core: settings, Redis key names, stats field names, errors, token
estimates, the tenant registry, the Lua script loader, the enqueue call and the
producer-side broker transport, and the Celery app.  It imports nothing from the producer, the interfaces, the
workers, beat or the dev tools."""
