"""`gateway-dev bench-dispatch`, part 4: Redis CPU per dispatched task, bucket-bound vs not.

The same end-to-end flow as part 3's ``gateway infer`` (``bench.dispatch_cpu``: submit ->
pick -> upstream -> settle -> release -> result, task events on, one worker process of 8
threads, a private Redis), over many tenants, twice per run, side by side:

* **unconstrained** -- the pool's bucket never waits;
* **bucket-bound** -- the pool's TPM lets ``RATE_PER_S`` tasks a second through (a bucket of
  one second), so the tasks wait for the bucket: the workers sleep until it admits the next
  one (pick.lua's wait, ``poll_step.wait_bells``) instead of picking for nothing at every
  arrival or refund.

The unconstrained flow is offered ``RATE_PER_S`` tasks a second, the bucket-bound one
``OFFERED_X`` times that (arrivals go on while the bucket binds): both take about as long,
so what a worker spends on Redis per second whatever it does (task events, lease renewals,
idle polls) weighs alike in both, and the difference is the cost of waiting.

Redis CPU per dispatched task = the server's CPU (INFO cpu, user + sys) over the window,
less what the server spends idle over as long (its own timers and AOF fsync, measured with no
client busy just before: the bucket-bound window is longer, and that cost is not the flow's),
/ tasks.  Also printed: the raw CPU and the commands' own time (INFO commandstats, all
commands, the idle dispatchers' BLPOPs included) per task.  Target: bucket-bound <= 1.2x
unconstrained (net CPU), the median of the runs (a busy machine moves one run's ratio by
+-20 %: the spread is printed beside it).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import redis

from devtools.bench import redis_stats
from gateway_tasks.core.settings import Settings
from gateway_tasks.core.tokens import count_prompt_tokens
from devtools.bench import dispatch_cpu
from devtools.bench.dispatch_server import prompt_of

TARGET_X = 1.2
PROMPT_B = 600
RATE_PER_S = 10          # tasks a second the bucket-bound pool admits
TENANTS = 1_000
OFFERED_X = 2.0          # tasks are submitted at this many times the bucket-bound rate, in both flows
SENDERS = 4              # threads submitting (one is too slow for that rate on a busy machine)
IDLE_S = 3.0             # how long the server's idle CPU is measured before each flow


def tokens_per_task() -> int:
    """What one of the flow's tasks is debited (its prompt's tokens + max_tokens)."""
    return count_prompt_tokens([{"role": "user", "content": prompt_of(PROMPT_B)}]) \
        + 2 * dispatch_cpu.COMPLETION_TOKENS


def paced(send: Callable[[int], str], per_s: float) -> Callable[[int], str]:
    """``send`` at most ``per_s`` tasks a second (task i not before i / per_s s after the first)."""
    start: list[float] = []

    def go(i: int) -> str:
        if not start:
            start.append(time.monotonic())
        delay = start[0] + i / per_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return send(i)
    return go


def idle_cpu(client: redis.Redis) -> float:
    """The server's CPU seconds per second with no client busy (over IDLE_S)."""
    c0, t0 = redis_stats.cpu_s(client), time.monotonic()
    time.sleep(IDLE_S)
    return max(0.0, (redis_stats.cpu_s(client) - c0) / (time.monotonic() - t0))


def net_cpu_us_per_task(row: dict[str, Any], idle_cpu_per_s: float, tasks: int) -> float:
    """A flow's Redis CPU per task less the server's idle CPU over its window (pure)."""
    return round((1e6 * row["redis_cpu_s"] - 1e6 * idle_cpu_per_s * row["window_s"]) / max(1, tasks), 1)


def run(client: redis.Redis, url: str, base: Settings, *, tasks: int, log_dir: str, runs: int = 3,
        timeout_s: float = 180.0, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    per_task = tokens_per_task()
    tpm = int(RATE_PER_S * per_task * 60)
    prompt = prompt_of(PROMPT_B)
    rows = []
    with dispatch_cpu.fast_simulator() as sim:
        for k in range(runs):
            row: dict[str, Any] = {}
            for name, pool_tpm, burst_s, offered_per_s in (
                    ("unconstrained", dispatch_cpu.FAST, 60.0, RATE_PER_S),
                    ("bucket_bound", tpm, 1.0, OFFERED_X * RATE_PER_S)):
                flow = dispatch_cpu.gateway_infer_flow(client, url, base, prompt, sim.base_url, log_dir,
                                                       tpm=pool_tpm, burst_s=burst_s, tenants=TENANTS,
                                                       name=name)
                flow.send, flow.senders = paced(flow.send, offered_per_s), SENDERS
                idle_cpu_per_s = idle_cpu(client)
                got, _ = dispatch_cpu.run_flow(client, flow, tasks, timeout_s=timeout_s)
                got["idle_cpu_us_per_s"] = round(1e6 * idle_cpu_per_s, 1)
                got["net_cpu_us_per_task"] = net_cpu_us_per_task(got, idle_cpu_per_s, tasks)
                row[name] = got
            un, bb = row["unconstrained"]["net_cpu_us_per_task"], row["bucket_bound"]["net_cpu_us_per_task"]
            row["ratio"] = round(bb / un, 3) if un else None
            rows.append(row)
            progress(f"  run {k + 1}: net Redis CPU per dispatched task {un} us unconstrained, {bb} us "
                     f"bucket-bound ({row['ratio']}x); EVALSHA/task "
                     f"{row['unconstrained']['evalsha_per_task']} vs {row['bucket_bound']['evalsha_per_task']}")
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    return {"tasks": tasks, "tenants": TENANTS, "rate_per_s": RATE_PER_S, "pool_tpm": tpm, "runs": rows,
            "ratio": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}
            if ratios else None}


def format_part(part: dict[str, Any]) -> list[str]:
    out = [f"== 4. Redis CPU per dispatched task, bucket-bound vs unconstrained ({part['tasks']} tasks of "
           f"{part['tenants']} tenants a run; bucket-bound: pool TPM {part['pool_tpm']}, ~{part['rate_per_s']} "
           f"tasks/s, burst 1 s)",
           "     net CPU: INFO cpu over the window less the server's idle CPU over as long; raw: INFO cpu; "
           "commands: INFO commandstats (us per task, unconstrained / bucket-bound)",
           f"     {'run':<4} {'net CPU un':>11} {'net CPU bb':>11} {'x':>6} {'raw CPU':>15} {'commands':>13} "
           f"{'EVALSHA/task':>13} {'window s':>11} {'ok':>9}"]
    for k, r in enumerate(part["runs"]):
        un, bb = r["unconstrained"], r["bucket_bound"]
        out.append(f"     {k + 1:<4} {un['net_cpu_us_per_task']:>11} {bb['net_cpu_us_per_task']:>11} "
                   f"{r['ratio']:>6} {un['redis_cpu_us_per_task']:>7}/{bb['redis_cpu_us_per_task']:<7} "
                   f"{un['commands_us_per_task']:>6}/{bb['commands_us_per_task']:<6} "
                   f"{un['evalsha_per_task']:>6}/{bb['evalsha_per_task']:<6} "
                   f"{un['window_s']:>5}/{bb['window_s']:<5} {un['succeeded']:>4}/{bb['succeeded']:<4}")
    if part["ratio"]:
        r = part["ratio"]
        out.append(f"     ratio over the runs: median {r['median']}, spread {r['min']} .. {r['max']} "
                   f"(target: median <= {TARGET_X}x)")
    return out
