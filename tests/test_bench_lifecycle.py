"""`gateway-dev bench-lifecycle` runs and reports every script it measures (the numbers
themselves are measurements, not asserted)."""

from __future__ import annotations

from devtools.cli import build_parser
from devtools.bench.lifecycle import format_report, run_bench
from devtools.run_redis import delete_prefix


def test_bench_lifecycle_measures_every_script(r):
    result = run_bench(r, calls=20)
    try:
        for name in ("enqueue_us", "quota_take_us", "cancel_us_backlog_10", "cancel_us_backlog_10000",
                     "evict_us_tenants_10", "evict_us_tenants_1000", "evict_us_protected_64", "depend_us", "deps_done_us",
                     "deps_release_us"):
            assert result[name] > 0, name
            assert name in format_report(result)
        assert set(result["ratios_to_enqueue"]) == {k for k in result if k.endswith("_us") or "_us_" in k} - {"enqueue_us"}
    finally:
        delete_prefix(r, "gt-bench-life-")
    args = build_parser().parse_args(["bench-lifecycle", "--calls", "5", "--json"])
    assert args.calls == 5 and args.json
