"""The foundation every feature uses: settings, Redis key names, errors, the Lua script
loader, the Celery app and its result backend, token estimates, stats field names, the Redis
clock, Redis failures.  It imports nothing from the features, the producer, the interfaces,
the workers, beat or the dev tools."""
