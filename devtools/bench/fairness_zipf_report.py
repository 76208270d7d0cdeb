"""`gateway-dev bench-fairness --scenario zipf`, part 2: the numbers and the targets (pure).

The scenario (devtools/bench/fairness_zipf.py): many normal-tier tenants whose demand
follows Zipf(s) by rank, offered at ~2x the pool's capacity, beside a baseline of a few
tenants with the same load.  Tenant ids are random, so where an id sorts says nothing
about its rank: any difference between quartiles of ids is the scheduler's doing.

* **Small tenants**: those whose expected demand is below their max-min fair share of
  the pool (water-filling on the Zipf demand): the scheduler owes them their whole
  demand, so their queue waits are its latency fairness.
* **Quartiles of ids**: the small tenants' task waits split by where the tenant id sorts
  among all the scenario's ids (p50 / p99 / max each).  **The run's noise**: the same
  spread (largest minus smallest quartile figure) over random splits of the same tenants
  into four groups of the same sizes (``NOISE_SPLITS`` of them, its 95th percentile): the
  id quartiles should spread no more than chance does.
* **Jain's index** over the tenants that sent work, of tokens served / max-min fair share
  of what was served (the realised demand, water-filled).
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

from devtools.bench import targets as bench_targets
from devtools.bench.load import wait_stats
from devtools.measure import percentile

NOISE_SPLITS = 200
SMALL_P99_RATIO_MAX = 2.0   # small tenants' p99 at scale / the baseline's
JAIN_MIN = 0.95


def zipf_weights(n: int, s: float) -> list[float]:
    """Zipf(s) probabilities of ranks 1..n (rank 1 first)."""
    raw = [1.0 / (k ** s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def max_min_fair(demands: Mapping[str, float], capacity: float) -> dict[str, float]:
    """Water-filling: each tenant gets min(its demand, a common level), the level such
    that the shares sum to ``capacity`` (or every demand in full when it fits)."""
    out: dict[str, float] = {}
    left, waiting = float(capacity), sorted(demands.items(), key=lambda kv: kv[1])
    while waiting:
        level = left / len(waiting)
        tenant, demand = waiting[0]
        if demand > level:
            out.update({t: level for t, _ in waiting})
            return out
        out[tenant] = demand
        left -= demand
        waiting.pop(0)
    return out


def small_tenants(demands: Mapping[str, float], capacity: float) -> set[str]:
    """The tenants whose demand is within their max-min fair share (owed it in full)."""
    fair = max_min_fair(demands, capacity)
    return {t for t, d in demands.items() if d <= fair[t]}


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index of ``values`` (1 = all equal)."""
    if not values:
        return None
    total, squares = sum(values), sum(v * v for v in values)
    return None if squares == 0 else total * total / (len(values) * squares)


def quartiles_of(ids: Sequence[str]) -> dict[str, int]:
    """Each id's quartile (0..3) by where it sorts."""
    ordered = sorted(ids)
    return {t: min(3, 4 * i // len(ordered)) for i, t in enumerate(ordered)}


def _spread(groups: Sequence[Sequence[float]], key: str) -> float | None:
    values = [wait_stats(g)[key] for g in groups if g]
    values = [v for v in values if v is not None]
    return None if len(values) < 2 else round(max(values) - min(values), 1)


def quartile_rows(waits_by_tenant: Mapping[str, Sequence[float]], quartile: Mapping[str, int],
                  missing_by_tenant: Mapping[str, int]) -> list[dict[str, Any]]:
    """p50 / p99 / max of the waits of each quartile's tenants (never dispatched: infinite)."""
    rows = []
    for q in range(4):
        tenants = [t for t in waits_by_tenant if quartile[t] == q]
        waits = [w for t in tenants for w in waits_by_tenant[t]]
        missing = sum(missing_by_tenant.get(t, 0) for t in tenants)
        rows.append({"quartile": q + 1, "tenants": len(tenants), **wait_stats(waits, missing)})
    return rows


def noise(waits_by_tenant: Mapping[str, Sequence[float]], quartile: Mapping[str, int],
          seed: int = 0) -> dict[str, float | None]:
    """The 95th percentile of the quartiles' spread (p50 and p99) over random splits of
    the same tenants into groups of the quartiles' sizes."""
    tenants = list(waits_by_tenant)
    sizes = [sum(1 for t in tenants if quartile[t] == q) for q in range(4)]
    rng = random.Random(seed)
    spreads: dict[str, list[float]] = {"wait_p50_ms": [], "wait_p99_ms": []}
    for _ in range(NOISE_SPLITS):
        rng.shuffle(tenants)
        groups, at = [], 0
        for n in sizes:
            groups.append([w for t in tenants[at:at + n] for w in waits_by_tenant[t]])
            at += n
        for key, got in spreads.items():
            s = _spread(groups, key)
            if s is not None:
                got.append(s)
    return {key: (round(percentile(v, 95), 1) if v else None) for key, v in spreads.items()}


def scenario(tenants: Sequence[str], small: set[str], sent: Mapping[str, int],
             results: Sequence[Mapping[str, Any]], *, measured: Mapping[str, int] | None = None,
             cut_ms: int | None = None, window_end_ms: int | None = None) -> dict[str, Any]:
    """One scenario's figures from its tasks' results (``timing.queue_wait_ms``,
    ``tokens.total``): small tenants' waits overall and per quartile of ids, the noise,
    and Jain's index of tokens served against the max-min fair share of the served total,
    over the tasks enqueued by ``cut_ms`` (``measured``: how many each tenant sent by then)
    and dispatched by ``window_end_ms`` -- a request sent in the window's last instants
    cannot have been served yet, whoever sent it."""
    waits: dict[str, list[float]] = {}
    tokens: dict[str, float] = {}
    demand: dict[str, float] = {}
    first: dict[str, tuple[int, float]] = {}   # a small tenant's first task: (enqueued ms, wait)
    for r in results:
        t = r.get("tenant_id")
        timing = r.get("timing") or {}
        wait = timing.get("queue_wait_ms")
        if t is None or wait is None:
            continue
        waits.setdefault(t, []).append(float(wait))
        enq, dispatched = timing.get("enqueued_ms"), timing.get("dispatched_ms")
        if t in small and enq is not None and (t not in first or enq < first[t][0]):
            first[t] = (enq, float(wait))
        if (cut_ms is None or (enq is not None and enq <= cut_ms)) and \
                (window_end_ms is None or (dispatched is not None and dispatched <= window_end_ms)):
            tokens[t] = tokens.get(t, 0.0) + float((r.get("tokens") or {}).get("total") or 0)
    sizes = [float((r.get("tokens") or {}).get("total") or 0) for r in results]
    per_task = sum(sizes) / len(sizes) if sizes else 0.0
    for t, n in (sent if measured is None else measured).items():
        if n > 0:
            demand[t] = n * per_task
    quartile = quartiles_of(tenants)
    small_waits = {t: waits.get(t, []) for t in sent if t in small}
    missing = {t: max(0, sent[t] - len(waits.get(t, []))) for t in small_waits}
    all_small = [w for ws in small_waits.values() for w in ws]
    fair = max_min_fair(demand, sum(tokens.values())) if demand else {}
    ratios = [tokens.get(t, 0.0) / fair[t] for t in demand if fair.get(t)]
    rows = quartile_rows(small_waits, quartile, missing)
    out = {
        "tenants_sending": len(sent), "small_tenants_sending": len(small_waits),
        "tasks": sum(sent.values()), "completed": sum(len(w) for w in waits.values()),
        "small": wait_stats(all_small, sum(missing.values())),
        # each small tenant's first task (it joins at the virtual time) and the others (a task
        # sent before the virtual time reached its previous one's finish tag waits for it)
        "small_first": wait_stats([w for _, w in first.values()]),
        "small_later": wait_stats(_later(small_waits, first)),
        "quartiles": rows,
        "quartile_spread": {k: _spread([[w for t in small_waits if quartile[t] == q for w in small_waits[t]]
                                        for q in range(4)], k) for k in ("wait_p50_ms", "wait_p99_ms")},
        "noise": noise(small_waits, quartile),
        "jain": None if not ratios else round(jain(ratios) or 0.0, 4),
    }
    return out


def _later(small_waits: Mapping[str, Sequence[float]], first: Mapping[str, tuple[int, float]]) -> list[float]:
    out = []
    for t, ws in small_waits.items():
        rest = list(ws)
        if t in first:
            rest.remove(first[t][1])
        out.extend(rest)
    return out


def evaluate(result: dict[str, Any]) -> dict[str, Any]:
    """Targets over the runs (each run: ``scale`` and ``baseline`` scenarios): the small
    tenants' p99 at scale within SMALL_P99_RATIO_MAX x the baseline's (worst run), no
    quartile spread beyond the run's noise (every run), Jain >= JAIN_MIN (worst run)."""
    runs = result["runs"]
    ratios = []
    for run in runs:
        a, b = run["scale"]["small"]["wait_p99_ms"], run["baseline"]["small"]["wait_p99_ms"]
        run["small_p99_ratio"] = None if a is None or not b else round(a / b, 2)
        ratios.append(run["small_p99_ratio"])
    worst_ratio = None if any(r is None for r in ratios) else max(ratios)
    over_noise = []
    for run in runs:
        s = run["scale"]
        for key in ("wait_p50_ms", "wait_p99_ms"):
            spread, limit = s["quartile_spread"][key], s["noise"][key]
            over_noise.append(spread is None or limit is None or spread > limit)
    jains = [run["scale"]["jain"] for run in runs]
    worst_jain = None if any(j is None for j in jains) else min(jains)
    result["targets"] = [
        bench_targets.at_most(
            "small_p99_ratio", worst_ratio, SMALL_P99_RATIO_MAX,
            f"small tenants' queue-wait p99 at scale <= {SMALL_P99_RATIO_MAX:g}x the baseline's: worst run "
            f"{'-' if worst_ratio is None else f'{worst_ratio:.2f}x'}"),
        bench_targets.at_most(
            "quartiles_within_noise", sum(over_noise), 0,
            f"no quartile of ids apart by more than the run's noise (p50 and p99, every run): "
            f"{sum(over_noise)} of {len(over_noise)} over"),
        bench_targets.at_least(
            "jain", worst_jain, JAIN_MIN,
            f"Jain's index of tokens served / max-min fair share >= {JAIN_MIN:g}: worst run "
            f"{'-' if worst_jain is None else f'{worst_jain:.3f}'}"),
    ]
    result["all_targets_pass"] = bench_targets.all_pass(result["targets"])
    return result


# -- text -------------------------------------------------------------------------
def _n(v: Any, fmt: str = ".0f") -> str:
    return "never" if v is None else format(v, fmt)


def _spread_of(values: Sequence[float | None], fmt: str = ".0f") -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    mid = sorted(got)[len(got) // 2]
    return f"{format(mid, fmt)} [{format(min(got), fmt)}..{format(max(got), fmt)}]"


def format_report(result: Mapping[str, Any]) -> str:
    c = result["config"]
    runs = result["runs"]
    out = [f"gateway-dev bench-fairness --scenario zipf: {c['tenants']} normal-tier tenants, Zipf({c['zipf_s']}) "
           f"demand at {c['load']:g}x the pool's capacity ({c['capacity_tasks_per_s']:.1f} tasks/s, {c['tpm']} TPM), "
           f"{c['duration_s']:g} s; baseline {c['baseline_tenants']} tenants; {len(runs)} run(s); "
           f"median [min..max] over runs"]
    for name in ("scale", "baseline"):
        label = f"{c['tenants'] if name == 'scale' else c['baseline_tenants']} tenants"
        out.append(f"  {label}: tasks {_spread_of([r[name]['tasks'] for r in runs])}, tenants sending "
                   f"{_spread_of([r[name]['tenants_sending'] for r in runs])}, small "
                   f"{_spread_of([r[name]['small_tenants_sending'] for r in runs])}")
        out.append(f"    small tenants' wait ms: p50 {_spread_of([r[name]['small']['wait_p50_ms'] for r in runs])}"
                   f"  p99 {_spread_of([r[name]['small']['wait_p99_ms'] for r in runs])}"
                   f"  max {_spread_of([r[name]['small']['wait_max_ms'] for r in runs])}"
                   f"  undispatched {_spread_of([r[name]['small']['undispatched'] for r in runs])}")
        for part, what in (("small_first", "first task"), ("small_later", "later tasks")):
            out.append(f"      {what}: p50 {_spread_of([r[name][part]['wait_p50_ms'] for r in runs])}"
                       f"  p99 {_spread_of([r[name][part]['wait_p99_ms'] for r in runs])}"
                       f"  max {_spread_of([r[name][part]['wait_max_ms'] for r in runs])}"
                       f"  tasks {_spread_of([r[name][part]['tasks'] for r in runs])}")
        out.append(f"    Jain's index: {_spread_of([r[name]['jain'] for r in runs], '.3f')}")
        if name == "scale":
            out.append("    small tenants' waits by quartile of id (ms):")
            for q in range(4):
                rows = [r[name]["quartiles"][q] for r in runs]
                out.append(f"      Q{q + 1}: p50 {_spread_of([x['wait_p50_ms'] for x in rows])}"
                           f"  p99 {_spread_of([x['wait_p99_ms'] for x in rows])}"
                           f"  max {_spread_of([x['wait_max_ms'] for x in rows])}"
                           f"  tasks {_spread_of([x['tasks'] for x in rows])}")
            for key in ("wait_p50_ms", "wait_p99_ms"):
                out.append(f"      spread of {key[5:8]} across quartiles {_spread_of([r[name]['quartile_spread'][key] for r in runs])}"
                           f" vs noise (random splits, p95) {_spread_of([r[name]['noise'][key] for r in runs])}")
    out.append(f"  small tenants' p99 ratio (scale / baseline): "
               f"{_spread_of([r.get('small_p99_ratio') for r in runs], '.2f')} (target <= {SMALL_P99_RATIO_MAX:g}x)")
    out.extend(bench_targets.format_targets(result["targets"]))
    return "\n".join(out)
