"""`gateway-dev bench-dispatch`, the targets and the text.  Pure: it reads the result
document of ``bench.dispatch`` (parts ``server``, ``rate``, ``cpu``).

Targets of issue "Router v2":

* <= 30 us of Redis time per pick, independent of prompt size (every
  scenario: both prompt sizes, few and 10k tenants);
* >= 15,000 dispatches/s from one Redis (pick + ack, the concurrent
  dispatchers as measured; Redis's own ceiling is printed beside it);
* end-to-end Redis CPU per task <= 1.3 x plain Celery's (the gateway's real
  inference task vs plain Celery's no-op, at every prompt size).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from devtools.bench import dispatch_bucket
from devtools.bench import targets as bench_targets

PICK_MAX_US = 30.0
DISPATCHES_MIN_PER_S = 15_000
CPU_MAX_X = 1.3
BUCKET_BOUND_MAX_X = dispatch_bucket.TARGET_X
TOP_COMMANDS = 8


def _v(value: Any, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def worst_pick(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    rows = [r for r in rows if r.get("us_per_pick") is not None]
    return max(rows, key=lambda r: r["us_per_pick"]) if rows else None


def cpu_ratios(flows: Sequence[Mapping[str, Any]], flow: str, base: str = "plain") -> dict[int, float | None]:
    """prompt size -> ``flow``'s Redis CPU per task / ``base``'s."""
    by = {(f["flow"], f["prompt_b"]): f["redis_cpu_us_per_task"] for f in flows}
    out = {}
    for (name, size), value in by.items():
        if name == flow:
            ref = by.get((base, size))
            out[size] = round(value / ref, 3) if ref and value is not None else None
    return out


def evaluate(result: dict[str, Any]) -> dict[str, Any]:
    """Adds ``targets`` and ``all_targets_pass``."""
    targets = []
    if "server" in result:
        worst = worst_pick(result["server"]["pick"])
        us = worst["us_per_pick"] if worst else None
        targets.append(bench_targets.at_most(
            "pick_us", us, PICK_MAX_US,
            f"<= {PICK_MAX_US:.0f} us Redis time per pick at any prompt size and tenant count: "
            f"worst {_v(us)} us ({worst['scenario'] if worst else '-'})"))
    if "rate" in result:
        rate = result["rate"]["gateway"]
        targets.append(bench_targets.at_least(
            "dispatches_per_s", rate["per_s"], DISPATCHES_MIN_PER_S,
            f">= {DISPATCHES_MIN_PER_S} dispatches/s from one Redis: {_v(rate['per_s'], '.0f')}/s "
            f"measured ({rate['processes']} dispatchers; Redis's own ceiling "
            f"{_v(rate['redis_ceiling_per_s'], '.0f')}/s)"))
    if "cpu" in result:
        ratios = cpu_ratios(result["cpu"]["flows"], "gateway_infer")
        known = [x for x in ratios.values() if x is not None]
        worst_x = max(known) if known and len(known) == len(ratios) else None
        shown = ", ".join(f"{_v(x, '.2f')}x at {size} B" for size, x in sorted(ratios.items()))
        targets.append(bench_targets.at_most(
            "cpu_per_task_x", worst_x, CPU_MAX_X,
            f"end-to-end Redis CPU per task <= {CPU_MAX_X}x plain Celery's: {shown or '-'}"))
    if "bucket" in result:
        ratio = result["bucket"]["ratio"]
        median = ratio["median"] if ratio else None
        targets.append(bench_targets.at_most(
            "bucket_bound_cpu_x", median, BUCKET_BOUND_MAX_X,
            f"Redis CPU per dispatched task bucket-bound <= {BUCKET_BOUND_MAX_X}x unconstrained: median "
            f"{_v(median, '.2f')}x (runs {_v(ratio['min'], '.2f') if ratio else '-'} .. "
            f"{_v(ratio['max'], '.2f') if ratio else '-'})"))
    result["targets"] = targets
    result["all_targets_pass"] = bench_targets.all_pass(targets)
    return result


# -- text -------------------------------------------------------------------------
def format_server(server: Mapping[str, Any]) -> list[str]:
    out = [f"== 1. Redis time per operation, server side (INFO commandstats usec/calls; "
           f"{server['picks_per_scenario']} picks a scenario)",
           f"     {'scenario':<28} {'message B':>9} {'us/enqueue':>10} {'us/pick':>8} {'us/ack':>7} "
           f"{'us/task, batched':>17}"]
    for r in server["pick"]:
        b = r.get("batched") or {}
        batched = f"{_v(b.get('us_per_pick'))} ({b.get('per_call', '-')}/call)" if b else "-"
        out.append(f"     {r['scenario']:<28} {r['message_b']:>9} {_v(r['us_per_enqueue']):>10} "
                   f"{_v(r['us_per_pick']):>8} {_v(r['us_per_ack']):>7} {batched:>17}")
    out.append("     (us/pick: one task a call, its fetch included for a message over the inline "
               "limit, median of the windows -- mean in --json; batched: a dispatcher with free slots "
               "taking that many a call)")
    out.append(f"     {'plain list, same messages':<28} {'message B':>9} {'us/LPUSH':>10} {'us/RPOP':>8}")
    for r in server["plain_list"]:
        out.append(f"     {str(r['prompt_b']) + ' B prompts':<28} {r['message_b']:>9} "
                   f"{_v(r['us_per_lpush']):>10} {_v(r['us_per_rpop']):>8}")
    a = server.get("pick_anatomy")
    if a:
        clean = server["pick"][0]["us_per_pick"]
        own = None if clean is None else round(clean - a["ran_us_per_pick"], 1)
        ran = ", ".join(f"{n} {c['calls_per_pick']:g}x {c['us_per_pick']:.1f}"
                        for n, c in list(a["ran"].items())[:TOP_COMMANDS])
        out.append(f"     a pick runs {a['commands_per_pick']:g} commands taking "
                   f"{a['ran_us_per_pick']:.1f} us ({ran} us); the rest of its {_v(clean)} us, "
                   f"{_v(own)} us, is the script's own (Lua, KEYS/ARGV, the redis.call bridge)")
    f = server.get("pick_floor")
    if f:
        out.append(f"     floor: those {f['commands']} commands replayed by a script with no logic take "
                   f"{_v(f['replay_us'])} us a call, an empty call with the pick's {f['keys']} keys and "
                   f"{f['args']} arguments {_v(f['empty_with_pick_args_us'])} us: "
                   f"{_v(f['replay_us'] + f['empty_with_pick_args_us'])} us before any of the pick's logic")
    if server.get("warmup_picks"):
        out.append(f"     ({server['warmup_picks']} picks on a fresh queue first, not counted: a fresh "
                   f"server's first ~1,000 cost ~1.5x)")
    return out


def format_rate(rate: Mapping[str, Any]) -> list[str]:
    out = [f"== 2. dispatches per second, {rate['gateway']['processes']} concurrent processes, "
           f"{rate['messages']} messages ({rate['prompt_b']} B prompts, {rate['tenants']} tenants)",
           f"     {'':<28} {'ops/s':>7} {'Redis busy %':>12} {'Redis CPU us/op':>16} {'ceiling/s':>10}"]
    rows = [("gateway", "pick.lua + release.lua ack"),
            ("gateway_batched", f"same, {rate.get('batch_picks', '-')} a call"), ("plain_rpop", "plain RPOP")]
    for name, label in rows:
        r = rate.get(name)
        if not r:
            continue
        out.append(f"     {label:<28} {_v(r['per_s'], '.0f'):>7} {_v(r['redis_busy_pct']):>12} "
                   f"{_v(r['redis_cpu_us_per_op']):>16} {_v(r['redis_ceiling_per_s'], '.0f'):>10}")
    return out


def format_breakdown(flow: Mapping[str, Any]) -> str:
    b = flow.get("breakdown")
    if not b:
        return ""
    top = ", ".join(f"{name} {c['us_per_task']:.0f}" for name, c in
                    list(b["commands"].items())[:TOP_COMMANDS])
    return (f"       {flow['flow']}: commands {b['command_us_per_task']:.0f} us of "
            f"{_v(flow['redis_cpu_us_per_task'], '.0f')} us CPU per task (the rest: reading, "
            f"parsing, replying): {top}")


def format_cpu(cpu: Mapping[str, Any]) -> list[str]:
    flows = cpu["flows"]
    ratios = {name: cpu_ratios(flows, name) for name in ("plain", "gateway_noop", "gateway_infer")}
    out = [f"== 3. Redis CPU per task, end to end ({cpu['tasks']} tasks a run, task events on; "
           f"INFO cpu over submit -> result)",
           f"     {'flow':<14} {'prompt B':>8} {'CPU us/task':>12} {'x plain':>8} {'EVALSHA/task':>13} "
           f"{'trips/task':>11} {'ok':>5}"]
    for f in flows:
        x = ratios[f["flow"]].get(f["prompt_b"])
        out.append(f"     {f['flow']:<14} {f['prompt_b']:>8} {_v(f['redis_cpu_us_per_task']):>12} "
                   f"{_v(x, '.2f'):>8} {_v(f['evalsha_per_task'], '.2f'):>13} "
                   f"{_v(f.get('round_trips_per_task'), '.2f'):>11} {f['succeeded']:>5}")
    lines = [format_breakdown(f) + f" [{f['prompt_b']} B]" for f in flows if f.get("breakdown")]
    out.append("     (trips/task: the server's read events -- client round trips, a pipeline is one -- "
               "over the window, idle pollers' included)")
    if lines:
        out.append("     where the time goes (us per task, slowlog run; EVALSHA calibrated):")
        out += lines
    return out


def format_report(result: Mapping[str, Any]) -> str:
    c = result["config"]
    lines = [f"gateway-dev bench-dispatch: private redis-server {c['redis_version']} (AOF everysec), "
             f"{c['cores']} cores", ""]
    if "server" in result:
        lines += format_server(result["server"]) + [""]
    if "rate" in result:
        lines += format_rate(result["rate"]) + [""]
    if "cpu" in result:
        lines += format_cpu(result["cpu"]) + [""]
    if "bucket" in result:
        lines += dispatch_bucket.format_part(result["bucket"]) + [""]
    lines += bench_targets.format_targets(result["targets"])
    lines.append(f"total bench time {result['runtime_s']:.0f} s")
    return "\n".join(lines)
