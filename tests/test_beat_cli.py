"""`gateway cron add/list/delete` through beat.cli.register(); `gateway-dev cron-bench`."""

from __future__ import annotations

import argparse
import json

import pytest

from beat import cli
from gateway_tasks.core.errors import ConfigError, CronError
from gateway_tasks.tenants.registry import TenantRegistry


def parse(argv):
    parser = argparse.ArgumentParser(prog="gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.register(sub)
    return parser.parse_args(argv)


def run(argv):
    args = parse(argv)
    return args.func(args)


@pytest.fixture
def env(monkeypatch, redis_url, key_prefix, r, settings):
    monkeypatch.delenv("GATEWAY_CONFIG", raising=False)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("GATEWAY_KEY_PREFIX", key_prefix)
    TenantRegistry(r, settings).register("acme", "free")


def test_add_list_delete(env, capsys):
    assert run(["cron", "add", "acme", "digest", "0 7 * * *", "--prompt", "Summarise",
                "--model", "gpt-4o-mini", "--max-tokens", "100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("registered acme:digest cron '0 7 * * *' tier batch jitter ")
    assert run(["cron", "add", "acme", "hourly", "@hourly", "--prompt", "Ping", "--json"]) == 0
    added = json.loads(capsys.readouterr().out)
    assert added["task_id"] == "hourly" and added["actual_next"].endswith("Z")

    assert run(["cron", "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["TENANT", "TASK_ID", "CRON", "TIER", "JITTER_S", "NOMINAL_NEXT",
                                "ACTUAL_NEXT", "LAST_FIRED", "LAST_STATUS"]
    assert "0 7 * * *" in table[1] and "@hourly" in table[2]
    legend = "\n".join(table[3:])   # the table explains its columns
    assert table[3] == "" and "JITTER_S is how many" in legend and "sha256" in legend

    assert run(["cron", "list", "--tenant", "acme", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["task_id"] for row in rows] == ["digest", "hourly"]
    assert set(rows[0]) >= {"cron", "tier", "jitter_offset_s", "nominal_next", "actual_next",
                            "last_fired"}

    assert run(["cron", "delete", "acme", "digest"]) == 0
    assert capsys.readouterr().out.strip() == "deleted acme:digest"
    with pytest.raises(CronError, match="has no cron"):
        run(["cron", "delete", "acme", "digest"])
    assert run(["cron", "list", "--tenant", "nobody"]) == 0
    assert capsys.readouterr().out.strip() == "no crons"


def test_malformed_cron_is_a_clear_error(env):
    with pytest.raises(CronError, match=r"malformed cron expression '0 \* \*'.*expected 5 fields"):
        run(["cron", "add", "acme", "bad", "0 * *", "--prompt", "x"])


def test_add_list_delete_need_redis_url(monkeypatch):
    monkeypatch.delenv("GATEWAY_CONFIG", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    for argv in (["cron", "list"], ["cron", "delete", "a", "b"],
                 ["cron", "add", "a", "b", "@daily", "--prompt", "x"]):
        with pytest.raises(ConfigError, match="needs REDIS_URL"):
            run(argv)


def test_bench_arguments():
    from devtools.bench import beat as bench
    from devtools.cli import build_parser

    args = build_parser().parse_args(["cron-bench", "--entries", "500", "--json"])
    assert args.entries == 500 and args.json and args.func is bench.run_from_args


def test_gateway_main_prints_the_error_and_exits_2(env, capsys):
    from gateway_tasks.cli.main import main

    assert main(["cron", "add", "acme", "bad", "61 * * * *", "--prompt", "x"]) == 2
    assert "malformed cron expression '61 * * * *'" in capsys.readouterr().err
