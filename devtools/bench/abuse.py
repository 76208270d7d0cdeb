"""`gateway-dev bench-abuse`: one tenant flooding beside a victim tenant of each tier.

A vip tenant ("whale") floods through the real REST API and producer while three victims
(one vip, one normal, one batch tenant) keep sending small requests one after another:

* tasks: its whole hourly quota at once, each with ``max_tokens=120000`` (within its
  quotas: the load that raised the deployment to L3 and deferred other tenants when the
  level was not attributed per tenant);
* crons: ``POST /v1/crons`` with large prompts, as many as it is let;
* huge prompts: ``POST /v1/tasks`` bodies of ~4 MB.

Printed per run and as the spread (median, min, max) over ``--runs``: each victim's p50/p99
end-to-end latency (submit to result) before and during the flood, its deferrals (target
0) and other refusals, the highest deployment load level seen and whether the whale was
held, Redis memory growth, and the flooder's outcome (tasks taken / refused by reason, crons
registered / refused by status, huge prompts by status).

    python -m devtools.bench.abuse [--quick] [--runs N] [--attribution on|off] [--json] [--check]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping

import httpx
import redis

from devtools import processes
from devtools.api_thread import ApiThread
from devtools.bench import command as bench_command
from devtools.bench.main import run_on_bench_redis
from devtools.bench.overload_report import percentile
from devtools.measure import spread
from devtools.run_redis import discard_prefix
from gateway_tasks.core.errors import ConfigError, Deferred, GatewayError
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool, Settings
from gateway_tasks.overload.state import read_held, read_history, read_level
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.simulator import SimConfig, SimulatorProcess

Progress = Callable[[str], None]
VICTIMS = (("victim-vip", "vip"), ("victim-normal", "normal"), ("victim-batch", "batch"))
WHALE = "whale"


@dataclass(frozen=True)
class AbuseSpec:
    tpm: int = 600_000
    rpm: int = 60_000
    base_latency_ms: float = 40.0
    ms_per_output_token: float = 0.02
    completion_fraction: float = 0.05   # the whale's 120k-token asks finish with ~6k tokens
    concurrency: int = 16
    before_s: float = 8.0
    during_s: float = 20.0
    victim_gap_s: float = 0.2           # each victim's pause between two requests
    flood_tasks: int = 500              # the whale's tasks (vip's max_tasks_per_hour)
    flood_max_tokens: int = 120_000
    flood_crons: int = 40
    cron_prompt_bytes: int = 500_000
    huge_prompts: int = 6
    huge_prompt_bytes: int = 4_000_000
    runs: int = 3
    attribution: bool = True            # False: overload.held_tenants_max = 0 (the level as before)


QUICK = {"before_s": 5.0, "during_s": 12.0, "runs": 2, "flood_crons": 20, "huge_prompts": 3}


class Victim(threading.Thread):
    """One victim tenant: a small request, its result, a pause, again."""

    def __init__(self, gw: Gateway, tenant: str, spec: AbuseSpec, stop: threading.Event):
        super().__init__(name=f"victim-{tenant}", daemon=True)
        self.gw, self.tenant, self.spec, self.stop_event = gw, tenant, spec, stop
        self.samples: list[tuple[float, float]] = []     # (submitted at, latency ms)
        self.deferred = 0
        self.refused: Counter[str] = Counter()

    def run(self) -> None:
        i = 0
        while not self.stop_event.is_set():
            i += 1
            started = time.monotonic()
            try:
                h = self.gw.submit(self.tenant, f"short question {i} from {self.tenant}", max_tokens=30,
                                   on_defer="refuse")   # a victim waits for its answer: deferral counted
                h.get(timeout=120)
                self.samples.append((started, (time.monotonic() - started) * 1000.0))
            except Deferred:
                self.deferred += 1
            except GatewayError as exc:
                self.refused[type(exc).__name__] += 1
            except Exception as exc:  # noqa: BLE001 -- a result's own error, counted
                self.refused[type(exc).__name__] += 1
            self.stop_event.wait(self.spec.victim_gap_s)

    def latencies(self, since: float, until: float) -> dict[str, float | None]:
        ms = [lat for at, lat in self.samples if since <= at < until]
        return {"n": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}


def flood_tasks(api: str, key: str, spec: AbuseSpec, out: dict[str, Any]) -> None:
    statuses: Counter[str] = Counter()
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        for i in range(spec.flood_tasks):
            r = c.post("/tasks", json={"messages": f"summarise report {i} in every detail",
                                       "max_tokens": spec.flood_max_tokens})
            statuses[_answer(r)] += 1
    out["tasks"] = dict(statuses)


def flood_crons(api: str, key: str, spec: AbuseSpec, out: dict[str, Any]) -> None:
    statuses: Counter[str] = Counter()
    prompt = "x " * (spec.cron_prompt_bytes // 2)
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        for i in range(spec.flood_crons):
            r = c.post("/crons", json={"task_id": f"flood-{i}", "cron": "* * * * *",
                                       "messages": prompt, "max_tokens": 1_000_000_000})
            statuses[_answer(r)] += 1
    out["crons"] = dict(statuses)


def flood_huge(api: str, key: str, spec: AbuseSpec, out: dict[str, Any]) -> None:
    statuses: Counter[str] = Counter()
    body = '{"messages": "' + "word " * (spec.huge_prompt_bytes // 5) + '"}'
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}",
                                             "Content-Type": "application/json"}, timeout=60) as c:
        for _ in range(spec.huge_prompts):
            statuses[_answer(c.post("/tasks", content=body))] += 1
    out["huge_prompts"] = dict(statuses)


def _answer(r: httpx.Response) -> str:
    """A response as '<status> <error type>' (the type when the body names one)."""
    kind = ""
    if r.status_code >= 400:
        try:
            kind = (r.json().get("error") or {}).get("type") or ""
        except ValueError:
            kind = ""
    return f"{r.status_code} {kind}".strip()


def one_run(base: Settings, redis_url: str, spec: AbuseSpec, sim_url: str, log_dir: str, n: int,
            progress: Progress) -> dict[str, Any]:
    prefix = f"gt-bench-abuse-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(redis_url)
    pool = Pool("default", base_url=sim_url, api_key="sk-bench", models=("gpt-4o-mini",),
                tpm=spec.tpm, rpm=spec.rpm)
    # the victims keep to their quotas however long the bench runs: normal and batch tiers'
    # hourly quotas raised (vip's stays: the whale floods exactly its quota)
    tiers = tuple(t if t.name == "vip" else replace(t, max_tasks_per_hour=100_000) for t in base.tiers)
    overload = base.overload if spec.attribution else replace(base.overload, held_tenants_max=0)
    settings = base.with_(redis_url=redis_url, key_prefix=prefix, pools=(pool,), tiers=tiers, overload=overload)
    gw = Gateway(settings, client=client)
    keys = Keys(prefix)
    worker = None
    stop = threading.Event()
    try:
        for tenant, tier in VICTIMS:
            gw.register_tenant(tenant, tier)
        whale_key = gw.register_tenant(WHALE, "vip")
        worker = processes.worker(settings, concurrency=spec.concurrency, name=f"bench-abuse-{n}",
                                  log_path=os.path.join(log_dir, f"worker-abuse-{n}.log")).start()
        processes.wait_for_workers(gw.app, 1, timeout_s=60.0)
        with ApiThread(gw) as api:
            victims = [Victim(gw, tenant, spec, stop) for tenant, _ in VICTIMS]
            t0 = time.monotonic()
            for v in victims:
                v.start()
            progress(f"  run {n}: victims alone for {spec.before_s:g} s")
            time.sleep(spec.before_s)
            memory_before = int(client.info("memory")["used_memory"])
            flood_start = time.monotonic()
            outcome: dict[str, Any] = {}
            floods = [threading.Thread(target=f, args=(api.base_url, whale_key, spec, outcome), daemon=True)
                      for f in (flood_tasks, flood_crons, flood_huge)]
            progress(f"  run {n}: the whale floods for {spec.during_s:g} s")
            for f in floods:
                f.start()
            levels, held_seen = [], 0
            while time.monotonic() - flood_start < spec.during_s:
                levels.append(read_level(client, keys))
                held_seen = max(held_seen, int((read_held(client, keys).get(WHALE) or {}).get("level", 0)))
                time.sleep(0.5)
            flood_end = time.monotonic()
            memory_during = int(client.info("memory")["used_memory"])
            stop.set()
            for f in floods:
                f.join(timeout=120)
            for v in victims:
                v.join(timeout=150)
            changes = [f"L{h['from']}->L{h['to']}: {h['reason']}" for h in read_history(client, keys, 50)]
            whale_done = sum(int(v) for k, v in client.hgetall(keys.stats("default")).items()
                             if k.decode() == "completed:vip") - sum(len(v.samples) for v in victims[:1])
        return {
            "victims": {v.tenant: {"before": v.latencies(t0, flood_start),
                                   "during": v.latencies(flood_start, flood_end),
                                   "deferred": v.deferred, "refused": dict(v.refused)} for v in victims},
            "max_level": max(levels) if levels else 0,
            "level_changes": changes,
            "whale_held_level": held_seen,
            "redis_memory_growth_mb": round((memory_during - memory_before) / 1e6, 1),
            "flooder": {**outcome, "vip_tasks_completed_during": max(0, whale_done)},
        }
    finally:
        stop.set()
        if worker is not None:
            worker.stop()
        discard_prefix(client, prefix)
        gw.app.close()
        client.close()


def run_abuse(base: Settings, redis_url: str, spec: AbuseSpec, *, log_dir: str, redis_note: str = "",
              progress: Progress = lambda _: None) -> dict[str, Any]:
    started = time.monotonic()
    sim_cfg = SimConfig(tpm=spec.tpm, rpm=spec.rpm, base_latency_ms=spec.base_latency_ms,
                        ms_per_output_token=spec.ms_per_output_token,
                        completion_fraction=spec.completion_fraction, models=("gpt-4o-mini",))
    runs = []
    with SimulatorProcess(sim_cfg) as sim:
        for n in range(1, spec.runs + 1):
            runs.append(one_run(base, redis_url, spec, sim.base_url, log_dir, n, progress))
    return evaluate({"config": {**asdict(spec), "redis": redis_note or redis_url}, "runs": runs,
                     "runtime_s": round(time.monotonic() - started, 1)})


def evaluate(result: dict[str, Any]) -> dict[str, Any]:
    """The spread over the runs of each victim's figures, and the target: no victim deferred."""
    runs = result["runs"]
    victims: dict[str, Any] = {}
    for tenant, _ in VICTIMS:
        rows = [r["victims"][tenant] for r in runs]
        victims[tenant] = {f"{phase}_{q}": spread([row[phase][q] for row in rows])
                           for phase in ("before", "during") for q in ("p50_ms", "p99_ms")}
        victims[tenant]["deferred"] = spread([row["deferred"] for row in rows])
    deferred = sum(row["deferred"] for r in runs for row in r["victims"].values())
    return {**result, "spread": {"victims": victims,
                                 "max_level": spread([r["max_level"] for r in runs]),
                                 "redis_memory_growth_mb": spread([r["redis_memory_growth_mb"] for r in runs])},
            "targets": {"victims_deferred": {"value": deferred, "target": 0, "pass": deferred == 0}},
            "all_targets_pass": deferred == 0}


def _ms(s: Mapping[str, Any]) -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})"


def format_report(result: Mapping[str, Any]) -> str:
    c = result["config"]
    lines = [f"bench-abuse: {len(result['runs'])} runs, per-tenant attribution {'on' if c.get('attribution', True) else 'off'}, "
             f"pool TPM {c['tpm']}, victims alone {c['before_s']:g} s, "
             f"then the whale floods {c['during_s']:g} s ({c['flood_tasks']} tasks of max_tokens "
             f"{c['flood_max_tokens']}, {c['flood_crons']} crons of {c['cron_prompt_bytes'] // 1000} KB, "
             f"{c['huge_prompts']} bodies of {c['huge_prompt_bytes'] // 1_000_000} MB)",
             "victims: end-to-end latency ms, median (min-max) over the runs",
             f"  {'tenant':<15}{'p50 before':>18}{'p50 during':>18}{'p99 before':>18}{'p99 during':>18}"
             f"{'deferred':>10}"]
    for tenant, v in result["spread"]["victims"].items():
        lines.append(f"  {tenant:<15}{_ms(v['before_p50_ms']):>18}{_ms(v['during_p50_ms']):>18}"
                     f"{_ms(v['before_p99_ms']):>18}{_ms(v['during_p99_ms']):>18}"
                     f"{v['deferred']['median']:>10g}")
    s = result["spread"]
    lines.append(f"deployment level during the flood: max L{s['max_level']['median']:g} "
                 f"(runs {s['max_level']['min']:g}-{s['max_level']['max']:g})")
    lines.append(f"Redis memory growth during the flood: {s['redis_memory_growth_mb']['median']:g} MB "
                 f"({s['redis_memory_growth_mb']['min']:g}-{s['redis_memory_growth_mb']['max']:g})")
    for i, r in enumerate(result["runs"], 1):
        f = r["flooder"]
        refused = {t: row["refused"] for t, row in r["victims"].items() if row["refused"]}
        lines.append(f"run {i}: whale held at L{r['whale_held_level']}; tasks {f.get('tasks')}; "
                     f"crons {f.get('crons')}; huge prompts {f.get('huge_prompts')}; "
                     f"vip tasks completed during {f['vip_tasks_completed_during']}"
                     + (f"; victims refused {refused}" if refused else ""))
        for change in r.get("level_changes", []):
            lines.append(f"    {change}")
    t = result["targets"]["victims_deferred"]
    lines.append(f"target: victims deferred {t['value']} (target {t['target']}): {'PASS' if t['pass'] else 'FAIL'}")
    lines.append(f"runtime {result['runtime_s']:g} s")
    return "\n".join(lines)


def spec_from_args(args: argparse.Namespace) -> AbuseSpec:
    spec = AbuseSpec()
    if args.quick:
        spec = replace(spec, **QUICK)
    if args.runs is not None:
        spec = replace(spec, runs=args.runs)
    if args.during_s is not None:
        spec = replace(spec, during_s=args.during_s)
    if args.attribution == "off":
        spec = replace(spec, attribution=False)
    if spec.runs < 1 or spec.during_s <= 0:
        raise ConfigError("--runs and --during-s must be positive")
    return spec


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    return run_on_bench_redis(args, "bench-abuse", lambda base, url, **kw: run_abuse(base, url, spec, **kw),
                              format_report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=None,
                        help=f"runs (default {AbuseSpec.runs}, --quick {QUICK['runs']})")
    parser.add_argument("--during-s", type=float, default=None,
                        help=f"seconds of flood per run (default {AbuseSpec.during_s:g}, --quick {QUICK['during_s']:g})")
    parser.add_argument("--attribution", choices=("on", "off"), default="on",
                        help="per-tenant attribution of the load level (off: overload.held_tenants_max = 0, "
                             "to compare; default %(default)s)")
    bench_command.add_common_arguments(parser)


def register(subparsers: Any) -> None:
    bench_command.register(subparsers, "bench-abuse",
                           "one tenant flooding (tasks, crons, huge prompts) beside a victim of each tier",
                           __doc__, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return bench_command.standalone("devtools.bench.abuse", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
