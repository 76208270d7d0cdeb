"""Streaming through the queue, end to end: the openai SDK with stream=True against the
gateway's REST API (real HTTP), a real worker process, the streaming simulator, real
Redis.  Chunks arrive as OpenAI chunks, the text equals the task's stored result, the
bucket is settled to the upstream's final usage, and failures are SSE error events."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway_tasks.upstream.chunks import ChunkWriter, read
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool
from gateway_tasks.core.stats import ACTUAL_TOKENS, COMPLETED, tier_field
from devtools.api_thread import serving
from gateway_tasks.simulator import SimConfig, SimulatorThread

pytestmark = pytest.mark.slow
HELLO = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture
def stack(settings, r, tmp_path):
    with SimulatorThread(SimConfig(tpm=600_000, rpm=6_000, base_latency_ms=20,
                                   ms_per_output_token=5)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",),
                    tpm=600_000, rpm=6_000)
        with serving(settings.with_(pools=(pool,)), {"acme": "normal"}, concurrency=4,
                     log_path=str(tmp_path / "worker.log")) as (gw, api, keys):
            yield gw, api, keys["acme"], sim


def test_openai_sdk_streams_through_the_queue_and_usage_settles(stack, r):
    gw, api, key, sim = stack
    client = openai.OpenAI(base_url=api.base_url, api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=HELLO, max_tokens=40, stream=True,
        stream_options={"include_usage": True})
    task_id = raw.headers["x-gateway-task-id"]
    assert raw.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    assert chunks[0].choices[0].delta.role == "assistant" and len(chunks) > 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    usage = chunks[-1].usage
    assert usage.completion_tokens == 24 and text.startswith("lorem ipsum")      # 60 % of 40

    result = gw.result(task_id).get(timeout=10)
    assert result["response"]["choices"][0]["message"]["content"] == text
    assert result["tokens"]["total"] == usage.total_tokens
    stats = {k.decode(): int(v) for k, v in r.hgetall(Keys(gw.settings.key_prefix).stats("default")).items()
             if k.decode().startswith(("actual", "completed"))}
    assert stats[tier_field(ACTUAL_TOKENS, "normal")] == usage.total_tokens     # settled to usage
    assert stats[tier_field(COMPLETED, "normal")] == 1
    assert not r.exists(Keys(gw.settings.key_prefix).chunks(task_id))           # read, then dropped
    assert sim.stats()["requests_ok"] == 1

    # without include_usage the client gets no usage, as from OpenAI; same text
    again = list(client.chat.completions.create(model="gpt-4o-mini", messages=HELLO, max_tokens=40,
                                                stream=True))
    assert all(c.usage is None for c in again)
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == text


def test_raw_sse_lines_end_with_done_and_bad_input_is_json_400(stack):
    gw, api, key, _ = stack
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{api.base_url}/chat/completions", headers=headers, timeout=30,
                      json={"messages": HELLO, "max_tokens": 8, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    docs = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(d["object"] == "chat.completion.chunk" for d in docs)
    bad = httpx.post(f"{api.base_url}/chat/completions", headers=headers, timeout=10,
                     json={"messages": HELLO, "stream": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "ValidationError"


def test_a_broken_or_repeated_stream_is_an_error_event(r, settings):
    keys = Keys(settings.key_prefix)
    w = ChunkWriter(r, keys, "t1", ttl_s=30)
    assert not w.started_before()
    w.chunk({"choices": [{"delta": {"content": "hi"}}]})
    w.error("UpstreamError", "broke")
    assert w.started_before() and 0 < r.ttl(keys.chunks("t1")) <= 30
    events = read(r, keys, "t1", block_ms=10)
    assert [e.kind for e in events] == ["chunk", "error"] and events[1].data["message"] == "broke"
    assert read(r, keys, "t1", after_id=events[-1].id, block_ms=10) == []


def test_a_repeated_idempotent_stream_replays_the_stored_result(stack):
    gw, api, key, _ = stack
    client = openai.OpenAI(base_url=api.base_url, api_key=key, max_retries=0)
    kwargs = dict(model="gpt-4o-mini", messages=HELLO, max_tokens=20, stream=True,
                  stream_options={"include_usage": True}, extra_body={"idempotency_key": "once"})
    first = list(client.chat.completions.create(**kwargs))
    again = list(client.chat.completions.create(**kwargs))        # the same task: its stream is gone
    text = lambda chunks: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # noqa: E731
    assert text(again) == text(first) and text(first)
    assert again[-1].usage.total_tokens == first[-1].usage.total_tokens


def test_a_stream_that_breaks_after_chunks_is_stream_broken_not_a_retry():
    """An upstream that sends two chunks and then drops the connection: the chunks were
    passed on, so the call must fail (StreamBroken), never be retried as if nothing came."""
    import threading
    import time

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from gateway_tasks.local.ports import free_port
    from gateway_tasks.upstream.client import StreamBroken, chat_stream

    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini",
             "choices": [{"index": 0, "delta": {"content": "partial "}, "finish_reason": None}]}

    async def broken(request):
        async def gen():
            for _ in range(2):
                yield f"data: {json.dumps(chunk)}\n\n"
            raise RuntimeError("upstream fell over")
        return StreamingResponse(gen(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/chat/completions", broken,
                                                                   methods=["POST"])]),
                                           host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        pool = Pool("broken", base_url=f"http://127.0.0.1:{port}/v1", api_key="k", models=("gpt-4o-mini",),
                    tpm=100_000, rpm=1_000, timeout_s=10)
        got = []
        with pytest.raises(StreamBroken, match="after 2 chunks"):
            chat_stream(pool, "gpt-4o-mini", HELLO, 10, None, got.append, prompt_tokens=5)
        assert len(got) == 2
    finally:
        server.should_exit = True
        thread.join(timeout=10)
