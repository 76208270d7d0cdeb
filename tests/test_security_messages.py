"""Crafted messages published straight to a queue (bad JSON, not a Celery message,
pickle, missing headers, a huge or forged token estimate, bad task arguments):
a real worker survives them, each is dead-lettered or failed with its reason,
and the good messages queued behind them still complete."""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
import sys
import time
import uuid

import pytest

from gateway_tasks.dispatch.broker import queued_messages
from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.core.errors import InvalidRequest
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool
from devtools import processes
from gateway_tasks.metrics.exporter import render
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.dispatch.dead_letters import dead_letters

pytestmark = pytest.mark.slow
TPM = 120_000   # bucket capacity 120k tokens (burst 60 s)


def _body(args: list) -> str:
    return base64.b64encode(json.dumps([args, {}, {"callbacks": None, "errbacks": None,
                                                    "chain": None, "chord": None}]).encode()).decode()


def crafted(template: dict) -> dict[str, tuple[str, int, str]]:
    """name -> (message text, index est_tokens, expected reason fragment or '' for a task failure)."""
    good_est = template["headers"]["gt_est_tokens"]

    def envelope(**changes) -> dict:
        msg = json.loads(json.dumps(template))
        msg["headers"]["id"] = str(uuid.uuid4())
        for path, value in changes.items():
            where, _, key = path.partition("__")
            target = msg if not key else msg[where]
            target[key or where] = value
        return msg

    no_headers = envelope()
    no_headers["headers"] = {}
    pickled = envelope(**{"content-type": "application/x-python-serialize"})
    pickled["body"] = base64.b64encode(pickle.dumps(("not", "allowed"))).decode()
    return {
        "bad json": ('{"body": "eyJ4Ijog', good_est, "not a JSON object"),
        "json array": ("[1, 2, 3]", good_est, "not a JSON object"),
        "no envelope": (json.dumps({"hello": "world"}), good_est, "not a kombu message envelope"),
        "pickle": (json.dumps(pickled), good_est, "JSON only"),
        "no headers": (json.dumps(no_headers), good_est, "lacks the Celery task headers"),
        "body not json": (json.dumps(envelope(body="////")), good_est, "body is not JSON"),
        "huge est_tokens": (json.dumps(envelope(headers__gt_est_tokens=10 ** 15)), 10 ** 15,
                            "over the pool's bucket capacity"),
        "forged est_tokens": (json.dumps(envelope(headers__gt_est_tokens=good_est + 50_000)), good_est,
                              "does not match its queue entry"),
        "bad task argument": (json.dumps(envelope(body=_body([{"tenant_id": 5}]))), good_est, ""),
    }


def test_crafted_messages_are_dead_lettered_and_the_worker_keeps_going(settings, r, tmp_path):
    with SimulatorThread(SimConfig(tpm=TPM, rpm=6_000, base_latency_ms=2)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",), tpm=TPM,
                    rpm=6_000)
        s = settings.with_(pools=(pool,))
        gw = Gateway(s, client=r)
        keys = Keys(s.key_prefix)
        gw.register_tenant("acme", "vip")
        before = gw.submit("acme", "first good question", max_tokens=16)
        [template] = queued_messages(r, keys, "default", "vip")
        cases = crafted(template)
        tags = {}
        for name, (text, est, _) in cases.items():
            tag = str(uuid.uuid4())
            try:
                msg = json.loads(text)
                if isinstance(msg, dict) and isinstance(msg.get("properties"), dict):
                    msg["properties"]["delivery_tag"] = tag
                    text = json.dumps(msg)
            except ValueError:
                pass
            # the raw broker path: what enqueue.lua stores, straight into the tier's queue
            done = enqueue(r, EnqueueCall(keys, s.tier("vip"), "default", tenant="acme", tag=tag,
                                           est_tokens=est, message_json=text))
            assert done.accepted
            tags[tag] = name
        after = [gw.submit("acme", f"good question {i} behind the crafted ones", max_tokens=16)
                 for i in range(3)]
        log = tmp_path / "worker.log"
        worker = processes.worker(s, concurrency=2, log_path=str(log)).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            results = [h.get(timeout=60) for h in [before, *after]]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(dead_letters(r, keys, "default")) < len(cases) - 1:
                time.sleep(0.1)
            alive = worker.alive()
            pings = gw.app.control.ping(timeout=1.0)
        finally:
            worker.stop()
    assert alive and pings, "the worker died"
    assert all(res["response"]["choices"][0]["message"]["role"] == "assistant" for res in results)

    records = {tags[d["tag"]]: d for d in dead_letters(r, keys, "default")}
    expected = {n for n, (_, _, why) in cases.items() if why}
    assert set(records) == expected, set(records) ^ expected
    for name, record in records.items():
        assert cases[name][2] in record["reason"], (name, record["reason"])
        assert record["tenant"] == "acme" and record["queue"] == "gt.vip.default"
    # a crafted message that names a task id fails that task with the reason
    named = records["huge est_tokens"]["task_id"]
    failed = gw.app.AsyncResult(named)
    assert failed.state == "FAILURE" and "bucket capacity" in str(failed.result)
    # a well-formed message with a bad task argument runs and fails with InvalidRequest
    bad_arg_id = json.loads(cases["bad task argument"][0])["headers"]["id"]
    res = gw.app.AsyncResult(bad_arg_id)
    deadline = time.monotonic() + 30
    while res.state not in ("FAILURE", "SUCCESS") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert res.state == "FAILURE" and type(res.result).__name__ == "InvalidRequest"
    assert "the task argument lacks" in str(res.result)
    # nothing is left dispatched or holding the tenant's slots; the queue is empty
    assert r.hlen(keys.dispatched("default")) == 0
    assert all(int(v) == 0 for v in r.hvals(keys.inflight("default")))
    assert queued_messages(r, keys, "default", "vip") == []
    stats = r.hgetall(keys.stats("default"))
    assert int(stats[b"dead_lettered:vip"]) == len(expected)
    assert f'gateway_dead_lettered_messages_total{{pool="default",tier="vip"}} {len(expected)}.0' \
        in render(gw, s).decode()
    text = log.read_text()
    assert text.count("dead-lettered message") == len(expected)
    # the operator's view: `gateway dead-letters`, without the stored messages unless asked
    cli = subprocess.run([sys.executable, "-m", "gateway_tasks.cli", "dead-letters", "--limit", "50"],
                         env=processes.child_env(s), capture_output=True, text=True, timeout=60)
    listed = json.loads(cli.stdout)
    assert {tags[d["tag"]] for d in listed} == expected and all("message" not in d for d in listed)
    assert "first good question" not in cli.stdout
    assert "Unrecoverable error" not in text and "first good question" not in text


def test_the_kombu_publish_path_refuses_unroutable_messages(settings, r):
    gw = Gateway(settings, client=r)
    keys = Keys(settings.key_prefix)
    queue = settings.queue_name("vip", "default")
    with gw.app.producer_or_acquire() as producer:
        with pytest.raises(InvalidRequest, match="needs the header gt_est_tokens"):
            producer.publish({"x": 1}, routing_key=queue, serializer="json", headers={},
                             declare=[], retry=False)
        with pytest.raises(InvalidRequest, match="bucket capacity"):
            producer.publish({"x": 1}, routing_key=queue, serializer="json",
                             headers={"gt_est_tokens": 10 ** 15, "gt_tenant": "acme"}, retry=False)
        with pytest.raises(InvalidRequest, match="gt_est_tokens"):
            producer.publish({"x": 1}, routing_key=queue, serializer="json",
                             headers={"gt_est_tokens": float("inf")}, retry=False)
    assert queued_messages(r, keys, "default", "vip") == []
    assert not r.exists(f"{settings.key_prefix}{queue}")   # nothing in a list no one reads


# -- random mutations of a real message ------------------------------------------------------
FUZZ_MESSAGES = 300
_VALUES = [None, True, 0, -1, 1.5, 10 ** 30, "", "x", "not-a-date", "gateway.infer", [], [1, "a"], {},
           {"a": {"b": []}}, "2026-13-45T99:99:99", "0" * 300]
_HEADER_KEYS = ["task", "id", "gt_est_tokens", "eta", "expires", "retries", "timelimit", "argsrepr",
                "kwargsrepr", "root_id", "parent_id", "group", "lang", "origin", "shadow", "ignore_result",
                "gt_tenant", "gt_weight", "stamps", "stamped_headers", "chord", "replaced_task_nesting"]
_PROPERTY_KEYS = ["delivery_info", "body_encoding", "priority", "correlation_id", "reply_to",
                  "delivery_mode"]


def mutate(template: dict, rng) -> tuple[str, int]:
    """One random mutation of a real envelope: (message text, index est_tokens)."""
    msg = json.loads(json.dumps(template))
    msg["headers"]["id"] = str(uuid.uuid4())
    est = template["headers"]["gt_est_tokens"]
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(7)
        value = rng.choice(_VALUES)
        if kind == 0:
            msg[rng.choice(["body", "headers", "properties", "content-type", "content-encoding"])] = value
        elif kind in (1, 2) and isinstance(msg.get("headers"), dict):
            msg["headers"][rng.choice(_HEADER_KEYS)] = value
        elif kind == 3 and isinstance(msg.get("properties"), dict):
            msg["properties"][rng.choice(_PROPERTY_KEYS)] = value
        elif kind == 4:
            args = [{"tenant_id": "acme", "tier": rng.choice(["vip", "gold", 7]), "pool": "default",
                     "model": rng.choice(["gpt-4o-mini", "nope", None]), "messages": rng.choice(
                         [[{"role": "user", "content": "hi"}], [], "hi", [None]]),
                     "max_tokens": rng.choice([16, 0, -5, "16", 10 ** 12]), "prompt_tokens": 3,
                     "est_tokens": est, "deadline_s": rng.choice([None, 0, -1, 1e308, "soon"])}]
            msg["body"] = _body(args)
        elif kind == 5:
            est = rng.choice([0, 1, est, 10 ** 6, 10 ** 15])
        else:
            text = json.dumps(msg)
            return text[:rng.randrange(len(text))], est
    return json.dumps(msg), est


def test_random_mutations_of_a_message_never_stop_the_worker(settings, r, tmp_path):
    import random
    rng = random.Random(1103)
    with SimulatorThread(SimConfig(tpm=TPM, rpm=6_000, base_latency_ms=1)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",), tpm=TPM,
                    rpm=6_000)
        s = settings.with_(pools=(pool,))
        gw = Gateway(s, client=r)
        keys = Keys(s.key_prefix)
        gw.register_tenant("acme", "vip")
        template_handle = gw.submit("acme", "the template", max_tokens=8)
        [template] = queued_messages(r, keys, "default", "vip")
        for _ in range(FUZZ_MESSAGES):
            text, est = mutate(template, rng)
            tag = str(uuid.uuid4())
            try:
                msg = json.loads(text)
                if isinstance(msg, dict) and isinstance(msg.get("properties"), dict):
                    msg["properties"]["delivery_tag"] = tag
                    text = json.dumps(msg)
            except ValueError:
                pass
            assert enqueue(r, EnqueueCall(keys, s.tier("vip"), "default", tenant="acme", tag=tag,
                                           est_tokens=est, message_json=text)).accepted
        good = [gw.submit("acme", f"good {i}", max_tokens=8) for i in range(5)]
        log = tmp_path / "worker.log"
        worker = processes.worker(s, concurrency=4, log_path=str(log)).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            # within 60 s: a refunded 120k-token dispatch must not make a later reply's
            # x-ratelimit sync lower the bucket (it did: a 60 s stall per crafted message)
            results = [h.get(timeout=60) for h in [template_handle, *good]]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (r.hlen(keys.messages("default")) or
                                                   r.hlen(keys.dispatched("default"))):
                time.sleep(0.2)
            alive = worker.alive() and bool(gw.app.control.ping(timeout=1.0))
        finally:
            worker.stop()
    assert alive, log.read_text()[-3000:]
    assert all(res["tenant_id"] == "acme" for res in results)
    # every crafted message left the queue: none is queued, dispatched or holding a slot
    assert r.hlen(keys.messages("default")) == 0, r.hkeys(keys.messages("default"))[:5]
    assert r.hlen(keys.dispatched("default")) == 0
    assert all(int(v) == 0 for v in r.hvals(keys.inflight("default")))
    letters = dead_letters(r, keys, "default", count=FUZZ_MESSAGES)
    print(f"{len(letters)} of {FUZZ_MESSAGES} mutated messages dead-lettered; reasons:",
          sorted({d["reason"].split(":")[0][:50] for d in letters}))
    assert letters and all(d["reason"] for d in letters)
    assert "Unrecoverable error" not in log.read_text()


def test_a_refund_of_an_unsent_dispatch_is_not_counted_as_in_flight(settings, r):
    """A: a normal task dispatched; B: a 120k-token dispatch refunded unsent (a dead letter).
    A's reply then says the upstream has its whole quota left: the bucket follows it
    minus what is really in flight since A (nothing), not minus B's refunded debit."""
    from gateway_tasks.bucket.pool_bucket import PoolBucket
    from gateway_tasks.dispatch.router import PickPlan, pick_now

    pool = Pool("default", base_url="http://127.0.0.1:9/v1", api_key="k", models=("gpt-4o-mini",),
                tpm=TPM, rpm=6_000)
    s = settings.with_(pools=(pool,))
    keys = Keys(s.key_prefix)
    plan = PickPlan(s, ["gt.vip.default"])
    for est in (20, 10 ** 15):
        enqueue(r, EnqueueCall(keys, s.tier("vip"), "default", tenant="acme", tag=str(uuid.uuid4()),
                               est_tokens=est, message_json="{}"))
    a = pick_now(scripts_for(r), plan)
    time.sleep(0.6)   # the bucket refills the 20 tokens: B can take the whole capacity
    b = pick_now(scripts_for(r), plan)
    assert (a.est_tokens, b.est_tokens) == (20, TPM)
    bucket = PoolBucket(r, keys, pool)
    bucket.settle(est_tokens=b.est_tokens, actual_tokens=0, tier="vip", tenant_id="acme", model="",
                  completion_tokens=0, learn=False, reached_upstream=False)
    after = bucket.settle_reply(est_tokens=a.est_tokens, actual_tokens=20, tier="vip", tenant_id="acme",
                                model="gpt-4o-mini", completion_tokens=5, learn=False,
                                headers={"x-ratelimit-remaining-tokens": str(TPM - 20),
                                         "x-ratelimit-remaining-requests": "5999"},
                                debited_tokens_at_dispatch=a.pool_debited,
                                dispatches_at_dispatch=a.pool_dispatches)
    assert after.tokens >= TPM - 40, after   # before the fix: 0 (B's debit counted as in flight)
