"""devtools/bench/fairness_zipf_report.py: the pure figures of `gateway-dev bench-fairness --scenario zipf`."""

from __future__ import annotations

import pytest

from devtools.bench.fairness_zipf_report import (jain, max_min_fair, quartiles_of, scenario, small_tenants,
                                                 zipf_weights)


def test_zipf_weights_sum_to_one_and_fall_by_rank():
    w = zipf_weights(100, 1.1)
    assert sum(w) == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx(2 ** 1.1)


@pytest.mark.parametrize("demands,capacity,expected", [
    ({"a": 1, "b": 1}, 10, {"a": 1, "b": 1}),                  # everything fits
    ({"a": 10, "b": 10}, 10, {"a": 5, "b": 5}),                # equal split
    ({"a": 1, "b": 10, "c": 10}, 10, {"a": 1, "b": 4.5, "c": 4.5}),
])
def test_water_filling(demands, capacity, expected):
    assert max_min_fair(demands, capacity) == pytest.approx(expected)
    assert small_tenants(demands, capacity) == {t for t, d in demands.items() if d <= expected[t]}


def test_jain_and_quartiles():
    assert jain([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)
    q = quartiles_of(["d", "a", "c", "b", "h", "e", "g", "f"])
    assert [q[t] for t in "abcdefgh"] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_scenario_splits_small_tenants_waits_by_quartile_and_first_task():
    def result(t, enq, wait):
        return {"tenant_id": t, "timing": {"queue_wait_ms": wait, "enqueued_ms": enq, "dispatched_ms": enq + wait},
                "tokens": {"total": 100}}
    results = [result("a", 0, 10), result("a", 5, 900), result("b", 0, 20), result("c", 0, 30), result("d", 0, 40)]
    got = scenario(["a", "b", "c", "d"], {"a", "b", "c", "d"}, {"a": 2, "b": 1, "c": 1, "d": 2}, results)
    assert [row["tasks"] for row in got["quartiles"]] == [2, 1, 1, 1]
    assert got["small"]["undispatched"] == 1                     # d's second task was never answered
    assert got["small_first"]["tasks"] == 4 and got["small_later"]["tasks"] == 1
    assert got["small_later"]["wait_max_ms"] == 900
