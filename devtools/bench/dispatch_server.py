"""`gateway-dev bench-dispatch`, part 1: Redis time per pick, server side.

On a private Redis (nobody else's commands), per scenario -- prompt size x
tenants queued -- ``messages`` copies of the real message ``Gateway.submit``
queues for such a prompt are enqueued (lua/dispatch/enqueue.lua, pipelined) on a pool
whose bucket never waits, spread round-robin over the tenants, all in the
``normal`` tier.  Then ``picks`` pick.lua calls (``PickPlan`` of all the
pool's tiers, as a worker runs it, through ``scripts_for(client).run``), in
batches; between batches the picked tasks are acked (lua/dispatch/release.lua).
INFO commandstats is read around every batch, so ``cmdstat_evalsha`` counts
only pick calls in the pick windows and only release calls in the ack
windows: usec / calls is Redis's execution time per pick (and per ack, and
per enqueue during the fill).

Beside it, the same messages through a plain list: LPUSH each, then RPOP
each, timed the same way (``cmdstat_lpush``, ``cmdstat_rpop``).

Before the scenarios, WARMUP_PICKS picks on a throw-away queue are not counted: on a
fresh server the first thousand or so picks cost ~1.5x the later ones (the Lua heap, the
AOF file and Redis's own tables still growing), which no running deployment pays.

The anatomy of a pick: one more batch with the slowlog recording every
command (``redis_stats.recording``), the commands pick.lua ran (client
``?:0``) grouped by name -- calls and microseconds per pick -- and the rest of
the EVALSHA time, the script's own (Lua, KEYS/ARGV set-up, the reply).  The
slowlog's own bookkeeping inflates that batch a little: its shares, not its
total, are the point.

The floor under a pick (``pick_floor``): the commands one pick ran (the second on
a fresh queue: the first reads the idle tiers and flags them), taken from the
slowlog with their arguments, replayed by a script that does nothing else,
and an empty script called with the pick's KEYS and ARGV -- what those commands
cost through Lua's redis.call bridge alone, before any of the pick's own logic.
"""

from __future__ import annotations

import statistics
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import redis

from gateway_tasks.dispatch.enqueue import EnqueueCall, queue_enqueue
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for, source
from gateway_tasks.core.settings import Settings
from devtools.quotas import for_load
from devtools.bench.plain import UNLIMITED
from devtools.bench import redis_stats
from devtools.bench.redis_stats import Cost, commandstats, stats_delta
from devtools.run_redis import discard_prefix
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.dispatch.release import ReleaseCall
from gateway_tasks.dispatch.router import PickPlan, Picked

TIER = "normal"
PIPELINE_CHUNK = 500
PICK_BATCH = 50          # picks between two acks; <= tenants x their concurrency cap
BATCH_PICKS = 8          # tasks a call in the batched measure: a worker of 8 threads with all free
WARMUP_PICKS = 1000      # picks on a fresh server before any is measured (module docstring)
FLOOR_ROUNDS, FLOOR_CALLS = 5, 400
FILLER = "The quick brown fox jumps over the lazy dog while the support queue keeps growing. "
PROMPT_SIZES_B = (600, 8192)


@dataclass(frozen=True)
class Scenario:
    prompt_b: int
    tenants: int
    messages: int     # queued before the picks (>= picks)
    picks: int

    @property
    def name(self) -> str:
        size = f"{self.prompt_b // 1024} KB" if self.prompt_b >= 1024 else f"{self.prompt_b} B"
        return f"{size} prompts, {self.tenants} tenants"


def scenarios(picks: int, many_tenants: int, few_tenants: int = 10) -> list[Scenario]:
    """Both prompt sizes with few tenants, then both with ``many_tenants`` queued
    (one message each, ``picks`` of them picked)."""
    out = [Scenario(b, few_tenants, picks, picks) for b in PROMPT_SIZES_B]
    out += [Scenario(b, many_tenants, max(many_tenants, picks), picks) for b in PROMPT_SIZES_B]
    return out


def prompt_of(size_b: int) -> str:
    """An ASCII prompt of exactly ``size_b`` bytes."""
    return (FILLER * (size_b // len(FILLER) + 1))[:size_b]


def bench_settings(base: Settings, prefix: str) -> Settings:
    return for_load(base.with_(key_prefix=prefix, pools=(UNLIMITED,)))


def real_message(client: redis.Redis, base: Settings, prompt: str) -> str:
    """The kombu message (JSON) that Gateway.submit queues for ``prompt``, read back."""
    prefix = f"gt-bench-probe-{uuid.uuid4().hex[:8]}:"
    settings = bench_settings(base, prefix)
    gw = Gateway(settings, client=client)
    try:
        gw.register_tenant("probe", TIER)
        gw.submit("probe", prompt, max_tokens=16, source="bench")
        (message,) = client.hvals(Keys(prefix).messages(UNLIMITED.name))
        return message.decode()
    finally:
        discard_prefix(client, prefix)
        gw.app.close()


def chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def measured(client: redis.Redis, command: str, action: Callable[[], Any],
             also: tuple[str, ...] = ()) -> tuple[Cost, Any]:
    """Run ``action``; what ``command`` cost meanwhile (commandstats delta) and its value.
    ``also``: commands whose time is added (their calls are not counted)."""
    before = commandstats(client)
    value = action()
    delta = stats_delta(before, commandstats(client))
    cost = delta.get(command, Cost())
    for name in also:
        cost = Cost(cost.calls, cost.usec + delta.get(name, Cost()).usec)
    return cost, value


def fill(client: redis.Redis, settings: Settings, scenario: Scenario, message: str) -> Cost:
    """Enqueue the scenario's messages (MULTI of HSET + enqueue.lua, as the producer does);
    the cost per enqueue: the script's time plus its message's HSET."""
    scripts = scripts_for(client)
    keys, tier = Keys(settings.key_prefix), settings.tier(TIER)
    total = Cost()
    for part in chunks(scenario.messages, PIPELINE_CHUNK):
        def push(part: range = part) -> None:
            with client.pipeline(transaction=True) as pipe:   # one MULTI of HSET + EVALSHA pairs
                for i in part:
                    queue_enqueue(scripts, EnqueueCall(keys, tier, UNLIMITED.name, f"t{i % scenario.tenants}",
                                                       f"tag-{i}", 100, message), pipe)
                pipe.execute()
        cost, _ = measured(client, "evalsha", push, also=("hset",))
        total += cost
    return total


def picked_of(got: list[Any]) -> list[Picked]:
    """The tasks of single picks (Picked | Wait) and of batches (list | Wait), flat."""
    out: list[Picked] = []
    for g in got:
        if isinstance(g, Picked):
            out.append(g)
        elif isinstance(g, list):
            out.extend(g)
    return out


def pick_and_ack(client: redis.Redis, settings: Settings, picks: int, per_call: int = 1) -> dict[str, Any]:
    """``picks`` tasks picked in windows, ``per_call`` a pick.lua call, each window's
    tasks acked after it; the costs are per task dispatched.  ``us_per_pick`` is the
    median over the windows (a window in which the machine preempted Redis mid-script
    reads high: commandstats times are wall-clock); the mean is beside it."""
    scripts = scripts_for(client)
    keys = Keys(settings.key_prefix)
    plan = PickPlan(settings, settings.queue_names())
    call = plan if per_call == 1 else plan.batch(per_call)
    pick_cost, fetch_cost, ack_cost, dispatched = Cost(), Cost(), Cost(), 0
    windows: list[float] = []
    for part in chunks(-(-picks // per_call), max(1, PICK_BATCH // per_call)):
        cost, got = measured(client, "evalsha", lambda part=part: [scripts.run(call) for _ in part])
        pick_cost += cost
        tags = picked_of(got)
        dispatched += len(tags)
        # a message too large to come back inline is fetched by the dispatcher (one HGET)
        fetch, _ = measured(client, "hget", lambda tags=tags: [
            plan.with_payload(client, p) for p in tags if p.payload is None])
        fetch_cost += fetch
        if tags:
            windows.append((cost.usec + fetch.usec) / len(tags))
        cost, _ = measured(client, "evalsha", lambda tags=tags: [
            scripts.run(ReleaseCall(keys, settings, p.pool, p.tag)) for p in tags])
        ack_cost += cost
    n = max(dispatched, 1)
    return {"picks": pick_cost.calls, "dispatched": dispatched, "per_call": per_call,
            "us_per_pick_script": pick_cost.us_per_call,
            "fetches": fetch_cost.calls, "us_per_fetch": fetch_cost.us_per_call,
            # what a dispatch costs Redis: the script, plus the fetch when there is one
            "us_per_pick": round(statistics.median(windows), 2) if windows else None,
            "us_per_pick_mean": round((pick_cost.usec + fetch_cost.usec) / n, 2),
            "windows": len(windows), "acks": ack_cost.calls,
            "us_per_ack": ack_cost.us_per_call}


def anatomy_of(entries: list[dict[str, Any]], picks: int) -> dict[str, Any]:
    """Per pick: the EVALSHA time, and the commands it ran by name (calls, us)."""
    evalsha, inner = Cost(), {}
    for entry in entries:
        words = redis_stats.entry_words(entry)
        cost = Cost(1, int(entry.get("duration", 0)))
        if redis_stats.is_script_call(entry):
            name = words[0].lower()
            inner[name] = inner.get(name, Cost()) + cost
        elif words[0].lower() == "evalsha":
            evalsha += cost
    n = max(picks, 1)
    ran_us = sum(c.usec for c in inner.values())
    return {"picks": picks, "logged_us_per_pick": round(evalsha.usec / n, 2),
            "ran_us_per_pick": round(ran_us / n, 2),
            "commands_per_pick": round(sum(c.calls for c in inner.values()) / n, 2),
            "ran": {name: {"calls_per_pick": round(c.calls / n, 2), "us_per_pick": round(c.usec / n, 2)}
                    for name, c in sorted(inner.items(), key=lambda kv: -kv[1].usec)}}


def pick_anatomy(client: redis.Redis, base: Settings, message: str, picks: int) -> dict[str, Any]:
    """One batch of picks with every command logged (module docstring)."""
    prefix = f"gt-bench-anatomy-{uuid.uuid4().hex[:8]}:"
    settings = bench_settings(base, prefix)
    plan = PickPlan(settings, settings.queue_names())
    scripts = scripts_for(client)
    try:
        fill(client, settings, Scenario(PROMPT_SIZES_B[0], 10, picks, picks), message)
        with redis_stats.recording(client):
            got = [scripts.run(plan) for _ in range(picks)]
            entries = redis_stats.slowlog_entries(client)
        out = anatomy_of(entries, sum(1 for p in got if isinstance(p, Picked)))
        return out
    finally:
        discard_prefix(client, prefix)


def lua_literal(arg: bytes) -> str:
    """A Lua string literal of ``arg``'s bytes (decimal escapes outside printable ASCII)."""
    return '"' + "".join(chr(b) if 32 <= b < 127 and b not in (34, 92) else f"\\{b}" for b in arg) + '"'


def replay_script(commands: list[list[bytes]]) -> str:
    """A script that runs ``commands`` (each its name and arguments) in order, nothing else."""
    table = ",".join("{" + ",".join(lua_literal(a) for a in cmd) + "}" for cmd in commands)
    return f"local C = {{{table}}}\nfor i = 1, #C do redis.call(unpack(C[i])) end\nreturn 0"


def script_commands(raw_slowlog: list[Any]) -> list[list[bytes]]:
    """The commands scripts ran, oldest first, from a raw SLOWLOG GET reply (entries: id, time,
    duration, arguments, client address, client name)."""
    out = []
    for entry in reversed(raw_slowlog):
        if len(entry) > 4 and entry[4] in (redis_stats.SCRIPT_CLIENT, redis_stats.SCRIPT_CLIENT.encode()):
            out.append([a if isinstance(a, bytes) else str(a).encode() for a in entry[3]])
    return out


def _us_per_call(client: redis.Redis, sha: str, keys: list[Any], args: list[Any]) -> float:
    rounds = []
    for _ in range(FLOOR_ROUNDS):
        cost, _ = measured(client, "evalsha", lambda: [client.evalsha(sha, len(keys), *keys, *args)
                                                       for _ in range(FLOOR_CALLS)])
        rounds.append(cost.usec / max(cost.calls, 1))
    return round(statistics.median(rounds), 2)


def pick_floor(client: redis.Redis, base: Settings, message: str) -> dict[str, Any]:
    """The commands of one pick replayed with no logic, and the empty call with the pick's
    KEYS and ARGV: us per call, medians of FLOOR_ROUNDS rounds (module docstring)."""
    prefix = f"gt-bench-floor-{uuid.uuid4().hex[:8]}:"
    settings = bench_settings(base, prefix)
    plan = PickPlan(settings, settings.queue_names())
    try:
        fill(client, settings, Scenario(PROMPT_SIZES_B[0], 10, PICK_BATCH, PICK_BATCH), message)
        scripts_for(client).run(plan)   # the first pick flags the idle tiers: the second is steady
        with redis_stats.recording(client):
            scripts_for(client).run(plan)
            raw = client.execute_command("SLOWLOG", "GET", redis_stats.SLOWLOG_MAX_LEN)
        commands = script_commands(raw)
        replay = client.script_load(replay_script(commands))
        empty = client.script_load("return 0")
        keys, args = list(plan.script_keys), list(plan.script_args)
        return {"commands": len(commands), "names": [c[0].decode().lower() for c in commands],
                "keys": len(keys), "args": len(args),
                "replay_us": _us_per_call(client, replay, [], []),
                "empty_with_pick_args_us": _us_per_call(client, empty, keys, args)}
    finally:
        discard_prefix(client, prefix)


def run_scenario(client: redis.Redis, base: Settings, scenario: Scenario, message: str) -> dict[str, Any]:
    prefix = f"gt-bench-pick-{uuid.uuid4().hex[:8]}:"
    settings = bench_settings(base, prefix)
    for name in ("dispatch/enqueue", "dispatch/pick", "dispatch/release"):   # loaded before any window
        client.script_load(source(name))
    try:
        enqueue = fill(client, settings, scenario, message)
        out = {"scenario": scenario.name, "prompt_b": scenario.prompt_b, "message_b": len(message),
               "tenants": scenario.tenants, "queued": scenario.messages,
               "us_per_enqueue": enqueue.us_per_call}
        out.update(pick_and_ack(client, settings, scenario.picks))
    finally:
        discard_prefix(client, prefix)
    # the same again, a dispatcher with BATCH_PICKS free slots taking them in one call
    prefix = f"gt-bench-pick-{uuid.uuid4().hex[:8]}:"
    settings = bench_settings(base, prefix)
    try:
        fill(client, settings, scenario, message)
        batched = pick_and_ack(client, settings, scenario.picks, per_call=BATCH_PICKS)
        out["batched"] = {k: batched[k] for k in ("per_call", "picks", "dispatched", "us_per_pick")}
    finally:
        discard_prefix(client, prefix)
    return out


def run_plain_list(client: redis.Redis, prompt_b: int, message: str, n: int) -> dict[str, Any]:
    """LPUSH then RPOP ``n`` copies of the message on a plain list."""
    key = f"gt-bench-list-{uuid.uuid4().hex[:8]}:queue"
    push = Cost()
    try:
        for part in chunks(n, PIPELINE_CHUNK):
            def lpush(part: range = part) -> None:
                with client.pipeline(transaction=False) as pipe:
                    for _ in part:
                        pipe.lpush(key, message)
                    pipe.execute()
            push += measured(client, "lpush", lpush)[0]
        pop, got = measured(client, "rpop", lambda: [client.rpop(key) for _ in range(n)])
    finally:
        client.delete(key)
    return {"prompt_b": prompt_b, "message_b": len(message), "us_per_lpush": push.us_per_call,
            "rpops": pop.calls, "popped": sum(1 for m in got if m is not None),
            "us_per_rpop": pop.us_per_call}


def run(client: redis.Redis, base: Settings, *, picks: int, many_tenants: int,
        warmup_picks: int = WARMUP_PICKS, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every scenario, then the plain list at each prompt size (same messages)."""
    client.config_resetstat()
    messages = {b: real_message(client, base, prompt_of(b)) for b in PROMPT_SIZES_B}
    warm = Scenario(PROMPT_SIZES_B[0], 10, warmup_picks, warmup_picks)
    run_scenario(client, base, warm, messages[warm.prompt_b])     # not counted (module docstring)
    rows = []
    for scenario in scenarios(picks, many_tenants):
        rows.append(run_scenario(client, base, scenario, messages[scenario.prompt_b]))
        progress(f"  {scenario.name}: {rows[-1]['us_per_pick']} us per pick")
    plain = [run_plain_list(client, b, messages[b], picks) for b in PROMPT_SIZES_B]
    anatomy = pick_anatomy(client, base, messages[PROMPT_SIZES_B[0]], min(picks, PICK_BATCH))
    floor = pick_floor(client, base, messages[PROMPT_SIZES_B[0]])
    return {"picks_per_scenario": picks, "warmup_picks": warmup_picks, "pick": rows, "plain_list": plain,
            "pick_anatomy": anatomy, "pick_floor": floor}
