"""`gateway-dev bench-lifecycle`: what the request-lifecycle operations cost Redis, on a
private Redis (INFO commandstats, microseconds of EVALSHA per call), side by side
with the enqueue they sit beside:

* quota_take.lua (every submit), next to enqueue.lua (its MULTI with the message HSET;
  the EVALSHA's own time is what is compared);
* cancel.lua (a queued task, by its recorded entry) at a small and a large backlog
  of its tenant (its cost must not grow with it);
* evict.lua with few and many batch tenants queued (it reads each one's newest
  entry: O(tenants x log n), run only when a pool is full), and with 64 boosted tasks it
  must not evict (priority inheritance) on top of the index;
* depend.lua + deps_done.lua + deps_release.lua, one dependency;
* the round trips one Gateway.submit makes, without and with every lifecycle path.

There are no targets in the issue for these; the bench prints ratios to enqueue.
"""

from __future__ import annotations

import argparse
import json
import uuid
from typing import Any, Callable

import redis

from gateway_tasks.lifecycle.cancel import CancelCall, TaskRef
from gateway_tasks.lifecycle.depends import DependCall, DepsDoneCall, DepsJoinCall, DepsReleaseCall
from gateway_tasks.lifecycle.inherit import BoostCall
from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.dispatch.evict import EvictCall
from gateway_tasks.core.keys import Keys
from gateway_tasks.tenants.quota import QuotaTakeCall
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import load_settings
from devtools.bench import command as bench_command
from devtools.bench.redis_stats import commandstats
from gateway_tasks.local.redis_server import EmbeddedRedis, redis_server_binary

CALLS = 2_000


def evalsha_us(client: redis.Redis, run: Callable[[int], Any], calls: int) -> float:
    """Redis microseconds per EVALSHA over ``calls`` runs of ``run(i)``."""
    before = commandstats(client).get("evalsha")
    for i in range(calls):
        run(i)
    after = commandstats(client)["evalsha"]
    spent = after - before if before else after
    return round(spent.usec / max(1, spent.calls), 2)


def is_cost(name: str) -> bool:
    return name.endswith("_us") or "_us_" in name


def message(tenant: str, tag: str) -> str:
    return json.dumps({"body": "", "headers": {"gt_est_tokens": 100, "gt_tenant": tenant, "id": tag},
                       "properties": {"delivery_tag": tag}})


def run_bench(client: redis.Redis, calls: int) -> dict[str, Any]:
    prefix = f"gt-bench-life-{uuid.uuid4().hex[:8]}:"
    settings = load_settings(env={}, key_prefix=prefix)
    keys, scripts = Keys(prefix), scripts_for(client)
    lifted = settings.with_(tiers=tuple(t.__class__(**{**t.__dict__, "queue_max_len": 10**9}) for t in settings.tiers))
    batch = lifted.tier("batch")

    def put(tenant: str) -> tuple[str, str]:
        tag = uuid.uuid4().hex
        done = enqueue(client, EnqueueCall(keys, batch, "default", tenant, tag, 100, message(tenant, tag)))
        return tag, done.entry

    out: dict[str, Any] = {"calls": calls}
    out["enqueue_us"] = evalsha_us(client, lambda i: put(f"t{i % 50}"), calls)
    out["quota_take_us"] = evalsha_us(client, lambda i: scripts.run(
        QuotaTakeCall(keys, f"q{i % 50}", 0, 10**9, 100, 10**9)), calls)
    for backlog in (10, 10_000):
        tenant = f"deep{backlog}"
        queued = [put(tenant) for _ in range(backlog)]
        victims = queued[:min(calls, backlog)]
        out[f"cancel_us_backlog_{backlog}"] = evalsha_us(client, lambda i: scripts.run(CancelCall(
            keys, f"task{i}", TaskRef("default", "batch", tenant, victims[i][0], victims[i][1]), victims[i][1])), len(victims))
    for tenants in (10, 1_000):
        for i in range(tenants * 3):
            put(f"ev{tenants}-{i % tenants}")
        n = min(calls, tenants)
        out[f"evict_us_tenants_{tenants}"] = evalsha_us(client, lambda i: scripts.run(
            EvictCall(keys, "default", ("batch",))), n)
        client.delete(keys.index("default", "batch"), keys.active("default", "batch"), keys.messages("default"))
    # evict.lua with 64 boosted (protected) tasks -- the newest of 10 tenants among them -- at
    # the top of the index: each candidate read skips them
    protected = [put(f"pr-{i % 10}") for i in range(10 * 3)] + [put(f"pr-{i % 10}") for i in range(64)]
    for _, entry in protected[-64:]:
        scripts.run(BoostCall(keys, "default", "batch", "vip", entry))
    n = min(calls, 10 * 3)
    out["evict_us_protected_64"] = evalsha_us(client, lambda i: scripts.run(
        EvictCall(keys, "default", ("batch",))), n)
    client.delete(keys.index("default", "batch"), keys.active("default", "batch"), keys.messages("default"),
                  keys.fair("default"))
    ids = [uuid.uuid4().hex for _ in range(calls)]
    out["depend_us"] = evalsha_us(client, lambda i: scripts.run(
        DependCall(keys, f"child{i}", (ids[i],), "{}", 60_000)), calls)
    out["deps_join_us"] = evalsha_us(client, lambda i: scripts.run(
        DepsJoinCall(keys, ids[i], f"child{i}", 60_000)), calls)
    out["deps_done_us"] = evalsha_us(client, lambda i: scripts.run(DepsDoneCall(keys, ids[i], "ok", 60_000)), calls)
    out["deps_release_us"] = evalsha_us(client, lambda i: scripts.run(
        DepsReleaseCall(keys, f"child{i}", ids[i], "ok")), calls)
    out["ratios_to_enqueue"] = {k: round(v / out["enqueue_us"], 2) for k, v in out.items()
                                if is_cost(k) and k != "enqueue_us"}
    # Gateway.submit's round trips, counted on its code path: tenant HGETALL + owner SET in one
    # pipeline, the MULTI enqueue (without this work); now + quota EVALSHA + task ref SET
    # (+ EVALSHA deadline.lua with a deadline_s; a held task with depends_on: the pipeline,
    # dependency check, quota, results GETs, depend.lua, the deps_join.lua pipeline, the
    # inheritance walk (held records, refs), the guard's deps_release.lua, + a deps_release.lua
    # pipeline when a dependency had finished, + boost.lua per boost)
    out["submit_round_trips"] = {"before": 2, "now": 4, "with_deadline_s": 5, "with_depends_on": "9+"}
    return out


def format_report(result: dict[str, Any]) -> str:
    lines = [f"gateway-dev bench-lifecycle: Redis microseconds per script call ({result['calls']} calls each)"]
    for k, v in result.items():
        if is_cost(k):
            ratio = result["ratios_to_enqueue"].get(k, 1.0)
            lines.append(f"  {k:<28} {v:>8.2f} us   {ratio:>5.2f}x enqueue")
    r = result["submit_round_trips"]
    lines.append(f"  Gateway.submit round trips (its code path): {r['before']} before, {r['now']} now "
                 f"({r['with_deadline_s']} with deadline_s, {r['with_depends_on']} with depends_on)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    with EmbeddedRedis(binary=redis_server_binary()) as server:
        client = redis.Redis.from_url(server.url)
        result = run_bench(client, args.calls)
    result["all_targets_pass"] = True   # no targets: measurements only
    return bench_command.finish(args, result, format_report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=CALLS, help="calls of each script (default %(default)s)")
    bench_command.add_common_arguments(parser)


def register(subparsers: Any) -> None:
    bench_command.register(subparsers, "bench-lifecycle",
                           "Redis cost of quota, cancel, eviction and dependency scripts", __doc__,
                           add_arguments, run)
