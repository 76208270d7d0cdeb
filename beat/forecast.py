"""Token demand forecast from the cron schedule: beat knows every future fire time.

For the next ``horizon_s`` (default 10 minutes) in ``bucket_s`` bins (default
60 s), per pool and tier: how many cron runs fire and how many tokens they will
ask the pool for (prompt tokens counted like the producer counts them, plus
``max_tokens`` or the default: what the bucket debits on a ``reserve`` pool; an
upper bound on an ``actual`` pool).  Every fire time includes the entry's
jitter offset, and an entry whose period is shorter than the horizon counts
once per run.  Runs already due (a backlog beat is working through) fall in
the first bin.

The leader beat publishes it to Redis (``Keys.cron_forecast``, JSON with a TTL
of a few publish intervals, so a stopped beat leaves no stale forecast); the
metrics exporter turns it into ``gateway_cron_forecast_*`` gauges and
``gateway capacity forecast`` prints it (computed live).

Reading costs O(entries firing within the horizon): the due sorted set is read
up to the horizon's end, never in full.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Iterator

import redis

from gateway_tasks.core.errors import ConfigError, GatewayError
from gateway_tasks.capacity.forecast import Forecast, validate_window
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Settings
from gateway_tasks.core.tokens import count_prompt_tokens

from beat.schedule import actual_ms, next_nominal_ms

DEFAULT_HORIZON_S = 600
DEFAULT_BUCKET_S = 60
READ_CHUNK = 1000
UNROUTABLE = "unroutable"        # a cron whose model no pool serves (its runs will fail)


# -- pure ----------------------------------------------------------------------
def fire_times_ms(cron: str, offset_s: int, pending_nominal_ms: int, start_ms: int,
                  end_ms: int) -> Iterator[int]:
    """Actual fire times of an entry before ``end_ms``, as beat will fire them.

    A pending run already due at ``start_ms`` fires once (it is returned as is:
    it falls in the first bin), then the entry waits for the first nominal time
    whose actual time is after ``start_ms`` -- older missed nominal times are
    never fired (``beat.schedule.plan_fire``).
    """
    offset_ms = offset_s * 1000
    nominal = pending_nominal_ms
    if nominal + offset_ms <= start_ms:
        yield nominal + offset_ms
        nominal = next_nominal_ms(cron, max(nominal, start_ms - offset_ms))
    while actual_ms(nominal, offset_s) < end_ms:
        yield actual_ms(nominal, offset_s)
        nominal = next_nominal_ms(cron, nominal)


@lru_cache(maxsize=65536)
def payload_demand(payload_json: str, default_max_tokens: int) -> tuple[str | None, int]:
    """(model or None, estimated tokens) of one cron payload."""
    payload = json.loads(payload_json) if payload_json else {}
    messages = payload.get("messages") or []
    try:
        prompt = count_prompt_tokens(messages)
    except (GatewayError, AttributeError, TypeError):
        prompt = 0
    return payload.get("model"), prompt + int(payload.get("max_tokens") or default_max_tokens)


# -- Redis -----------------------------------------------------------------------
def _pool_of(settings: Settings, model: str | None) -> str:
    try:
        return settings.pool_for_model(model).name
    except ConfigError:
        return UNROUTABLE


def compute_forecast(client: redis.Redis, settings: Settings, now_ms: int,
                     horizon_s: int = DEFAULT_HORIZON_S, bucket_s: int = DEFAULT_BUCKET_S) -> Forecast:
    """The demand of every cron run firing before now + horizon (read from Redis)."""
    keys = Keys(settings.key_prefix)
    fc = Forecast(now_ms, bucket_s, validate_window(horizon_s, bucket_s), generated_ms=now_ms)
    ids = [m.decode() for m in client.zrangebyscore(keys.cron_due, "-inf", f"({fc.end_ms}")]
    for start in range(0, len(ids), READ_CHUNK):
        chunk = ids[start:start + READ_CHUNK]
        with client.pipeline(transaction=False) as pipe:
            for eid in chunk:
                pipe.hmget(keys.cron(eid), "cron", "jitter_offset_s", "next_nominal_ms", "tier")
                pipe.get(keys.cron_payload(eid))
            replies = pipe.execute()
        for row, payload in zip(replies[0::2], replies[1::2]):
            cron, offset, nominal, tier = (v.decode() if v is not None else None for v in row)
            if cron is None or offset is None or nominal is None:
                continue                                   # deleted meanwhile
            fc.entries_read += 1
            model, tokens = payload_demand(payload.decode() if payload else "",
                                           settings.default_max_tokens)
            pool = _pool_of(settings, model)
            for fire in fire_times_ms(cron, int(offset), int(nominal), fc.start_ms, fc.end_ms):
                fc.add(pool, tier or "", fire, tokens)
    return fc


def publish_forecast(client: redis.Redis, settings: Settings, forecast: Forecast, ttl_s: float) -> None:
    client.set(Keys(settings.key_prefix).cron_forecast, forecast.to_json(), px=max(1, int(ttl_s * 1000)))


def read_published(client: redis.Redis, settings: Settings) -> Forecast | None:
    raw = client.get(Keys(settings.key_prefix).cron_forecast)
    return Forecast.from_json(raw) if raw else None


DEFAULT_PUBLISH_INTERVAL_S = 15.0
TTL_INTERVALS = 4                # a published forecast outlives 4 missed publishes, no more


class ForecastPublisher:
    """Recomputes and publishes the forecast every ``interval_s`` (leader beat only).

    ``maybe_publish`` is called after each tick: it does nothing until the
    interval has passed, and while a tick left due runs behind (``busy``) it
    waits, up to ``TTL_INTERVALS - 1`` intervals, so a storm's fires go first.
    """

    def __init__(self, client: redis.Redis, settings: Settings,
                 interval_s: float = DEFAULT_PUBLISH_INTERVAL_S,
                 horizon_s: int = DEFAULT_HORIZON_S, bucket_s: int = DEFAULT_BUCKET_S):
        if interval_s <= 0:
            raise ConfigError(f"forecast interval_s={interval_s!r} is invalid; expected > 0")
        validate_window(horizon_s, bucket_s)
        self.r = client
        self.settings = settings
        self.interval_s = float(interval_s)
        self.horizon_s = horizon_s
        self.bucket_s = bucket_s
        self.last_ms: int | None = None
        self.last: Forecast | None = None

    def maybe_publish(self, now_ms: int, busy: bool = False) -> Forecast | None:
        if self.last_ms is not None:
            age_ms = now_ms - self.last_ms
            if age_ms < self.interval_s * 1000:
                return None
            if busy and age_ms < (TTL_INTERVALS - 1) * self.interval_s * 1000:
                return None
        fc = compute_forecast(self.r, self.settings, now_ms, self.horizon_s, self.bucket_s)
        publish_forecast(self.r, self.settings, fc, TTL_INTERVALS * self.interval_s)
        self.last_ms, self.last = now_ms, fc
        return fc
