"""The OpenAI Batch API served by the gateway, end to end through the official openai SDK:
files up and down, a few hundred lines run as the tenant's scheduled work against the
simulator, per-line errors as OpenAI reports them, cancel stopping the queued lines at once,
another tenant's ids unknown.  One real worker process, the simulator, real Redis."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from devtools.api_thread import serving
from gateway_tasks.batches.jobs import validate_input
from gateway_tasks.batches.runner import _failure
from gateway_tasks.core.settings import Pool, load_settings
from gateway_tasks.simulator import SimConfig, SimulatorThread

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"
EMBED_MODEL = "text-embedding-3-small"


@pytest.fixture(scope="module")
def stack(redis_url, module_key_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    with SimulatorThread(SimConfig(tpm=6_000_000, rpm=60_000, base_latency_ms=2, ms_per_output_token=0.0)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini", EMBED_MODEL),
                    tpm=6_000_000, rpm=60_000)
        s = load_settings(env={}, redis_url=redis_url, key_prefix=module_key_prefix).with_(
            pools=(pool,), batch_dir=str(root / "files"), batch_lines_in_flight=100)
        with serving(s, {"acme": "normal", "other": "normal"}, concurrency=16,
                     log_path=str(root / "worker.log")) as (gw, api, keys):
            yield gw, api, keys, sim


def sdk(api, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base_url, api_key=key, max_retries=0)


def jsonl(lines) -> io.BytesIO:
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def chat_line(i: int, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": CHAT,
            "body": {"model": "gpt-4o-mini", "max_tokens": 8,
                     "messages": [{"role": "user", "content": f"summarise item {i}"}], **body}}


def wait_for(client, batch_id: str, statuses, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status}: {batch.request_counts}")


def test_a_batch_of_300_lines_with_per_line_errors(stack):
    gw, api, keys, sim = stack
    client = sdk(api, keys["acme"])
    lines = [chat_line(i) for i in range(300)]
    lines[7] = chat_line(7, model="no-such-model")             # refused by the gateway: 400
    lines[11] = chat_line(11, bogus_parameter=1)                # refused by the upstream: its 400
    before = sim.stats()["requests_ok"]
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_for(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (300, 298, 2)
    assert sim.stats()["requests_ok"] - before == 298

    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(300) if i not in (7, 11))
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    assert output[0]["response"]["body"]["object"] == "chat.completion"
    errors = {e["custom_id"]: e["response"] for e in
              (json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines())}
    assert set(errors) == {"req-7", "req-11"}
    assert errors["req-7"]["status_code"] == 400 and errors["req-11"]["status_code"] == 400
    assert errors["req-11"]["body"]["error"]["code"] == "unknown_parameter"
    listed = client.batches.list()
    assert [b.id for b in listed.data][:1] == [batch.id]

    with pytest.raises(openai.NotFoundError):                   # another tenant's ids are unknown
        sdk(api, keys["other"]).batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        sdk(api, keys["other"]).files.content(done.output_file_id)


def test_embeddings_batch_and_a_malformed_file_fails_the_batch(stack):
    gw, api, keys, _ = stack
    client = sdk(api, keys["acme"])
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": EMBED_MODEL, "input": f"text {i}", "encoding_format": "float"}} for i in range(20)]
    f = client.files.create(file=("e.jsonl", jsonl(lines)), purpose="batch")
    done = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                                  completion_window="24h").id, ("completed", "failed"))
    assert done.request_counts.completed == 20
    first = json.loads(client.files.content(done.output_file_id).text.splitlines()[0])
    assert first["response"]["body"]["object"] == "list"

    bad = client.files.create(file=("bad.jsonl", jsonl([chat_line(1), chat_line(1)])), purpose="batch")
    failed = wait_for(client, client.batches.create(input_file_id=bad.id, endpoint=CHAT,
                                                    completion_window="24h").id, ("failed", "completed"))
    assert failed.status == "failed" and failed.errors.data[0].code == "duplicate_custom_id"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="1h")


def test_cancel_stops_dispatching_at_once(stack):
    gw, api, keys, sim = stack
    client = sdk(api, keys["acme"])
    sim.set_fault("timeout", for_s=3.0, hang_s=0.5)             # the upstream stalls: lines stay queued
    f = client.files.create(file=("c.jsonl", jsonl([chat_line(i) for i in range(400)])), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    wait_for(client, batch.id, ("in_progress",))
    time.sleep(0.5)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    before = sim.stats()["requests_ok"]
    done = wait_for(client, batch.id, ("cancelled",))
    time.sleep(1.0)
    assert sim.stats()["requests_ok"] - before <= 16              # at most what was running (16 slots)
    assert done.request_counts.completed + done.request_counts.failed < 400
    assert gw.r.hlen(gw.keys.batch_inflight(gw.tenants.get("acme").owner_tag, batch.id)) == 0


def test_a_batch_past_its_completion_window_expires(stack):
    gw, api, keys, sim = stack
    client = sdk(api, keys["acme"])
    sim.set_fault("timeout", for_s=2.0, hang_s=0.3)             # the upstream stalls: lines wait
    f = client.files.create(file=("x.jsonl", jsonl([chat_line(i) for i in range(250)])), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    wait_for(client, batch.id, ("in_progress",))
    gw.r.hset(gw.keys.batch(gw.tenants.get("acme").owner_tag, batch.id), "expires_at", int(time.time()) - 1)   # the 24 h are up
    done = wait_for(client, batch.id, ("expired",))
    assert done.expired_at is not None and gw.r.hlen(gw.keys.batch_inflight(gw.tenants.get("acme").owner_tag, batch.id)) == 0
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    expired = [e for e in errors if e["error"] and e["error"]["code"] == "batch_expired"]
    assert len(expired) >= 250 - 100 - done.request_counts.completed     # never submitted: 100 in flight at most


def test_a_tenant_registered_again_sees_none_of_its_predecessors_files(stack):
    gw, api, keys, _ = stack
    gw.register_tenant("ghost", "normal")
    old = sdk(api, gw.register_tenant("ghost", "normal"))
    f = old.files.create(file=("g.jsonl", jsonl([chat_line(1)])), purpose="batch")
    gw.delete_tenant("ghost")
    new = sdk(api, gw.register_tenant("ghost", "normal"))
    with pytest.raises(openai.NotFoundError):
        new.files.retrieve(f.id)
    assert new.files.list().data == []


def test_validation_and_failure_mapping_without_a_stack():
    n, errors = validate_input(b'{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n',
                               CHAT, 10)
    assert n == 1 and errors[0]["line"] == 1 and "POST" in errors[0]["message"]
    assert validate_input(b"\n", CHAT, 10)[1][0]["code"] == "empty_file"
    status, body = _failure({"exc_type": "UpstreamRejected",
                             "exc_message": ["m", None, "", 404, "no model", "invalid_request_error", None, "x"]})
    assert status == 404 and body["error"]["code"] == "x"
    assert _failure({"exc_type": "Expired", "exc_message": ["late", None, "queue_ttl"]})[0] == 504


def test_files_are_capped_per_tenant_and_deleting_frees_the_room(make_gateway, settings, tmp_path):
    from gateway_tasks.batches.files import FileStore
    from gateway_tasks.core.errors import InvalidRequest, QuotaExceeded, TaskNotFound
    gw = make_gateway([("acme", "normal")], settings=settings.with_(batch_dir=str(tmp_path), batch_max_tenant_bytes=100))
    files = FileStore(gw)
    first = files.upload("acme", "a.jsonl", "batch", b"x" * 80)
    with pytest.raises(QuotaExceeded):
        files.upload("acme", "b.jsonl", "batch", b"y" * 80)
    with pytest.raises(InvalidRequest):
        files.upload("acme", "c.jsonl", "fine-tune", b"z")
    with pytest.raises(TaskNotFound):
        files.get("other", first["id"])
    files.delete("acme", first["id"])
    assert files.upload("acme", "b.jsonl", "batch", b"y" * 80)["bytes"] == 80
    assert not (tmp_path / "files" / first["id"]).exists()
