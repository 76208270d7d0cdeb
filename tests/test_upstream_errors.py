"""An upstream's 4xx keeps its meaning, end to end: the official openai SDK against the
gateway's REST API (real HTTP), a real worker process, the simulator as the upstream
(real HTTP), real Redis.

For each refusal a real upstream gives -- an unknown parameter, an n it does not
support, a prompt past the context window, an unknown model -- the SDK raises the
matching error with the upstream's own message, type, param and code; the request made
one task and one upstream call (the SDK does not retry a 4xx; the gateway neither
retries nor fails over to the backup pool, and the circuit counts nothing); the pool's
bucket got the reserved tokens back; the worker logged one line, no traceback.  The
5xx side (retried within the tier's budget) is tests/test_retry_budget.py's."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.core.errors import UpstreamError, UpstreamRejected
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool, load_settings
from gateway_tasks.core.stats import ACTUAL_TOKENS, COMPLETED, UPSTREAM_ERRORS, tier_field
from gateway_tasks.core.tokens import count_prompt_tokens
from devtools import processes
from devtools.api_thread import ApiThread
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway

pytestmark = pytest.mark.slow

PROMPT_MARK = "prompt-mark-7f3a"
MESSAGES = [{"role": "user", "content": f"Summarise {PROMPT_MARK} in one line"}]
PROMPT = count_prompt_tokens(MESSAGES)
MODEL, RETIRED = "gpt-4o-mini", "gpt-4o-retired"   # the upstream serves MODEL only
WINDOW_TOKENS = 300                                 # MODEL's context window at the upstream
UPSTREAM_KEY = "sk-upstream-secret-4xx"
TPM = 600_000


@pytest.fixture(scope="module")
def stack(redis_url, module_key_prefix, tmp_path_factory):
    """Pool 'default' (MODEL and RETIRED; backup pool 'backup'; n up to 2, which its upstream
    refuses) on the primary simulator,
    'backup' on another; tenant 'acme' is vip, whose tasks may fail over to the backup."""
    prefix = module_key_prefix
    log = tmp_path_factory.mktemp("upstream-4xx") / "worker.log"
    primary_cfg = SimConfig(base_latency_ms=5, models=(MODEL,), context_window_tokens={MODEL: WINDOW_TOKENS})
    with SimulatorThread(primary_cfg) as primary, SimulatorThread(SimConfig(base_latency_ms=5)) as backup:
        pools = (Pool("default", base_url=primary.base_url, api_key=UPSTREAM_KEY, models=(MODEL, RETIRED),
                      tpm=TPM, rpm=6_000, backup_pools=("backup",), max_n=2),   # the upstream serves n=1
                 Pool("backup", base_url=backup.base_url, api_key="sk-backup", models=(MODEL,),
                      tpm=TPM, rpm=6_000))
        settings = load_settings(env={}, redis_url=redis_url, key_prefix=prefix, pools=pools)
        gw = Gateway(settings)
        key = gw.register_tenant("acme", "vip")
        # info: Celery's own line of a failed task would show, with its traceback if any
        worker = processes.worker(settings, concurrency=2, log_path=str(log), loglevel="info").start()
        try:
            processes.wait_for_workers(gw.app, 1)
            with ApiThread(gw) as api:
                yield SimpleNamespace(gw=gw, api=api, key=key, primary=primary, backup=backup, log=log,
                                      keys=Keys(prefix), pool=pools[0])
        finally:
            worker.stop()
            gw.app.close()
            gw.r.close()


@pytest.fixture
def s(stack):
    stack.primary.reset_stats()
    stack.backup.reset_stats()
    return stack


# name: (request arguments, SDK error, status, the upstream's error object)
CASES = {
    "unknown parameter": (
        {"extra_body": {"temprature": 0.2}}, openai.BadRequestError, 400,
        {"message": "Unknown parameter: 'temprature'.", "type": "invalid_request_error",
         "param": "temprature", "code": "unknown_parameter"}),
    "n not supported": (
        {"n": 2}, openai.BadRequestError, 400,
        {"message": "Unsupported value: 'n' does not support 2 with this model. Only the default (1) "
                    "value is supported.", "type": "invalid_request_error", "param": "n",
         "code": "unsupported_value"}),
    "context too long": (
        {"max_tokens": WINDOW_TOKENS}, openai.BadRequestError, 400,
        {"message": f"This model's maximum context length is {WINDOW_TOKENS} tokens. However, you "
                    f"requested {PROMPT + WINDOW_TOKENS} tokens ({PROMPT} in the messages, "
                    f"{WINDOW_TOKENS} in the completion). Please reduce the length of the messages "
                    f"or completion.", "type": "invalid_request_error", "param": "messages",
         "code": "context_length_exceeded"}),
    "unknown model": (
        {"model": RETIRED}, openai.NotFoundError, 404,
        {"message": f"The model `{RETIRED}` does not exist or you do not have access to it.",
         "type": "invalid_request_error", "param": None, "code": "model_not_found"}),
}


def sdk(s) -> openai.OpenAI:
    """The official client as an application uses it: its own retries on (2, its default)."""
    return openai.OpenAI(base_url=s.api.base_url, api_key=s.key)


def request(overrides: dict) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, **overrides}


def enqueued(s) -> int:
    """Tasks enqueued on either pool (lua/dispatch/enqueue.lua counts each in its pool's seq)."""
    return sum(int(s.gw.r.get(s.keys.seq(p)) or 0) for p in ("default", "backup"))


def set_bucket(s, tokens: float, requests: float) -> dict[str, float]:
    """Put the pool's bucket at a known level below its capacity, now (Redis clock)."""
    state = {"tokens": tokens, "requests": requests, "ts_ms": redis_now_ms(s.gw.r)}
    s.gw.r.hset(s.keys.bucket("default"), mapping=state)
    return state


def assert_refunded(s, before: dict[str, float]) -> None:
    """The bucket holds what it held plus its refill since (both rates are linear below the
    capacity): the tokens and the request slot taken at dispatch came back."""
    raw = s.gw.r.hmget(s.keys.bucket("default"), "tokens", "requests", "ts_ms")
    tokens, requests, ts_ms = (float(v) for v in raw)
    elapsed_ms = ts_ms - before["ts_ms"]
    _, tokens_per_ms, _, requests_per_ms = s.pool.rates()
    expected = before["tokens"] + elapsed_ms * tokens_per_ms
    assert expected < s.pool.token_capacity
    assert tokens == pytest.approx(expected, abs=0.5)      # without the refund: 16 + PROMPT fewer
    assert requests == pytest.approx(before["requests"] + elapsed_ms * requests_per_ms, abs=0.01)


def assert_one_call_and_nothing_else(s, task_id: str) -> None:
    assert s.primary.calls()["attempts"] == {task_id: 1}            # one upstream call
    stats = s.primary.stats()
    assert stats["requests_invalid"] == 1 and stats["requests_ok"] == stats["requests_error"] == 0
    assert s.backup.calls()["attempts"] == {} and s.backup.stats()["requests_invalid"] == 0   # no failover
    assert s.gw.r.get(s.keys.attempts(task_id)) is None             # no retry counted
    circuit = s.gw.r.hgetall(s.keys.circuit("default"))
    assert int(circuit.get(b"failures", 0)) == 0 and circuit.get(b"state", b"closed") == b"closed"
    pool_stats = s.gw.r.hgetall(s.keys.stats("default"))
    for field in (UPSTREAM_ERRORS, tier_field(COMPLETED, "vip"), tier_field(ACTUAL_TOKENS, "vip")):
        assert int(pool_stats.get(field.encode(), 0)) == 0, field


def assert_one_log_line(s, task_id: str, status: int, upstream: dict) -> None:
    log = s.log.read_text()
    # at info Celery logs each task's arrival; of its end, only the task's own line is left
    lines = [line for line in log.splitlines() if task_id in line and not line.endswith("] received")]
    assert len(lines) == 1, lines
    assert f"tenant acme: the upstream refused it with {status}" in lines[0]
    assert f"type {upstream['type']}, code {upstream['code']}" in lines[0]
    assert "Traceback" not in log and upstream["message"] not in log
    assert PROMPT_MARK not in log and UPSTREAM_KEY not in log


@pytest.mark.parametrize("case", list(CASES))
def test_the_sdk_gets_the_upstreams_4xx_from_one_task_and_one_call(s, case):
    overrides, error, status, upstream = CASES[case]
    before_bucket = set_bucket(s, tokens=s.pool.token_capacity / 4, requests=s.pool.request_capacity / 4)
    before = enqueued(s)
    with pytest.raises(error) as info:
        sdk(s).chat.completions.create(**request(overrides))
    exc = info.value
    assert exc.status_code == status and exc.body == upstream       # the upstream's object, as sent
    assert (exc.type, exc.param, exc.code) == (upstream["type"], upstream["param"], upstream["code"])
    task_id = exc.response.headers["x-gateway-task-id"]
    assert enqueued(s) - before == 1                                  # one task: the SDK did not retry
    assert_one_call_and_nothing_else(s, task_id)
    assert_refunded(s, before_bucket)
    assert_one_log_line(s, task_id, status, upstream)


def test_a_stream_gets_the_upstreams_error_event(s):
    overrides, _, status, upstream = CASES["unknown parameter"]
    before_bucket = set_bucket(s, tokens=s.pool.token_capacity / 4, requests=s.pool.request_capacity / 4)
    before = enqueued(s)
    raw = sdk(s).chat.completions.with_raw_response.create(**request(overrides), stream=True)
    assert raw.status_code == 200                   # the stream had started: the error is its event
    task_id = raw.headers["x-gateway-task-id"]
    with pytest.raises(openai.APIError) as info:
        list(raw.parse())
    assert info.value.body == upstream and info.value.message == upstream["message"]
    assert (info.value.type, info.value.param, info.value.code) == \
        (upstream["type"], upstream["param"], upstream["code"])
    assert enqueued(s) - before == 1
    assert_one_call_and_nothing_else(s, task_id)
    assert_refunded(s, before_bucket)
    assert_one_log_line(s, task_id, status, upstream)


def test_a_submitted_task_shows_the_refusal_and_raises_upstream_rejected(s):
    _, _, status, upstream = CASES["n not supported"]
    headers = {"Authorization": f"Bearer {s.key}"}
    submitted = httpx.post(f"{s.api.base_url}/tasks", headers=headers, timeout=10,
                           json={"messages": MESSAGES, "max_tokens": 16, "extra_body": {"n": 2}})
    assert submitted.status_code == 202
    task_id = submitted.json()["task_id"]
    with pytest.raises(UpstreamRejected) as info:      # the Python API: the same error, its fields
        s.gw.result(task_id).get(timeout=30)
    exc = info.value
    assert isinstance(exc, UpstreamError)
    assert (exc.status, exc.upstream_message, exc.type, exc.param, exc.code) == \
        (status, upstream["message"], upstream["type"], upstream["param"], upstream["code"])
    deadline = time.monotonic() + 10
    view = httpx.get(f"{s.api.base_url}/tasks/{task_id}", headers=headers, timeout=10).json()
    while view["status"] != "FAILURE" and time.monotonic() < deadline:
        time.sleep(0.05)
        view = httpx.get(f"{s.api.base_url}/tasks/{task_id}", headers=headers, timeout=10).json()
    assert {k: view[k] for k in ("task_id", "status", "error")} == {"task_id": task_id, "status": "FAILURE", "error": {
        "type": "UpstreamRejected", "message": f"the upstream refused the request ({status}): {upstream['message']}",
        "status": status, "upstream": upstream}}
    assert_one_call_and_nothing_else(s, task_id)
    assert_one_log_line(s, task_id, status, upstream)


def tenant_bucket(s, tenant: str) -> tuple[float, int]:
    tokens, ts_ms = s.gw.r.hmget(s.keys.tenant_bucket(tenant), "tokens", "ts_ms")
    return float(tokens), int(ts_ms)


def test_a_refused_task_gives_its_tenants_tpm_tokens_back(s):
    """The tenant's own TPM bucket, debited by the estimate at submit, gets all of it back
    when the upstream refused the task (it used nothing)."""
    tpm = 600                                        # 0.01 token per ms
    s.gw.register_tenant("metered", "vip", tpm=tpm)
    s.gw.r.hset(s.keys.tenant_bucket("metered"), mapping={"tokens": 300, "ts_ms": redis_now_ms(s.gw.r)})
    before_tokens, before_ms = tenant_bucket(s, "metered")
    handle = s.gw.submit("metered", MESSAGES, model=MODEL, max_tokens=16, extra_body={"n": 2})
    with pytest.raises(UpstreamRejected):
        handle.get(timeout=30)
    tokens, ts_ms = tenant_bucket(s, "metered")
    # what it held plus its refill since: the estimate came back (without it: est_tokens fewer)
    assert handle.est_tokens > 1
    assert tokens == pytest.approx(before_tokens + (ts_ms - before_ms) * tpm / 60_000, abs=0.5)


def test_openapi_documents_the_passed_through_statuses(s):
    schema = httpx.get(f"{s.api.base_url.removesuffix('/v1')}/openapi.json", timeout=10).json()
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    for code in ("400", "404", "409", "413", "422"):
        assert "the upstream refused the request" in responses[code]["description"], code
    assert "upstream refused" not in schema["paths"]["/v1/tasks"]["post"]["responses"]["400"]["description"]
    error = schema["components"]["schemas"]["Error"]["properties"]["error"]["properties"]
    assert {"type", "message", "param", "code"} <= set(error)
