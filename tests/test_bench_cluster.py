"""`gateway-dev bench-cluster`: pool names spread evenly over the masters, the capacity and
ratio maths on made-up windows, and one small real run -- a 1-master and a 2-master Redis
Cluster on loopback, every task's four scripts run on its pool's own master (the numbers
themselves are measurements, not asserted)."""

from __future__ import annotations

from collections import Counter

import pytest

from devtools.bench import cluster, cluster_report
from devtools.bench.redis_stats import Cost
from devtools.cli import build_parser
from devtools.quotas import for_load
from devtools.redis_cluster import slot_of
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import load_settings


@pytest.mark.parametrize("pools, shards", [(6, 3), (7, 3), (4, 2), (3, 1)])
def test_pools_are_placed_evenly_over_the_masters(pools, shards):
    names = cluster.place_pools(pools, shards)
    assert len(set(names)) == pools
    held = Counter(cluster.shard_of_slot(cluster.pool_slot(n), shards) for n in names)
    assert set(held) == set(range(shards))
    assert max(held.values()) - min(held.values()) <= 1
    # the slot is the one of every key of the pool's dispatch state, whatever the prefix
    assert all(cluster.pool_slot(n) == slot_of(Keys("any-prefix:").bucket(n)) for n in names)


def test_bad_sizes_are_refused():
    with pytest.raises(ConfigError):
        cluster.place_pools(0, 3)
    args = build_parser().parse_args(["bench-cluster", "--shards", "1"])
    with pytest.raises(ConfigError):
        cluster.sizes_from_args(args)
    args = build_parser().parse_args(["bench-cluster", "--quick", "--window-s", "2.5", "--runs", "2"])
    assert args.func is cluster.run
    assert cluster.sizes_from_args(args) == {**cluster.QUICK, "window_s": 2.5, "runs": 2}


def row(shard, pools, tasks, cpu_s, window_s=10.0):
    return cluster_report.shard_row(shard=shard, port=7000 + shard, pools=pools, tasks=tasks, cpu_s=cpu_s,
                                    commands={"evalsha": Cost(4 * tasks, 0)}, reads=4 * tasks, window_s=window_s)


def fake_run(masters, cpu_us_alone, together_tasks, together_cpu_s):
    """A topology's run: ``cpu_us_alone`` per master driven alone (10,000 tasks each)."""
    pools = [[f"p{i}" for i in range(6)]] if masters == 1 else [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    together = [row(i + 1, pools[i], together_tasks[i], together_cpu_s[i]) for i in range(masters)]
    alone = [row(i + 1, pools[i], 10_000, cpu_us_alone[i] * 10_000 / 1e6) for i in range(masters)] \
        if masters > 1 else together
    return cluster_report.topology_run(masters, together, alone, 6)


def test_capacity_sums_the_masters_and_the_slowest_paces_equal_pools():
    got = fake_run(3, [100.0, 100.0, 125.0], [1000, 1000, 1000], [0.1, 0.1, 0.125])
    assert got["alone"]["capacity_per_s"] == 10_000 + 10_000 + 8_000
    # each pool at the pace of the slowest master's: 8,000 / 2 pools a master x 6 pools
    assert got["alone"]["equal_load_capacity_per_s"] == 24_000
    assert got["alone"]["cpu_per_task_max_over_min"] == 1.25
    assert got["together"]["dispatches_per_s"] == 300
    assert got["together"]["tasks_max_over_mean"] == 1.0
    assert got["together"]["cpu_max_over_mean"] == pytest.approx(0.125 / (0.325 / 3), abs=1e-3)
    assert got["together"]["shards"][0]["evalsha_per_task"] == 4.0


def fake_result(alone_3, runs=3):
    one = [fake_run(1, [], [3000], [0.3]) for _ in range(runs)]
    many = [fake_run(3, alone_3, [1100, 1000, 900], [0.14, 0.13, 0.12]) for _ in range(runs)]
    config = {"pools": 6, "shards": 3, "window_s": 10.0, "runs": runs, "backlog": 50, "tenants": 100,
              "warmup": 500, "cores": 2, "redis_version": "7.0.15", "prompt_b": 600, "message_b": 2500,
              "tier": "normal", "scripts_per_task": list(cluster.SCRIPTS)}
    placement = [{"pool": f"p{i}", "slot": 100 * i, "shard": i // 2 + 1} for i in range(6)]
    return cluster_report.evaluate({"config": config, "placement": placement, "runs": {"1": one, "3": many},
                                    "runtime_s": 1.0})


def test_scale_out_is_judged_on_capacity_when_the_drivers_are_the_limit():
    good = fake_result([100.0, 100.0, 100.0])        # 1 master: 100 us a task, 10,000/s
    s = good["summary"]
    assert s["capacity_x"]["median"] == 3.0 and s["equal_load_capacity_x"]["median"] == 3.0
    assert s["driver_bound"] and s["busy_pct_max"] == 3.0          # 0.3 s of CPU in 10 s
    assert s["measured_x"]["median"] == 1.0                          # the drivers' rate, not judged
    assert [t["target"] for t in good["targets"]] == ["capacity_x", "equal_load_capacity_x"]
    assert good["all_targets_pass"]
    text = cluster_report.format_report(good)
    assert "not judged: the Python drivers are the limit" in text and "all targets: PASS" in text
    assert "master 1 of 3" in text and "p0,p1" in text
    # one master twice as dear per task as the others: the equal-load pace halves on it
    bad = fake_result([100.0, 100.0, 200.0])
    assert bad["summary"]["capacity_x"]["median"] == 2.5
    assert bad["summary"]["equal_load_capacity_x"]["median"] == 1.5
    assert not bad["all_targets_pass"] and "FAIL" in cluster_report.format_report(bad)


def test_a_small_real_run_dispatches_every_task_on_its_pool_s_master():
    sizes = {"pools": 2, "shards": 2, "window_s": 0.5, "runs": 1, "backlog": 5, "tenants": 3, "warmup": 10}
    pools = cluster.place_pools(2, 2)
    settings = for_load(load_settings(env={}).with_(key_prefix="gt-test-bench-cluster:",
                                                    pools=tuple(cluster.bench_pool(p) for p in pools)))
    message, _ = cluster.probe_message()
    for masters in (1, 2):
        got = cluster.run_topology(masters, pools, settings, message, sizes)
        for phase in ("together", "alone"):
            rows = got[phase]["shards"]
            assert len(rows) == masters and sorted(p for r in rows for p in r["pools"]) == sorted(pools)
            for r in rows:
                assert r["tasks"] > 0 and r["cpu_us_per_task"] > 0, (masters, phase, r)
                # enqueue, pick, settle, release: four scripts a task, all on this master
                assert r["evalsha_per_task"] == pytest.approx(4.0, abs=0.05), (masters, phase, r)
        assert got["alone"]["capacity_per_s"] > 0
    assert "capacity" in "\n".join(cluster_report.format_run(1, got, 2))
