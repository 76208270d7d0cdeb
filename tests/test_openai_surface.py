"""The OpenAI surface a tenant reaches for, through the official openai SDK against the
gateway's REST API (real HTTP), one real worker process, the simulator, real Redis:
/v1/models, /v1/embeddings (the same queue and TPM accounting as chat)."""

from __future__ import annotations

import math

import openai
import pytest

from devtools.api_thread import serving
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool, load_settings
from gateway_tasks.core.stats import ACTUAL_TOKENS, COMPLETED, tier_field
from gateway_tasks.core.tokens import count_text_tokens
from gateway_tasks.simulator import SimConfig, SimulatorThread

pytestmark = pytest.mark.slow
EMBEDDING_MODEL = "text-embedding-3-small"


@pytest.fixture(scope="module")
def stack(redis_url, module_key_prefix, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai") / "worker.log"
    with SimulatorThread(SimConfig(tpm=600_000, rpm=6_000, base_latency_ms=5, ms_per_output_token=0.01)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k",
                    models=("gpt-4o-mini", "gpt-4o", EMBEDDING_MODEL), tpm=600_000, rpm=6_000)
        s = load_settings(env={}, redis_url=redis_url, key_prefix=module_key_prefix).with_(pools=(pool,))
        with serving(s, {"acme": "vip", "bob": "normal", "cal": "batch"}, concurrency=8,
                     log_path=str(log)) as (gw, api, keys):
            yield gw, api, keys, sim


def sdk(api, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base_url, api_key=key, max_retries=0)


def test_models_lists_what_the_pools_serve(stack):
    gw, api, keys, _ = stack
    client = sdk(api, keys["bob"])
    listed = [m.id for m in client.models.list()]
    assert listed == ["gpt-4o-mini", "gpt-4o", EMBEDDING_MODEL]
    assert client.models.retrieve(EMBEDDING_MODEL).owned_by == "gateway-tasks:default"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.AuthenticationError):
        sdk(api, "not-a-key").models.list()


def test_embeddings_through_the_queue_with_the_input_tokens_charged(stack, r):
    gw, api, keys, sim = stack
    client = sdk(api, keys["acme"])
    texts = ["the quick brown fox", "jumps over the lazy dog"]
    before = sim.stats()["per_model"].get(EMBEDDING_MODEL, {}).get("tokens_prompt", 0)
    got = client.embeddings.create(model=EMBEDDING_MODEL, input=texts)          # the SDK asks for base64
    assert [d.index for d in got.data] == [0, 1] and len(got.data[0].embedding) == 64
    assert math.isclose(sum(x * x for x in got.data[0].embedding), 1.0, rel_tol=1e-4)
    expected_tokens = sum(count_text_tokens(t) for t in texts)
    assert got.usage.prompt_tokens == expected_tokens
    assert sim.stats()["per_model"][EMBEDDING_MODEL]["tokens_prompt"] - before == expected_tokens
    again = client.embeddings.create(model=EMBEDDING_MODEL, input=texts, encoding_format="float",
                                     dimensions=8)
    assert len(again.data[1].embedding) == 8
    stats = {k.decode(): int(v) for k, v in r.hgetall(Keys(gw.settings.key_prefix).stats("default")).items()}
    assert stats[tier_field(COMPLETED, "vip")] >= 2
    assert stats[tier_field(ACTUAL_TOKENS, "vip")] >= 2 * expected_tokens

    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=EMBEDDING_MODEL, input="   ")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="gpt-4o-nope", input="hi")


def test_usage_counts_match_the_simulators_own_accounting(stack):
    gw, api, keys, sim = stack
    key = gw.register_tenant("uma", "normal")
    client = sdk(api, key)
    before = sim.stats()
    for i in range(3):
        client.chat.completions.create(model="gpt-4o-mini", max_tokens=20,
                                       messages=[{"role": "user", "content": f"count me {i}"}])
    client.embeddings.create(model=EMBEDDING_MODEL, input=["one", "two three"])
    sim.set_fault("rate_limit", for_s=0.3, retry_after_s=0.2)     # one 429 the gateway absorbs
    client.chat.completions.create(model="gpt-4o-mini", max_tokens=20,
                                   messages=[{"role": "user", "content": "after a 429"}])
    after = sim.stats()
    gw.r.hset(gw.keys.overload_state, "level", 4)                 # normal work is deferred at L4
    try:
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="gpt-4o-mini", max_tokens=20,
                                           messages=[{"role": "user", "content": "deferred"}])
    finally:
        gw.r.hset(gw.keys.overload_state, "level", 0)

    report = client.get("/usage", cast_to=object, options={"params": {"hours": 2, "days": 1}})
    served = (after["tokens_prompt"] - before["tokens_prompt"]) + (after["tokens_completion"]
                                                                  - before["tokens_completion"])
    totals = report["totals"]["hours"]
    assert totals["requests"] == after["requests_ok"] - before["requests_ok"] == 5
    assert totals["actual_tokens"] == served
    assert totals["upstream_429"] == after["requests_429"] - before["requests_429"] >= 1
    assert totals["deferred"] == 1
    assert totals["est_tokens"] >= totals["actual_tokens"] - 1
    assert report["totals"]["days"] == totals and len(report["hours"]) == 2 and len(report["days"]) == 1
    assert sdk(api, keys["bob"]).get("/usage", cast_to=object)["totals"]["days"]["requests"] == 0
