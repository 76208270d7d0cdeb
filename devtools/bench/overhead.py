"""`gateway-dev bench-overhead`: the latency and throughput a caller feels, beside the
upstream path and the LiteLLM proxy, measured in one run on the same requests.

It starts a Redis (REDIS_URL, else an embedded one), the upstream simulator answering
at once (``base_latency_ms`` 0, no time per token), the process layout docs/scaling.md
recommends for 2 cores -- one ``gateway api`` process and two workers of 8 threads
(``--worker-processes``, ``--worker-threads``) -- a VIP tenant, and -- unless ``--no-litellm`` -- the LiteLLM proxy,
installed from PyPI into a virtual environment of the bench's own (``--litellm-venv``;
its first run takes a minute or two) and configured with the same simulator as its
upstream and a TPM limit, so it too checks a quota on every call.  Where LiteLLM cannot
be installed or does not start, its columns say why and the rest runs.

Every run measures three targets -- ``direct`` (the simulator itself), ``gateway``
(``POST /v1/chat/completions`` through the queue) and ``litellm`` -- with the same
16-token chat request:

* **1 client**: requests one at a time, the targets interleaved request by request; then
  the same with ``stream: true``, timed to the first server-sent events (time to first
  token);
* **N clients** (``--clients``, 32): for each target in turn, N concurrent clients for
  ``--seconds`` (the order rotates from run to run).

Added latency = the target's p50 / p99 less the direct path's in the same phase and
run.  Each process's CPU (``/proc/<pid>/stat``; Redis: ``INFO cpu``) over a phase,
divided by the requests it served, shows where the ceiling is.  ``--runs`` (3) repeats
everything and prints each figure as median (min–max).

The clients are one asyncio process on the same machine (``devtools.bench.http_load``: a
lean HTTP/1.1 keep-alive client, a fraction of httpx's CPU per request): they take CPU from
what they measure, alike for every target; the report shows how much ("clients").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import redis

from devtools import processes
from devtools.bench import command as bench_command
from devtools.bench import http_load
from devtools.bench.http_load import Connection, HttpError, Post
from devtools.bench.main import redis_for_bench
from devtools.measure import spread
from devtools.quotas import for_load
from devtools.run_redis import discard_prefix
from gateway_tasks.core.settings import load_settings
from gateway_tasks.local.ports import free_port
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.simulator import SimConfig, SimulatorProcess

MODEL = "gpt-4o-mini"
REQUEST = {"model": MODEL, "max_tokens": 16,
           "messages": [{"role": "user", "content": "Say hello to the bench in a few short words."}]}
STREAMED = {**REQUEST, "stream": True}   # time to first token: the first server-sent events
UPSTREAM_KEY = "sk-bench-overhead"
TARGETS = ("direct", "gateway", "litellm")
# the gateway's added latency targets (p50 / p99 at one client), requests/s at N clients
TARGET_ADDED_P50_MS = 3.0
TARGET_ADDED_P99_MS = 10.0
TARGET_ADDED_FIRST_TOKEN_MS = 5.0
TARGET_ADDED_P99_LOADED_MS = 25.0
TARGET_RPS = 400.0
DEFAULTS = {"runs": 3, "sequential": 300, "streamed": 100, "clients": 32, "seconds": 10.0, "worker_processes": 2,
            "worker_threads": 8}
QUICK = {"runs": 1, "sequential": 60, "streamed": 20, "clients": 8, "seconds": 3.0, "worker_processes": 2,
         "worker_threads": 8}
LITELLM_VENV = Path(".bench") / "litellm-venv"
MIN_CPU_SHOWN_MS = 0.02   # a process idle for a target (its pollers only) is left out of its CPU line


# -- the processes ------------------------------------------------------------------------

def proc_cpu_s(pid: int) -> float | None:
    """A process's CPU seconds so far (user + system, every thread), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def litellm_python(venv: Path, progress: Callable[[str], None]) -> tuple[str | None, str]:
    """The interpreter of a venv holding ``litellm[proxy]`` (made on first use), or why not."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import litellm.proxy.proxy_server"],
                                          capture_output=True).returncode == 0:
        return str(python), ""
    progress(f"installing litellm[proxy] into {venv} (once; a minute or two)")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", "litellm[proxy]"],
                              capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not install litellm[proxy]: {exc}"
    if done.returncode != 0:
        return None, f"could not install litellm[proxy]: {done.stderr.strip().splitlines()[-1:]}"
    return str(python), ""


def litellm_config(sim_url: str, tpm: int, rpm: int) -> str:
    """The proxy's config: one model on the simulator, with the pool's TPM/RPM as limits."""
    return json.dumps({
        "model_list": [{"model_name": MODEL, "litellm_params": {
            "model": f"openai/{MODEL}", "api_base": sim_url, "api_key": UPSTREAM_KEY,
            "tpm": tpm, "rpm": rpm}}],
        "router_settings": {"enable_pre_call_checks": True},
        "litellm_settings": {"drop_params": True, "telemetry": False},
    })


@dataclass
class Target:
    name: str
    url: str                       # the chat completions URL
    key: str
    pid: int | None = None         # the process that serves it (its CPU is counted)
    note: str = ""                 # why it is not measured ("" = measured)


@dataclass
class Phase:
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)   # process -> CPU seconds in the phase


# -- the clients -------------------------------------------------------------------------

async def _one(conn: Connection, phase: Phase) -> None:
    started = time.perf_counter()
    try:
        status, _ = await conn.send()
        ok = status == 200
    except HttpError:
        ok = False
    if ok:
        phase.latencies_ms.append((time.perf_counter() - started) * 1000)
    else:
        phase.errors += 1


async def _first(conn: Connection, phase: Phase) -> None:
    """One streamed request: its time to the first events counted."""
    try:
        status, first_s, _ = await conn.first_part()
    except HttpError:
        status, first_s = 0, 0.0
    if status == 200:
        phase.latencies_ms.append(first_s * 1000)
    else:
        phase.errors += 1


def _connection(target: Target, body: dict[str, Any] = REQUEST) -> Connection:
    return Connection(Post.of(target.url, body, target.key))


async def sequential(targets: list[Target], n: int, streamed: bool = False) -> dict[str, Phase]:
    """``n`` requests to each target, one at a time, interleaved; ``streamed``: stream=true
    requests, timed to their first events (time to first token)."""
    phases = {t.name: Phase() for t in targets}
    conns = {t.name: _connection(t, STREAMED if streamed else REQUEST) for t in targets}
    one = _first if streamed else _one
    for t in targets:                       # warm each connection first
        await one(conns[t.name], Phase())
    for _ in range(n):
        for t in targets:
            await one(conns[t.name], phases[t.name])
    for conn in conns.values():
        conn.close()
    return phases


async def concurrent(target: Target, clients: int, seconds: float) -> Phase:
    phase = Phase()
    conns = [_connection(target) for _ in range(clients)]
    await asyncio.gather(*(_one(c, Phase()) for c in conns))   # warm
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()

    async def loop(conn: Connection) -> None:
        while time.perf_counter() < deadline:
            await _one(conn, phase)
    await asyncio.gather(*(loop(c) for c in conns))
    phase.seconds = time.perf_counter() - started
    for conn in conns:
        conn.close()
    return phase


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


# -- one run -----------------------------------------------------------------------------

def _cpu_snapshot(pids: dict[str, int | None], r: redis.Redis) -> dict[str, float]:
    out = {name: proc_cpu_s(pid) for name, pid in pids.items() if pid}
    out["redis"] = redis_cpu_s(r)
    out["clients"] = time.process_time()       # this process: the load's own CPU
    return {k: v for k, v in out.items() if v is not None}


def _measured(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before[k], 3) for k in before if k in after}


def run_once(targets: list[Target], pids: dict[str, int | None], r: redis.Redis, spec: dict[str, Any],
             rotate: int) -> dict[str, Any]:
    live = [t for t in targets if not t.note]
    out: dict[str, Any] = {"sequential": {}, "streamed": {}, "concurrent": {}}
    before = _cpu_snapshot(pids, r)
    seq = http_load.run(lambda: sequential(live, spec["sequential"]))
    cpu = _measured(before, _cpu_snapshot(pids, r))
    for name, phase in seq.items():
        out["sequential"][name] = _summary(phase, None)
    out["sequential"]["cpu_s"] = cpu
    out["streamed"] = {name: _summary(phase, None) for name, phase in
                       http_load.run(lambda: sequential(live, spec["streamed"], streamed=True)).items()}
    order = live[rotate % len(live):] + live[:rotate % len(live)]
    for t in order:
        before = _cpu_snapshot(pids, r)
        phase = http_load.run(lambda: concurrent(t, spec["clients"], spec["seconds"]))
        out["concurrent"][t.name] = _summary(phase, _measured(before, _cpu_snapshot(pids, r)))
    return out


def _summary(phase: Phase, cpu: dict[str, float] | None) -> dict[str, Any]:
    done = len(phase.latencies_ms)
    out: dict[str, Any] = {"requests": done, "errors": phase.errors,
                           "p50_ms": pct(phase.latencies_ms, 0.5), "p99_ms": pct(phase.latencies_ms, 0.99)}
    if phase.seconds:
        out["requests_per_s"] = round(done / phase.seconds, 1)
    if cpu is not None:
        out["cpu_ms_per_request"] = {k: round(v * 1000 / done, 3) if done else None for k, v in cpu.items()}
    return out


def added(run: dict[str, Any], phase: str, target: str) -> tuple[float | None, float | None]:
    """The target's p50 and p99 less the direct path's, in one phase of one run."""
    t, d = run[phase].get(target), run[phase].get("direct")
    if not t or not d or t["p50_ms"] is None or d["p50_ms"] is None:
        return None, None
    return round(t["p50_ms"] - d["p50_ms"], 2), round(t["p99_ms"] - d["p99_ms"], 2)


def combine(runs: list[dict[str, Any]], targets: list[Target]) -> dict[str, Any]:
    """Per target and phase, each figure's spread over the runs; the targets, on the medians."""
    table: dict[str, Any] = {}
    for t in targets:
        if t.note:
            table[t.name] = {"skipped": t.note}
            continue
        row: dict[str, Any] = {}
        for phase in ("sequential", "streamed", "concurrent"):
            if not all(r.get(phase, {}).get(t.name) for r in runs):
                continue
            p50s = [r[phase][t.name]["p50_ms"] for r in runs if r[phase].get(t.name)]
            p99s = [r[phase][t.name]["p99_ms"] for r in runs if r[phase].get(t.name)]
            row[phase] = {"p50_ms": spread(p50s), "p99_ms": spread(p99s),
                          "errors": sum(r[phase][t.name]["errors"] for r in runs if r[phase].get(t.name))}
            if t.name != "direct":
                adds = [added(r, phase, t.name) for r in runs]
                row[phase]["added_p50_ms"] = spread([a[0] for a in adds])
                row[phase]["added_p99_ms"] = spread([a[1] for a in adds])
            if phase == "concurrent":
                row[phase]["requests_per_s"] = spread([r[phase][t.name]["requests_per_s"] for r in runs])
                row[phase]["cpu_ms_per_request"] = cpu_spread([r[phase][t.name] for r in runs
                                                                if r[phase].get(t.name)])
        table[t.name] = row
    return table


def cpu_spread(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per process, its CPU per request over the runs (spread); the workers' summed as "workers"."""
    per_run: list[dict[str, float]] = []
    for phase in phases:
        cpu = {k: v for k, v in (phase.get("cpu_ms_per_request") or {}).items() if v is not None}
        workers = [v for k, v in cpu.items() if k.startswith("worker")]
        if len(workers) > 1:
            cpu["workers"] = sum(workers)
        per_run.append(cpu)
    names = sorted({k for cpu in per_run for k in cpu})
    return {k: spread([cpu[k] for cpu in per_run if k in cpu]) for k in names}


def judge(table: dict[str, Any]) -> list[dict[str, Any]]:
    gw = table.get("gateway", {})
    if "sequential" not in gw:
        return []
    seq, con = gw["sequential"], gw["concurrent"]
    out = [
        {"target": "added p50, 1 client", "value": seq["added_p50_ms"]["median"], "limit": f"<= {TARGET_ADDED_P50_MS} ms",
         "ok": seq["added_p50_ms"]["median"] <= TARGET_ADDED_P50_MS},
        {"target": "added p99, 1 client", "value": seq["added_p99_ms"]["median"], "limit": f"<= {TARGET_ADDED_P99_MS} ms",
         "ok": seq["added_p99_ms"]["median"] <= TARGET_ADDED_P99_MS},
        {"target": "added time to first token, 1 client", "value": gw["streamed"]["added_p50_ms"]["median"],
         "limit": f"<= {TARGET_ADDED_FIRST_TOKEN_MS} ms (p50)",
         "ok": (gw["streamed"]["added_p50_ms"]["median"] or 1e9) <= TARGET_ADDED_FIRST_TOKEN_MS},
        {"target": "requests/s, N clients", "value": con["requests_per_s"]["median"], "limit": f">= {TARGET_RPS:g}",
         "ok": con["requests_per_s"]["median"] >= TARGET_RPS},
        {"target": "added p99, N clients", "value": con["added_p99_ms"]["median"],
         "limit": f"<= {TARGET_ADDED_P99_LOADED_MS} ms", "ok": con["added_p99_ms"]["median"] <= TARGET_ADDED_P99_LOADED_MS},
    ]
    ll = table.get("litellm", {})
    if "concurrent" in ll:
        out.append({"target": "requests/s, N clients, vs LiteLLM", "value": con["requests_per_s"]["median"],
                    "limit": f">= {ll['concurrent']['requests_per_s']['median']}",
                    "ok": con["requests_per_s"]["median"] >= ll["concurrent"]["requests_per_s"]["median"]})
    return out


def measure(url: str, spec: dict[str, Any], log_dir: str, litellm_venv: Path | None,
            progress: Callable[[str], None]) -> dict[str, Any]:
    prefix = f"gt-overhead-{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(url)
    sim_config = SimConfig(base_latency_ms=0, ms_per_output_token=0, tpm=50_000_000, rpm=1_000_000,
                           api_key=UPSTREAM_KEY)
    children: list[Any] = []
    try:
        with SimulatorProcess(sim_config) as sim:
            pools = [{"name": "default", "base_url": sim.base_url, "api_key": UPSTREAM_KEY,
                      "tpm": 50_000_000, "rpm": 1_000_000, "models": [MODEL]}]
            settings = for_load(load_settings(env={"REDIS_URL": url, "GATEWAY_KEY_PREFIX": prefix,
                                                   "GATEWAY_POOLS_JSON": json.dumps(pools)}))
            gw = Gateway(settings)
            key = gw.register_tenant("bench-vip", "vip")
            workers = [processes.worker(settings, concurrency=spec["worker_threads"], name=f"w{i}",
                                        log_path=os.path.join(log_dir, f"worker{i}.log")).start()
                       for i in range(spec["worker_processes"])]
            children.extend(workers)
            api_port = free_port()
            api = processes.api(processes.child_env(settings), port=api_port,
                                log_path=os.path.join(log_dir, "api.log")).start()
            children.append(api)
            targets = [Target("direct", f"{sim.base_url}/chat/completions", UPSTREAM_KEY, sim.proc.pid),
                       Target("gateway", f"http://127.0.0.1:{api_port}/v1/chat/completions", key, api.process.pid)]
            ll = _start_litellm(sim.base_url, litellm_venv, log_dir, progress, children)
            targets.append(ll)
            processes.wait_for_workers(gw.app, spec["worker_processes"])
            _wait_http(f"http://127.0.0.1:{api_port}/healthz")
            pids = {"simulator": sim.proc.pid, "api": api.process.pid, "litellm": ll.pid,
                    **{f"worker{i}": w.process.pid for i, w in enumerate(workers)}}
            runs = []
            for i in range(spec["runs"]):
                progress(f"run {i + 1} of {spec['runs']}")
                runs.append(run_once(targets, pids, r, spec, i))
            table = combine(runs, targets)
            return {"spec": spec, "runs": runs, "table": table, "targets": judge(table),
                    "layout": layout_of(spec)}
    finally:
        for child in reversed(children):
            child.stop()
        discard_prefix(r, prefix)


def layout_of(spec: dict[str, Any]) -> str:
    n = spec["worker_processes"]
    return (f"one `gateway api` process, {'one worker' if n == 1 else f'{n} workers'} "
            f"(-P threads -c {spec['worker_threads']})")


def _wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:g} s")


def _start_litellm(sim_url: str, venv: Path | None, log_dir: str, progress: Callable[[str], None],
                   children: list[Any]) -> Target:
    if venv is None:
        return Target("litellm", "", "", note="--no-litellm")
    python, why = litellm_python(venv, progress)
    if python is None:
        return Target("litellm", "", "", note=why)
    port = free_port()
    config = Path(tempfile.mkdtemp(prefix="gateway-litellm-")) / "config.yaml"
    config.write_text(litellm_config(sim_url, 50_000_000, 1_000_000))   # JSON is YAML
    master = f"sk-{uuid.uuid4().hex}"
    litellm_bin = Path(python).parent / "litellm"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "REDIS_"))}
    env.update(LITELLM_MASTER_KEY=master, LITELLM_LOG="ERROR", LITELLM_TELEMETRY="False")
    child = processes.Child([str(litellm_bin), "--config", str(config), "--port", str(port),
                             "--host", "127.0.0.1", "--num_workers", "1"], env,
                            os.path.join(log_dir, "litellm.log")).start()
    children.append(child)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health/liveliness", 120)
    except RuntimeError as exc:
        return Target("litellm", "", "", note=f"the proxy did not start ({exc}; see {log_dir}/litellm.log)")
    return Target("litellm", f"http://127.0.0.1:{port}/v1/chat/completions", master, child.process.pid)


# -- the report ----------------------------------------------------------------------------

def _s(tree: dict[str, Any] | None, digits: int = 1) -> str:
    if not tree or tree.get("median") is None:
        return "-"
    return f"{tree['median']:.{digits}f} ({tree['min']:.{digits}f}–{tree['max']:.{digits}f})"


def format_report(result: dict[str, Any]) -> str:
    spec, table = result["spec"], result["table"]
    lines = [f"gateway-dev bench-overhead: {spec['runs']} runs; {result['layout']}; simulator at 0 ms; "
             f"median (min–max)", ""]
    lines.append(f"{'target':<9} {'1 client p50 / p99 ms':>28} {'added p50 / p99 ms':>30} "
                 f"{spec['clients']} clients: {'req/s':>22} {'added p50 / p99 ms':>30}")
    for name, row in table.items():
        if "skipped" in row:
            lines.append(f"{name:<9} skipped: {row['skipped']}")
            continue
        seq, con = row["sequential"], row["concurrent"]
        lines.append(f"{name:<9} {_s(seq['p50_ms'])+' / '+_s(seq['p99_ms']):>28} "
                     f"{(_s(seq.get('added_p50_ms'))+' / '+_s(seq.get('added_p99_ms'))) if name != 'direct' else '':>30} "
                     f"{'':>11}{_s(con['requests_per_s'], 0):>22} "
                     f"{(_s(con.get('added_p50_ms'))+' / '+_s(con.get('added_p99_ms'))) if name != 'direct' else '':>30}")
    lines += ["", "time to first token (stream=true), 1 client, p50 / p99 ms, and added:"]
    for name, row in table.items():
        st = row.get("streamed")
        if st:
            lines.append(f"  {name:<9} {_s(st['p50_ms'])} / {_s(st['p99_ms'])}"
                         + (f"   added {_s(st.get('added_p50_ms'))} / {_s(st.get('added_p99_ms'))}"
                            if name != "direct" else ""))
    lines += ["", f"CPU ms per request at {spec['clients']} clients, per process, median (min–max) "
                  f"(clients: the load generator itself):"]
    for name, row in table.items():
        cpu = (row.get("concurrent") or {}).get("cpu_ms_per_request")
        if cpu:
            lines.append(f"  {name:<9} " + ", ".join(f"{k} {_s(v, 2)}" for k, v in cpu.items()
                                                      if (v.get("median") or 0) >= MIN_CPU_SHOWN_MS))
    lines += ["", "targets (gateway, judged on the medians):"]
    for t in result["targets"]:
        lines.append(f"  {'PASS' if t['ok'] else 'FAIL'}  {t['target']}: {t['value']} ({t['limit']})")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench_command.add_common_arguments(parser)
    parser.add_argument("--runs", type=int, default=None, help="repeats (default 3)")
    parser.add_argument("--sequential", type=int, default=None, help="requests per target at 1 client")
    parser.add_argument("--streamed", type=int, default=None,
                        help="stream=true requests per target at 1 client (time to first token)")
    parser.add_argument("--clients", type=int, default=None, help="concurrent clients (default 32)")
    parser.add_argument("--seconds", type=float, default=None, help="each target's time at N clients")
    parser.add_argument("--worker-processes", type=int, default=None, help="worker processes (default 2)")
    parser.add_argument("--worker-threads", type=int, default=None, help="each worker's -c (default 8)")
    parser.add_argument("--no-litellm", action="store_true", help="leave the LiteLLM proxy out")
    parser.add_argument("--litellm-venv", default=str(LITELLM_VENV),
                        help="where litellm[proxy] is installed for the bench (made on first use)")


def run(args: argparse.Namespace) -> int:
    preset = QUICK if args.quick else DEFAULTS
    spec = {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in preset.items()}
    log_dir = bench_command.log_dir_of(args, "overhead")
    with redis_for_bench(load_settings()) as (url, note):
        result = measure(url, spec, log_dir, None if args.no_litellm else Path(args.litellm_venv),
                         bench_command.progress)
        result["redis"] = note
    result["all_targets_pass"] = all(t["ok"] for t in result["targets"])
    return bench_command.finish(args, result, format_report)


def register(subparsers: Any) -> None:
    bench_command.register(subparsers, "bench-overhead",
                           "added latency and requests/s: direct vs gateway vs LiteLLM proxy", __doc__,
                           add_arguments, run)


if __name__ == "__main__":
    sys.exit(bench_command.standalone("devtools.bench.overhead", __doc__, add_arguments, run, None))
