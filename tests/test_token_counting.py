"""Every byte that goes upstream is counted: the estimate covers every forwarded field
(tool calls, content parts, tool definitions, extra_body strings), ``n`` multiplies the
completion reserve (or is refused by the pool's ``max_n``), ``max_completion_tokens`` is
``max_tokens``, and a tenant's TPM bucket is settled to the upstream's reported usage -- so
whatever a tenant sends, what its requests consume upstream stays within its TPM quota."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from devtools import processes
from gateway_tasks.core import tokens
from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.core.errors import InvalidRequest, PromptTooLarge, QuotaExceeded
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.tenants.quota import tpm_settle

HELLO = [{"role": "user", "content": "hello there"}]
WORDS = " ".join(f"word{i % 50}" for i in range(100_000))


def tool_call(arguments: str) -> list[dict]:
    return [{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}]


def test_every_forwarded_field_is_counted():
    plain = tokens.count_prompt_tokens(HELLO)
    assert plain == tokens.REPLY_PRIMING_TOKENS + tokens.TOKENS_PER_MESSAGE + \
        tokens.count_text_tokens("user") + tokens.count_text_tokens("hello there")   # unchanged
    # a 100k-word tool call is counted as the JSON it is sent as (it was 29 tokens)
    calls = tool_call(WORDS)
    with_calls = tokens.count_prompt_tokens([{"role": "assistant", "content": "x", "tool_calls": calls}])
    assert with_calls >= tokens.count_text_tokens(WORDS) > 100_000
    # content parts, tool definitions, extra_body strings: each its text
    parts = [{"type": "text", "text": WORDS[:5000]}]
    assert tokens.count_prompt_tokens([{"role": "user", "content": parts}]) > tokens.count_text_tokens(WORDS[:5000])
    tools = [{"type": "function", "function": {"name": "lookup", "description": WORDS[:3000],
                                               "parameters": {"type": "object", "properties": {}}}}]
    assert tokens.count_prompt_tokens(HELLO, extra_body={"tools": tools}) - plain > \
        tokens.count_text_tokens(WORDS[:3000])
    user = "a" * 1_000_000
    assert tokens.count_prompt_tokens(HELLO, extra_body={"user": user}) - plain == tokens.count_text_tokens(user)
    # the control parameters are not prompt text
    assert tokens.count_prompt_tokens(HELLO, extra_body={"n": 3, "max_completion_tokens": 9}) == plain
    # bounded: past stop_above it stops (a lower bound over the limit, the rest not encoded)
    big = {"user": user, "tools": tools}
    assert tokens.count_prompt_tokens(HELLO, stop_above=1_000, extra_body=big) > 1_000


@pytest.fixture
def gw(make_gateway, settings):
    pools = (replace(settings.pools[0], max_n=4),)
    return make_gateway([("acme", "vip")], settings=settings.with_(pools=pools))


def test_admission_estimates_every_field_n_and_max_completion_tokens(gw, make_gateway, settings):
    plain = gw.estimate("acme", HELLO, max_tokens=100, level=0)
    # n multiplies the completion reserve, up to the pool's max_n
    three = gw.estimate("acme", HELLO, max_tokens=100, level=0, extra_body={"n": 3})
    assert three.est_tokens == three.prompt_tokens + 300 and three.prompt_tokens == plain.prompt_tokens
    with pytest.raises(InvalidRequest, match=r"n=5 .* \(max_n 4\)"):
        gw.estimate("acme", HELLO, max_tokens=100, level=0, extra_body={"n": 5})
    default = make_gateway([("acme2", "vip")])             # a pool's default max_n is 1
    with pytest.raises(InvalidRequest, match="max_n 1"):
        default.submit("acme2", HELLO, extra_body={"n": 2})
    # max_completion_tokens is max_tokens: reserved, and the one limit forwarded
    h = gw.submit("acme", HELLO, extra_body={"max_completion_tokens": 77, "temperature": 0.5})
    assert h.est_tokens - h.prompt_tokens == 77
    req = gw.estimate("acme", HELLO, extra_body={"max_completion_tokens": 77}, level=0)
    assert req.max_tokens == 77 and "max_completion_tokens" not in req.extra_body
    with pytest.raises(InvalidRequest, match="differ"):
        gw.submit("acme", HELLO, max_tokens=10, extra_body={"max_completion_tokens": 77})
    # a huge tool call or extra_body string is refused at admission, nothing enqueued
    for asked in ({"messages": [{"role": "assistant", "content": "x", "tool_calls": tool_call(WORDS)}]},
                  {"messages": HELLO, "extra_body": {"user": "a " * 400_000}}):
        with pytest.raises(PromptTooLarge):
            gw.submit("acme", asked["messages"], extra_body=asked.get("extra_body"))
    assert gw.r.zcard(gw.keys.index("default", "vip")) == 1


def test_rest_refuses_n_over_the_pools_max_n_and_two_different_limits(client, gateway):
    key = gateway.register_tenant("acme", "vip")
    auth = {"Authorization": f"Bearer {key}"}
    for path, body, says in (
            ("/v1/tasks", {"messages": HELLO, "extra_body": {"n": 2}}, "max_n"),
            ("/v1/chat/completions", {"messages": HELLO, "n": 2}, "max_n"),
            ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 5, "max_completion_tokens": 9}, "differ"),
            ("/v1/tasks", {"messages": HELLO, "max_tokens": 5, "extra_body": {"max_completion_tokens": 9}},
             "differ")):
        resp = client.post(path, json=body, headers=auth)
        assert resp.status_code == 400 and says in resp.json()["error"]["message"], resp.text
    resp = client.post("/v1/tasks", json={"messages": HELLO, "extra_body": {"max_completion_tokens": 9}},
                       headers=auth)
    assert resp.status_code == 202 and resp.json()["est_tokens"] - resp.json()["prompt_tokens"] == 9


def test_the_tenant_bucket_is_settled_both_ways(r, settings):
    keys = Keys(settings.key_prefix)
    bucket = keys.tenant_bucket("t")
    scripts = scripts_for(r)
    scripts.run(tpm_settle(keys, "t", 50, 600))            # no bucket: full, nothing to give back
    assert not r.exists(bucket)
    scripts.run(tpm_settle(keys, "t", -900, 600))          # used 900 beyond its estimate: in debt
    level = float(r.hget(bucket, "tokens"))
    assert -300 <= level < -299
    assert r.pttl(bucket) > 120_000                        # kept until it has refilled (90 s + margin)
    scripts.run(tpm_settle(keys, "t", 200, 600))
    assert float(r.hget(bucket, "tokens")) == pytest.approx(level + 200, abs=1)
    r.hset(bucket, mapping={"tokens": 590, "ts_ms": redis_now_ms(r)})
    scripts.run(tpm_settle(keys, "t", 500, 600))           # given back up to the bucket's size
    assert float(r.hget(bucket, "tokens")) == 600


@pytest.mark.slow
def test_what_a_tenant_consumes_upstream_stays_within_its_tpm(settings, r, tmp_path):
    """One tenant with a TPM quota sends, from 4 threads as fast as it is admitted, requests
    whose text is mostly outside the message contents (a tool call, tool definitions, an
    extra_body string, n=2).  The tokens the upstream counted (the simulator's own
    accounting) stay within the quota: its bucket (one minute) plus its refill over the run."""
    tpm = 12_000
    with SimulatorThread(SimConfig(tpm=6_000_000, rpm=60_000, base_latency_ms=5, max_n=2)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",),
                    tpm=6_000_000, rpm=60_000, max_n=2)
        s = settings.with_(pools=(pool,))
        gw = Gateway(s, client=r)
        gw.register_tenant("greedy", "vip", tpm=tpm)
        worker = processes.worker(s, concurrency=4, log_path=str(tmp_path / "worker.log")).start()
        text = " ".join(f"item{i}" for i in range(600))
        shapes = [
            dict(messages=[{"role": "user", "content": "go"},
                           {"role": "assistant", "content": "calling", "tool_calls": tool_call(text)},
                           {"role": "tool", "content": "ok", "tool_call_id": "call_1"}]),
            dict(messages=HELLO, extra_body={"tools": [{"type": "function", "function": {
                "name": "f", "description": text, "parameters": {"type": "object"}}}]}),
            dict(messages=HELLO, extra_body={"user": text}),
            dict(messages=HELLO, max_tokens=400, extra_body={"n": 2, "sim_completion_tokens": 400}),
        ]
        handles, refused, lock = [], [0], threading.Lock()
        started = [0.0]
        run_s = 5.0

        def flood(i: int) -> None:
            n = 0
            while time.monotonic() - started[0] < run_s:
                shape = shapes[(i + n) % len(shapes)]
                n += 1
                try:
                    h = gw.submit("greedy", shape["messages"], max_tokens=shape.get("max_tokens", 200),
                                  extra_body=shape.get("extra_body"))
                except QuotaExceeded:
                    with lock:
                        refused[0] += 1
                    time.sleep(0.05)
                    continue
                with lock:
                    handles.append(h)

        try:
            processes.wait_for_workers(gw.app, 1)
            started[0] = time.monotonic()
            threads = [threading.Thread(target=flood, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed_s = time.monotonic() - started[0]
            for h in handles:
                h.get(timeout=60)
        finally:
            worker.stop()
            gw.app.close()
        stats = sim.stats()
    used = stats["tokens_prompt"] + stats["tokens_completion"]
    allowed = tpm + tpm * elapsed_s / 60.0
    assert refused[0] > 0 and len(handles) >= 3
    assert stats["requests_ok"] == len(handles)
    assert used <= allowed, (used, allowed, len(handles))
    # each shape's text was counted: far more than the message contents alone
    assert used > 3 * len(text.split())
