"""`make bench` / `gateway-dev bench [--json]`: the router benchmark.

On the upstream simulator, per policy (fifo, strict, aging, wfq): 5000 long
batch tasks, then normal and VIP backlogs -- all tiers backlogged (phase A:
token shares, upstream TPM utilisation, 429s, dispatch round trips) -- then
steady VIP arrivals under the batch flood (phase B: per-tier queue waits);
and, in the same run, the gateway transport against plain Celery on a no-op
task.  Prints a table per policy and PASS/FAIL per target; ``--json`` prints
one JSON document with every number instead.  ``--runs N`` repeats all of it
N times and reports each headline number as median (min-max) over the runs,
the targets judged on the medians and how many runs passed each.  The last
line is the whole command's wall time.

    python -m devtools.bench.main [--policies wfq] [--seconds 20] [--quick]
                                               [--runs 3] [--json]

Modules: load (one policy's run), plain (plain Celery comparison), headline
(the numbers the targets judge), report (targets and text of one run), spread
and spread_report (several runs), wall_time (the last line).  Redis: the
settings' REDIS_URL, else an embedded redis-server; every policy's run uses its
own key prefix, deleted afterwards.  Worker logs stay in --log-dir (a temporary
directory by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Any, Callable, Iterator, Sequence

import redis

from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import POLICIES, Settings, load_settings
from devtools.bench import command as bench_command
from devtools.bench import load as bench_load
from devtools.bench import plain as bench_plain
from devtools.bench import report as bench_report
from devtools.bench import spread as bench_spread
from devtools.bench import spread_report as bench_spread_report
from devtools.bench.wall_time import Stopwatch
from devtools.run_redis import redis_or_embedded, shown_redis
from gateway_tasks.simulator import SimulatorProcess

QUICK = {"seconds": 4.0, "batch": 1000, "plain_tasks": 1000, "repeats": 1,
         "warmup_s": 2.0, "grace_s": 1.5}
DEFAULTS = {"seconds": 20.0, "batch": 5000, "plain_tasks": 3000, "repeats": 2,
            "warmup_s": 4.0, "grace_s": 3.0}


@contextlib.contextmanager
def redis_for_bench(settings: Settings) -> Iterator[tuple[str, str]]:
    """(url, how it was found): settings/REDIS_URL, else an embedded server."""
    given = settings.redis_url or os.environ.get("REDIS_URL", "")
    with redis_or_embedded(given) as (url, embedded):
        yield url, shown_redis(url, embedded)


def run_on_bench_redis(args: argparse.Namespace, name: str, runner: Callable[..., dict[str, Any]],
                       format_report: Callable[[Any], str]) -> int:
    """A bench command's body: the settings, its worker log folder, the bench Redis, then
    ``runner(base, url, log_dir=, redis_note=, progress=)`` and the report."""
    base = load_settings()
    log_dir = bench_command.log_dir_of(args, name)
    bench_command.progress(f"gateway {name}: worker logs in {log_dir}")
    with redis_for_bench(base) as (url, note):
        result = runner(base, url, log_dir=log_dir, redis_note=note, progress=bench_command.progress)
    return bench_command.finish(args, result, format_report)


def parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if not policies or bad:
        raise ConfigError(f"--policies {text!r}: expected a comma-separated subset of {POLICIES}")
    return policies


def preset_value(args: argparse.Namespace, name: str) -> Any:
    """The flag ``name`` when given, else its --quick or default preset."""
    value = getattr(args, name, None)
    return value if value is not None else (QUICK if args.quick else DEFAULTS)[name]


def load_spec(args: argparse.Namespace) -> bench_load.LoadSpec:
    preset = {name: preset_value(args, name) for name in ("batch", "seconds", "warmup_s", "grace_s")}
    spec = bench_load.LoadSpec(tpm=args.tpm, concurrency=args.concurrency, vip_rate=args.vip_rate,
                               **preset)
    if spec.seconds <= 0 or spec.batch < 1 or spec.vip_rate <= 0 or spec.concurrency < 1:
        raise ConfigError("--seconds, --batch, --vip-rate and --concurrency must be positive")
    return spec


def run_bench(base: Settings, redis_url: str, spec: bench_load.LoadSpec, policies: Sequence[str],
              *, plain_tasks: int, repeats: int, log_dir: str, redis_note: str = "",
              progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every policy on the simulator, then the plain-Celery comparison; the result is JSON-able."""
    clock = Stopwatch()
    base = base.with_(redis_url=redis_url)
    client = redis.Redis.from_url(redis_url)
    result: dict[str, Any] = {
        "config": {
            "redis": redis_note or redis_url,
            "policies": list(policies),
            "load": bench_load.spec_dict(spec),
            "tiers": [{"name": t.name, "share": t.share, "reserved_share": t.reserved_share,
                       "max_wait_ms": t.max_wait_ms} for t in base.tiers],
            "plain_tasks": plain_tasks, "repeats": repeats, "log_dir": log_dir,
        },
        "policies": {},
    }
    try:
        if policies:
            with SimulatorProcess(bench_load.sim_config(spec)) as sim:
                for policy in policies:
                    progress(f"policy {policy}: ~{spec.phase_a_s() + spec.phase_b_s():.0f} s "
                             "of measurement after the backlog is enqueued")
                    run = bench_load.run_policy(policy, spec, base, client, sim, log_dir, progress)
                    result["policies"][policy] = run
                    progress(f"  done in {run['runtime_s']:.0f} s")
        if plain_tasks > 0 and repeats > 0:
            progress(f"plain Celery vs gateway transport: {plain_tasks} no-op tasks x {repeats} "
                     "alternating runs")
            result["plain_celery"] = bench_plain.compare(
                client, base, redis_url, tasks=plain_tasks, repeats=repeats,
                concurrency=spec.concurrency, pool=spec.pool, log_dir=log_dir, progress=progress)
    finally:
        client.close()
    result["runtime_s"] = clock.elapsed_s()
    return bench_report.evaluate(result)


def repeated(runs: int, once: Callable[[], dict[str, Any]],
             progress: Callable[[str], None]) -> dict[str, Any]:
    """``once()`` ``runs`` (>= 1) times: one run's result as it is, several combined
    (bench/spread.py)."""
    results = []
    for i in range(runs):
        if runs > 1:
            progress(f"== run {i + 1} of {runs}")
        results.append(once())
    return results[0] if runs == 1 else bench_spread.combine(results)


def format_result(result: dict[str, Any]) -> str:
    return (bench_spread_report if "runs" in result else bench_report).format_report(result)


def run(args: argparse.Namespace) -> int:
    clock = Stopwatch()
    policies = parse_policies(args.policies)
    spec = load_spec(args)
    if args.runs < 1:
        raise ConfigError(f"--runs {args.runs}: expected at least 1")
    plain_tasks = 0 if args.no_plain else preset_value(args, "plain_tasks")
    repeats = preset_value(args, "repeats")
    base = load_settings()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="gateway-bench-")
    os.makedirs(log_dir, exist_ok=True)
    progress = (lambda msg: print(msg, file=sys.stderr, flush=True))
    progress(f"gateway-dev bench: policies {','.join(policies)}, {args.runs} run(s); "
             f"worker logs in {log_dir}")
    with redis_for_bench(base) as (url, note):
        result = repeated(args.runs, lambda: run_bench(
            base, url, spec, policies, plain_tasks=plain_tasks, repeats=repeats, log_dir=log_dir,
            redis_note=note, progress=progress), progress)
    result["elapsed_s"] = clock.elapsed_s()   # the whole command, Redis start-up included
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    if args.check and not result["all_targets_pass"]:
        return 1
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated policies to run (default %(default)s)")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"long batch tasks enqueued first (default {DEFAULTS['batch']}, "
                             f"--quick {QUICK['batch']})")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"measurement window of each phase (default {DEFAULTS['seconds']:g}, "
                             f"--quick {QUICK['seconds']:g})")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat the whole bench N times and report each headline number as "
                             "median (min-max), the targets judged on the medians (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: smaller backlog and windows, one plain/gateway pair")
    parser.add_argument("--vip-rate", type=float, default=20.0,
                        help="VIP arrivals per second in phase B (default %(default)s)")
    parser.add_argument("--tpm", type=int, default=bench_load.LoadSpec.tpm,
                        help="upstream tokens per minute (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=bench_load.LoadSpec.concurrency,
                        help="worker threads (default %(default)s)")
    parser.add_argument("--plain-tasks", type=int, default=None,
                        help=f"no-op tasks per plain/gateway run (default "
                             f"{DEFAULTS['plain_tasks']}, --quick {QUICK['plain_tasks']})")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"plain/gateway pairs (default {DEFAULTS['repeats']}, "
                             f"--quick {QUICK['repeats']})")
    parser.add_argument("--no-plain", action="store_true",
                        help="skip the plain Celery comparison")
    parser.add_argument("--log-dir", default="", help="where worker logs go (default: a temp dir)")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 when a target fails")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="router benchmark: policies side by side, vs plain "
                                            "Celery, on the upstream simulator",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    from gateway_tasks.cli.main import run_standalone
    return run_standalone("python -m devtools.bench.main", __doc__.split("\n\n")[0],
                          add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
