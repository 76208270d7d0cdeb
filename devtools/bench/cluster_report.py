"""`gateway-dev bench-cluster`'s numbers: a shard's and a topology's figures from what was
measured, the scale-out ratios over the runs against the target, and the text report
(all pure; ``bench.cluster`` measures)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from devtools.bench.redis_stats import Cost
from devtools.measure import spread

TARGET_X = 2.7                 # capacity on 3 masters / on 1 (the target)
DRIVER_BOUND_BUSY_PCT = 70.0   # every shard below this share of a core: the drivers, not Redis, set the rate


def _per(value: float, tasks: int, digits: int = 1) -> float | None:
    return round(value / tasks, digits) if tasks else None


def shard_row(*, shard: int, port: int, pools: Sequence[str], tasks: int, cpu_s: float,
              commands: Mapping[str, Cost], reads: int, window_s: float) -> dict[str, Any]:
    """One master over one window: its tasks, its CPU (INFO cpu delta) and what follows."""
    cpu_us = 1e6 * cpu_s / tasks if tasks else None
    evalsha = commands.get("evalsha", Cost())
    return {"shard": shard, "port": port, "pools": list(pools), "tasks": tasks, "window_s": round(window_s, 3),
            "tasks_per_s": round(tasks / window_s) if window_s > 0 else None,
            "cpu_s": round(cpu_s, 4),
            "busy_pct": round(100.0 * cpu_s / window_s, 1) if window_s > 0 else None,
            "cpu_us_per_task": round(cpu_us, 1) if cpu_us else None,
            # one core of this master spent on nothing but these tasks
            "capacity_per_s": round(1e6 / cpu_us) if cpu_us else None,
            "evalsha_per_task": _per(evalsha.calls, tasks, 2),
            "round_trips_per_task": _per(reads, tasks, 2)}


def capacities(rows: Sequence[Mapping[str, Any]], pools: int) -> dict[str, Any]:
    """What the masters of ``rows`` dispatch when Redis CPU is the limit.

    ``capacity_per_s``: the sum over the masters of 1 / (CPU per task), each of them busy.
    ``equal_load_capacity_per_s``: with every pool equally loaded, the master with the least
    capacity per pool it holds sets the pace for all: min over masters of capacity x pools /
    its pools.  ``cpu_per_task_max_over_min``: how evenly a task costs the masters."""
    held = [r for r in rows if r["pools"] and r["capacity_per_s"]]
    per_task = [r["cpu_us_per_task"] for r in held]
    return {"capacity_per_s": sum(r["capacity_per_s"] for r in held),
            "equal_load_capacity_per_s": round(min(r["capacity_per_s"] * pools / len(r["pools"])
                                                   for r in held)) if held else None,
            "cpu_per_task_max_over_min": round(max(per_task) / min(per_task), 3) if per_task else None}


def topology_run(masters: int, together: Sequence[Mapping[str, Any]], alone: Sequence[Mapping[str, Any]],
                 pools: int) -> dict[str, Any]:
    """One run of one cluster size: ``together``, every master's row of the window in which
    every pool had its driver; ``alone``, every master's row of the window in which it alone
    was driven (on one master, the same rows)."""
    tasks = sum(r["tasks"] for r in together)
    cpu_s = sum(r["cpu_s"] for r in together)
    window_s = max((r["window_s"] for r in together), default=0.0)
    busy = [r for r in together if r["tasks"]]
    mean_tasks = tasks / len(busy) if busy else 0
    mean_cpu = cpu_s / len(busy) if busy else 0
    return {"masters": masters,
            "together": {"shards": [dict(r) for r in together], "window_s": window_s, "tasks": tasks,
                         "dispatches_per_s": round(tasks / window_s) if window_s > 0 else None,
                         "cpu_us_per_task": round(1e6 * cpu_s / tasks, 1) if tasks else None,
                         **capacities(together, pools),
                         "tasks_max_over_mean": round(max(r["tasks"] for r in busy) / mean_tasks, 3)
                         if mean_tasks else None,
                         "cpu_max_over_mean": round(max(r["cpu_s"] for r in busy) / mean_cpu, 3)
                         if mean_cpu else None,
                         "busy_pct_max": max((r["busy_pct"] or 0.0 for r in together), default=0.0)},
            "alone": {"shards": [dict(r) for r in alone], **capacities(alone, pools),
                      "busy_pct_max": max((r["busy_pct"] or 0.0 for r in alone), default=0.0)}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def evaluate(result: dict[str, Any]) -> dict[str, Any]:
    """The ratios of the larger cluster to 1 master, run by run (run i of each size, taken
    one after the other), their spread, and the targets: capacity from each master driven
    alone (as loaded as the single master), summed and with every pool equally loaded; the
    dispatches/s measured with every pool driven too, unless the drivers were the limit."""
    k = str(result["config"]["shards"])
    one, many = result["runs"]["1"], result["runs"][k]
    pairs = list(zip(one, many))

    def ratios(phase: str, name: str) -> list[float | None]:
        return [_ratio(b[phase][name], a[phase][name]) for a, b in pairs]

    def over_runs(runs: Sequence[Mapping[str, Any]], phase: str, name: str) -> dict[str, Any]:
        return spread([r[phase][name] for r in runs])

    busiest = max((r["together"]["busy_pct_max"] for r in one + many), default=0.0)
    summary = {
        "capacity_x": spread(ratios("alone", "capacity_per_s")),
        "equal_load_capacity_x": spread(ratios("alone", "equal_load_capacity_per_s")),
        "together_capacity_x": spread(ratios("together", "capacity_per_s")),
        "measured_x": spread(ratios("together", "dispatches_per_s")),
        "capacity_per_s": {"1": over_runs(one, "alone", "capacity_per_s"),
                           k: over_runs(many, "alone", "capacity_per_s")},
        "cpu_us_per_task_alone": {"1": spread([r["alone"]["shards"][0]["cpu_us_per_task"] for r in one]),
                                  k: [spread([r["alone"]["shards"][i]["cpu_us_per_task"] for r in many])
                                      for i in range(int(k))] if many else []},
        "cpu_us_per_task_together": {"1": over_runs(one, "together", "cpu_us_per_task"),
                                     k: over_runs(many, "together", "cpu_us_per_task")},
        "dispatches_per_s": {"1": over_runs(one, "together", "dispatches_per_s"),
                             k: over_runs(many, "together", "dispatches_per_s")},
        "balance": {"tasks_max_over_mean": over_runs(many, "together", "tasks_max_over_mean"),
                    "cpu_max_over_mean": over_runs(many, "together", "cpu_max_over_mean"),
                    "cpu_per_task_max_over_min": over_runs(many, "alone", "cpu_per_task_max_over_min")},
        "busy_pct_max": busiest,
        # no master came near a core with every pool driven: the drivers set that rate, not Redis
        "driver_bound": busiest < DRIVER_BOUND_BUSY_PCT}
    targets = [_target("capacity_x", summary["capacity_x"]),
               _target("equal_load_capacity_x", summary["equal_load_capacity_x"])]
    if not summary["driver_bound"]:
        targets.append(_target("measured_x", summary["measured_x"]))
    return {**result, "ratios": {"capacity_x": ratios("alone", "capacity_per_s"),
                                 "equal_load_capacity_x": ratios("alone", "equal_load_capacity_per_s"),
                                 "together_capacity_x": ratios("together", "capacity_per_s"),
                                 "measured_x": ratios("together", "dispatches_per_s")},
            "summary": summary, "targets": targets, "all_targets_pass": all(t["pass"] for t in targets)}


def _target(name: str, got: dict[str, Any] | None) -> dict[str, Any]:
    value = got["median"] if got else None
    return {"target": name, "value": value, "min_x": TARGET_X, "pass": value is not None and value >= TARGET_X}


# -- text ---------------------------------------------------------------------------------
def _fmt(s: dict[str, Any] | None, unit: str = "", digits: int = 2) -> str:
    if not s or s["median"] is None:
        return "-"
    if digits == 0:
        return f"{s['median']:,.0f}{unit} ({s['min']:,.0f}..{s['max']:,.0f})"
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}..{s['max']:.{digits}f})"


def _masters(n: int | str) -> str:
    return f"{n} master{'' if int(n) == 1 else 's'}"


def _table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    width = max([18] + [len(",".join(r["pools"])) + 2 for r in rows])
    head = (f"   {'shard':<6}{'port':>6}  {'pools':<{width}}{'tasks':>8}{'tasks/s':>9}{'busy %':>8}"
            f"{'CPU us/task':>13}{'capacity/s':>12}{'EVALSHA/task':>14}{'trips/task':>12}")
    return [head] + [
        f"   {r['shard']:<6}{r['port']:>6}  {','.join(r['pools']):<{width}}{r['tasks']:>8,}"
        f"{r['tasks_per_s'] or 0:>9,}{r['busy_pct'] or 0:>8}{r['cpu_us_per_task'] or 0:>13}"
        f"{r['capacity_per_s'] or 0:>12,}{r['evalsha_per_task'] or 0:>14}{r['round_trips_per_task'] or 0:>12}"
        for r in rows]


def format_run(run_no: int, got: Mapping[str, Any], pools: int) -> list[str]:
    t, a = got["together"], got["alone"]
    out = [f"== run {run_no}, {_masters(got['masters'])}: every pool driven, one driver each "
           f"({t['tasks']:,} tasks in {t['window_s']} s)"] + _table(t["shards"])
    line = f"   all: {t['dispatches_per_s']:,} dispatches/s, {t['cpu_us_per_task']} us Redis CPU per task"
    if got["masters"] == 1:
        return out + [line + f"; capacity {a['capacity_per_s']:,}/s"]
    out.append(line + f"; over the masters tasks max/mean {t['tasks_max_over_mean']}, CPU max/mean "
               f"{t['cpu_max_over_mean']}; capacity from this window {t['capacity_per_s']:,}/s")
    out += [f"   each master alone, {pools} drivers on its pools (as loaded as the single master):"]
    out += _table(a["shards"])
    out.append(f"   capacity {a['capacity_per_s']:,}/s, every pool equally loaded {a['equal_load_capacity_per_s']:,}/s; "
               f"CPU per task max/min over the masters {a['cpu_per_task_max_over_min']}")
    return out


def format_report(result: Mapping[str, Any]) -> str:
    c, s = result["config"], result["summary"]
    k = str(c["shards"])
    lines = [f"gateway-dev bench-cluster: {c['pools']} pools on 1 and on {c['shards']} Redis Cluster masters "
             f"(Redis {c['redis_version']}, AOF on, loopback; {c['cores']} cores), {c['runs']} run(s) of "
             f"{c['window_s']} s windows, each driver process serving one pool",
             f"per task, one round trip each on the pool's master: {', '.join(c['scripts_per_task'])} "
             f"(enqueue with its message's HSET, one MULTI); {c['prompt_b']} B prompts ({c['message_b']} B "
             f"messages), {c['backlog']} queued over {c['tenants']} tenants per driver, tier {c['tier']}",
             "capacity/s = 1 core / Redis CPU per task (INFO cpu, user + sys, over the window / the tasks "
             "its pools dispatched)",
             "",
             f"placement: the slot of {{p:<pool>}} (CLUSTER KEYSLOT) and its master, the slots cut as "
             f"`redis-cli --cluster create` cuts them ({_masters(k)}):"]
    for p in result["placement"]:
        lines.append(f"   {p['pool']:<10} slot {p['slot']:>5}  master {p['shard']} of {k}")
    for i in range(c["runs"]):
        for size in ("1", k):
            if i < len(result["runs"][size]):
                lines += [""] + format_run(i + 1, result["runs"][size][i], c["pools"])
    alone_k = ", ".join(_fmt(x, " us", 1) for x in s["cpu_us_per_task_alone"][k])
    judged = {t["target"]: t for t in result["targets"]}

    def verdict(name: str) -> str:
        return f"target >= {TARGET_X}x: {'PASS' if judged[name]['pass'] else 'FAIL'}"

    lines += ["", f"== scale-out, 1 -> {_masters(k)}: median (min..max) over {c['runs']} run(s)",
              f"   Redis CPU per task, each master driven alone: {_masters(1)} "
              f"{_fmt(s['cpu_us_per_task_alone']['1'], ' us', 1)}; {_masters(k)}: {alone_k}",
              f"   Redis-CPU-bound capacity: {_masters(1)} {_fmt(s['capacity_per_s']['1'], '/s', 0)}, "
              f"{_masters(k)} {_fmt(s['capacity_per_s'][k], '/s', 0)}",
              f"   capacity ratio (sum over the masters): {_fmt(s['capacity_x'], 'x')}  {verdict('capacity_x')}",
              f"   capacity ratio, every pool equally loaded (the master with the least capacity per pool "
              f"sets the pace): {_fmt(s['equal_load_capacity_x'], 'x')}  {verdict('equal_load_capacity_x')}",
              f"   balance over the {k} masters, every pool driven: tasks max/mean "
              f"{_fmt(s['balance']['tasks_max_over_mean'])}, CPU max/mean {_fmt(s['balance']['cpu_max_over_mean'])}; "
              f"CPU per task max/min, each alone {_fmt(s['balance']['cpu_per_task_max_over_min'])}",
              f"   every pool driven at once: Redis CPU per task {_masters(1)} "
              f"{_fmt(s['cpu_us_per_task_together']['1'], ' us', 1)}, {_masters(k)} "
              f"{_fmt(s['cpu_us_per_task_together'][k], ' us', 1)}; capacity ratio from those windows "
              f"{_fmt(s['together_capacity_x'], 'x')} (not judged: each of the {k} masters ran at a third of the "
              f"load, its CPU per task inflated by idle wake-ups and by sharing the cores with every other process)"]
    measured = (f"   measured dispatches/s: {_masters(1)} {_fmt(s['dispatches_per_s']['1'], '', 0)}, "
                f"{_masters(k)} {_fmt(s['dispatches_per_s'][k], '', 0)}: {_fmt(s['measured_x'], 'x')}")
    if s["driver_bound"]:
        lines += [measured + " -- not judged: the Python drivers are the limit here",
                  f"   ({c['pools']} driver processes and the masters share {c['cores']} cores; no master was "
                  f"busier than {s['busy_pct_max']}% of a core), so the scale-out is judged on Redis CPU per task "
                  f"and the balance over the masters"]
    else:
        lines.append(measured + f"  {verdict('measured_x')}")
    lines.append(f"all targets: {'PASS' if result['all_targets_pass'] else 'FAIL'} "
                 f"({result.get('runtime_s', '?')} s)")
    return "\n".join(lines)
