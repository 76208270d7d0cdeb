"""A tenant's usage counters: hours and days, retention, `gateway tenant usage`.  Real Redis;
the counts against the simulator's own accounting are in test_openai_surface.py."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from gateway_tasks.cli import tenant as tenant_cli
from gateway_tasks.core.errors import UnknownTenant
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.usage.counters import (DAY_MS, HOUR_MS, REQUESTS, UsageCall, by_day, expire_at_ms, hour_of,
                                          usage_report)

NOON = 20_000 * DAY_MS + 12 * HOUR_MS + 1_234     # a day's 12:00:01.234 UTC


def test_hours_expire_after_the_retention_and_days_sum_their_hours():
    assert expire_at_ms(hour_of(NOON), 2) == NOON - 1_234 + HOUR_MS + 2 * DAY_MS
    rows = [{"hour_ms": NOON - 13 * HOUR_MS, REQUESTS: 2}, {"hour_ms": NOON - HOUR_MS, REQUESTS: 3},
            {"hour_ms": NOON, REQUESTS: 4}]
    days = by_day(rows)
    assert [(d["day_ms"], d[REQUESTS]) for d in days] == [(19_999 * DAY_MS, 2), (20_000 * DAY_MS, 7)]


def test_counts_land_in_their_hour_with_a_ttl_and_the_report_windows(make_gateway, r, monkeypatch, capsys):
    gw = make_gateway([("acme", "batch")])
    scripts = scripts_for(r)
    noon = int(time.time() * 1000) // DAY_MS * DAY_MS + 12 * HOUR_MS + 1_234   # today's, UTC
    for at, n in ((noon - 25 * HOUR_MS, 1), (noon - HOUR_MS, 2), (noon, 4)):
        scripts.run(UsageCall(gw.keys, "acme", at, 3, {REQUESTS: n, "actual_tokens": 10 * n}))
    key = gw.keys.tenant_usage("acme", hour_of(noon))
    assert abs(time.time() * 1000 + r.pttl(key) - expire_at_ms(hour_of(noon), 3)) < 10_000
    assert key.startswith(gw.keys.prefix + "{t:acme}:")           # one slot per tenant on a cluster
    report = usage_report(r, gw.keys, "acme", noon, hours=2, days=2, retention_days=3)
    assert [h[REQUESTS] for h in report["hours"]] == [2, 4]
    assert [d[REQUESTS] for d in report["days"]] == [1, 6]
    assert report["totals"]["days"]["actual_tokens"] == 70
    assert len(usage_report(r, gw.keys, "acme", noon, hours=10_000, days=99, retention_days=3)["days"]) == 3

    monkeypatch.setattr(tenant_cli, "get_settings", lambda: gw.settings)
    parser = argparse.ArgumentParser()
    tenant_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tenant", "usage", "acme", "--hours", "1"])
    assert args.func(args) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tenant_id"] == "acme" and len(shown["hours"]) == 1
    with pytest.raises(UnknownTenant):
        args = parser.parse_args(["tenant", "usage", "nobody"])
        args.func(args)
