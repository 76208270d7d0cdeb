"""`gateway-dev bench-demand`: what counting the demand history costs an enqueue.

Every enqueue counts its request and estimated tokens in the demand history
(lua/dispatch/enqueue.lua, ``Keys.demand``).  This bench enqueues the same tasks
with the count on and off (``EnqueueCall.count_demand``), in alternating rounds
on one Redis, and prints each variant's time per enqueue as median, min and max
over the rounds, and the ratio of the medians against the target (at most
``TARGET_RATIO``): the count must not be a cost of its own on the hot path.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from dataclasses import replace
from typing import Any

import redis

from devtools.measure import spread
from devtools.run_redis import delete_prefix, redis_or_embedded, shown_redis
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Settings
from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue

TARGET_RATIO = 1.10             # counting adds at most 10% to an enqueue (median over rounds)
MESSAGE = json.dumps({"body": "x" * 2000})   # a 2 KB message, like a short prompt's envelope


def _round(client: redis.Redis, keys: Keys, settings: Settings, count: bool, n: int) -> float:
    """Microseconds per enqueue of ``n`` fresh tasks."""
    tier = settings.tier("normal")
    calls = [EnqueueCall(keys, tier, settings.pools[0].name, tenant=f"t{i % 50}", tag=uuid.uuid4().hex,
                         est_tokens=100, message_json=MESSAGE, count_demand=count) for i in range(n)]
    start = time.perf_counter()
    for call in calls:
        enqueue(client, replace(call, now_s=time.time()))
    return (time.perf_counter() - start) / n * 1e6


def run(url: str, rounds: int, per_round: int) -> dict[str, Any]:
    settings = Settings(redis_url=url, key_prefix=f"gt-bench-demand-{uuid.uuid4().hex[:8]}:")
    keys = Keys(settings.key_prefix)
    client = redis.Redis.from_url(url)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        _round(client, keys, settings, True, min(per_round, 200))      # warm-up: scripts loaded
        for _ in range(rounds):
            for count in (False, True):
                times[count].append(_round(client, keys, settings, count, per_round))
    finally:
        delete_prefix(client, settings.key_prefix)
        client.close()
    with_count, without = spread(times[True]), spread(times[False])
    ratio = with_count["median"] / without["median"]
    return {"us_per_enqueue": {"with_count": with_count, "without": without},
            "ratio_of_medians": round(ratio, 3), "target_ratio_at_most": TARGET_RATIO,
            "ok": ratio <= TARGET_RATIO, "rounds": rounds, "enqueues_per_round": per_round}


def _cmd(args: argparse.Namespace) -> int:
    with redis_or_embedded(os.environ.get("REDIS_URL", "")) as (url, embedded):
        result = run(url, args.rounds, args.per_round)
        result["redis"] = shown_redis(url, embedded)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        t = result["us_per_enqueue"]
        for name in ("without", "with_count"):
            s = t[name]
            print(f"{name:<10} {s['median']:>8.0f} us/enqueue median  (min {s['min']:.0f}, max {s['max']:.0f}, "
                  f"{s['runs']} rounds)")
        verdict = "ok" if result["ok"] else "MISSED"
        print(f"ratio of medians {result['ratio_of_medians']:.3f} (target <= {TARGET_RATIO}): {verdict}")
    return 0 if result["ok"] or not args.check else 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench-demand", help="what counting the demand history costs an enqueue",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds per variant (default %(default)s)")
    parser.add_argument("--per-round", type=int, default=1000, help="enqueues per round (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 when the target is missed")
    parser.set_defaults(func=_cmd)
