"""The upstream simulator: bucket maths (injected clock), OpenAI duration
format, and the HTTP app driven through the official openai SDK."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import subprocess
import sys

import httpx
import openai
import pytest

from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import Pool
from gateway_tasks.simulator.bucket import TokenBucket, ceil_ms, format_duration, format_seconds
from gateway_tasks.simulator import (SimConfig, Simulator, SimulatorProcess, SimulatorThread,
                                     config_from_args, config_to_argv)
from gateway_tasks.simulator.cli import register
from gateway_tasks.core.tokens import count_prompt_tokens

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three prime numbers."}]
PROMPT = count_prompt_tokens(MESSAGES)
FAST = dict(base_latency_ms=1.0, ms_per_output_token=0.0)
DURATION_RE = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")


class FakeClock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def client(sim: SimulatorThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.base_url, api_key="x", max_retries=0)


def chat(c: openai.OpenAI, max_tokens: int = 50, forced: int | None = None,
         model: str = "gpt-4o-mini", **kwargs):
    extra = {"sim_completion_tokens": forced} if forced is not None else None
    return c.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, extra_body=extra, **kwargs)


@pytest.fixture(scope="module")
def default_sim():
    with SimulatorThread(SimConfig(**FAST)) as sim:
        yield sim


@pytest.fixture
def sim(default_sim):
    default_sim.reset_stats()
    return default_sim


# -- bucket maths ----------------------------------------------------------------
@pytest.mark.parametrize(
    "capacity, rate, steps",
    [
        # steps: (advance_s, op, amount, expected return, expected level after)
        (10, 1, [(0, "try_take", 4, True, 6), (0, "try_take", 7, False, 6),
                 (1, "try_take", 7, True, 0)]),
        (10, 1, [(0, "take", 10, None, 0), (100, "level", None, 10, 10)]),  # refill caps
        (10, 2, [(0, "take", 14, None, -4), (1, "level", None, -2, -2),
                 (0, "wait_s", 3, 2.5, -2), (2.5, "try_take", 3, True, 0)]),  # debt
        (10, 1, [(0, "take", 8, None, 2), (0, "give", 5, None, 7),
                 (0, "give", 50, None, 10)]),  # credit capped at capacity
        (10, 1, [(0, "wait_s", 5, 0.0, 10), (0, "wait_s", 11, math.inf, 10),
                 (0, "take", 6, None, 4), (0, "reset_s", None, 6.0, 4),
                 (0, "remaining", None, 4, 4)]),
        (100, 10, [(0, "take", 100.5, None, -0.5), (0, "remaining", None, 0, -0.5),
                   (0, "fill", None, None, 100)]),
    ],
)
def test_bucket_table(capacity, rate, steps):
    clock = FakeClock()
    bucket = TokenBucket(capacity, rate, clock)
    for advance_s, op, amount, expected, level in steps:
        clock.advance(advance_s)
        if op == "level":
            got = bucket.level
        else:
            method = getattr(bucket, op)
            got = method() if amount is None else method(amount)
        if expected is not None:
            assert got == pytest.approx(expected), (op, amount)
        assert bucket.level == pytest.approx(level), (op, amount)


def test_bucket_waiting_exactly_wait_s_is_enough():
    clock = FakeClock()
    bucket = TokenBucket(1000 / 60 * 60, 1000 / 60, clock)
    bucket.take(1000)
    wait = bucket.wait_s(333)
    clock.advance(wait)
    assert bucket.try_take(333)


def test_bucket_rejects_bad_parameters():
    with pytest.raises(ConfigError):
        TokenBucket(0, 1)
    with pytest.raises(ConfigError):
        TokenBucket(1, 0)


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (-1, "0s"), (0.0001, "1ms"), (0.12, "120ms"), (0.999, "999ms"), (1, "1s"),
    (1.5, "1.5s"), (13.2, "13.2s"), (59.999, "59.999s"), (60, "1m0s"), (61.25, "1m1.25s"),
    (360, "6m0s"), (3600, "1h0m0s"), (3723.5, "1h2m3.5s"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds, text, ms", [
    (0, "0", 0), (0.12, "0.12", 120), (13, "13", 13_000), (1.0001, "1.001", 1001),
])
def test_retry_after_formats(seconds, text, ms):
    assert format_seconds(seconds) == text
    assert ceil_ms(seconds) == ms


# -- admission logic (no HTTP) -----------------------------------------------------
@pytest.mark.parametrize("charge, level_after_admit, level_after_complete", [
    ("reserve", 1000 - 110, 1000 - 30),   # prompt 10 + max 100, then 80 unused back
    ("actual", 1000, 1000 - 30),          # nothing at admission, prompt+completion after
])
def test_simulator_charge_modes(charge, level_after_admit, level_after_complete):
    clock = FakeClock()
    simulator = Simulator(SimConfig(tpm=1000, rpm=60, charge=charge), clock)
    assert simulator.admit(10, 100).ok
    assert simulator.tokens.level == pytest.approx(level_after_admit)
    assert simulator.requests.level == pytest.approx(59)
    simulator.complete(10, 100, 20)
    assert simulator.tokens.level == pytest.approx(level_after_complete)


def test_simulator_refusal_debits_nothing_and_names_the_limit():
    clock = FakeClock()
    simulator = Simulator(SimConfig(tpm=600, rpm=2), clock)   # 10 tokens/s, 1 req per 30 s
    assert simulator.admit(100, 400).ok
    refused = simulator.admit(50, 100)
    assert (refused.ok, refused.kind, refused.requested_tokens) == (False, "tokens", 150)
    assert refused.retry_after_s == pytest.approx((150 - 100) / 10)
    assert simulator.tokens.level == pytest.approx(100)
    assert simulator.requests.level == pytest.approx(1)
    assert simulator.admit(10, 10).ok
    refused = simulator.admit(10, 10)
    assert refused.kind == "requests" and refused.retry_after_s == pytest.approx(30)


def test_sim_config_validation_and_pool():
    with pytest.raises(ConfigError, match="charge"):
        SimConfig(charge="later")
    with pytest.raises(ConfigError, match="fail_rate"):
        SimConfig(fail_rate=2)
    with pytest.raises(ConfigError, match="tpm"):
        SimConfig(tpm=0)
    with pytest.raises(ConfigError, match=r"server_stack='twisted' is invalid; expected one of \['native', 'python'\]"):
        SimConfig(server_stack="twisted")
    assert SimConfig().uvicorn_loop_http == ("uvloop", "httptools")
    assert SimConfig(server_stack="python").uvicorn_loop_http == ("asyncio", "h11")
    assert SimConfig(models=["a"]).models == ("a",)
    with pytest.raises(ConfigError, match="max_n"):
        SimConfig(max_n=0)
    with pytest.raises(ConfigError, match="context_window_tokens"):
        SimConfig(context_window_tokens={"a": 0})
    windows = SimConfig(context_window_tokens={"a": 100})
    assert (windows.context_window("a"), windows.context_window("b")) == (100, None)
    pool = Pool("p", base_url="http://x/v1", api_key="k", models=("m",), tpm=1200, rpm=30,
                burst_s=30, charge="actual")
    cfg = SimConfig.for_pool(pool, seed=3)
    assert (cfg.tpm, cfg.rpm, cfg.burst_s, cfg.charge, cfg.models, cfg.seed) == \
        (1200, 30, 30, "actual", ("m",), 3)
    assert (cfg.token_capacity, cfg.request_capacity) == (600, 15)
    assert (cfg.token_capacity, cfg.request_capacity) == (pool.token_capacity, pool.request_capacity)
    tiny = SimConfig(rpm=1, burst_s=1)                 # 1/60 of a request: the floor of one
    assert tiny.request_capacity == Pool("t", base_url="http://x/v1", api_key="k", models=("m",),
                                         tpm=1, rpm=1, burst_s=1).request_capacity == 1.0


# -- HTTP through the openai SDK --------------------------------------------------
def test_usage_matches_gateway_estimate(sim):
    raw = chat(client(sim), max_tokens=50)
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.model == "gpt-4o-mini"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.usage.prompt_tokens == PROMPT
    assert completion.usage.completion_tokens == 30          # ceil(50 * 0.6)
    assert completion.usage.total_tokens == PROMPT + 30
    assert completion.choices[0].finish_reason == "stop"
    for kind in ("requests", "tokens"):
        assert raw.headers[f"x-ratelimit-limit-{kind}"]
        assert int(raw.headers[f"x-ratelimit-remaining-{kind}"]) >= 0
        assert DURATION_RE.match(raw.headers[f"x-ratelimit-reset-{kind}"])
    assert raw.headers["x-ratelimit-limit-tokens"] == "600000"


@pytest.mark.parametrize("max_tokens, forced, completion, finish", [
    (50, 7, 7, "stop"), (50, 50, 50, "length"), (50, 500, 50, "length"), (40, 0, 0, "stop"),
])
def test_forced_completion_via_extra_body(sim, max_tokens, forced, completion, finish):
    result = chat(client(sim), max_tokens=max_tokens, forced=forced).parse()
    assert result.usage.completion_tokens == completion
    assert result.choices[0].finish_reason == finish


def test_max_completion_tokens_and_default(sim):
    c = client(sim)
    result = c.chat.completions.create(model="gpt-4o", messages=MESSAGES,
                                       max_completion_tokens=10)
    assert result.usage.completion_tokens == 6 and result.model == "gpt-4o"
    result = c.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert result.usage.completion_tokens == math.ceil(256 * 0.6)


def test_rpm_exhausted_gives_429_with_headers():
    with SimulatorThread(SimConfig(rpm=3, **FAST)) as sim:
        c = client(sim)
        for _ in range(3):
            chat(c, forced=1)
        with pytest.raises(openai.RateLimitError) as info:
            chat(c, forced=1)
        err = info.value
        assert err.status_code == 429
        assert err.type == "requests" and err.code == "rate_limit_exceeded"
        headers = err.response.headers
        assert 0 < float(headers["retry-after"]) <= 20
        assert 0 < int(headers["retry-after-ms"]) <= 20_000
        assert headers["x-ratelimit-limit-requests"] == "3"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert DURATION_RE.match(headers["x-ratelimit-reset-requests"])
        assert "x-ratelimit-remaining-tokens" in headers
        stats = sim.stats()
        assert (stats["requests_ok"], stats["requests_429"]) == (3, 1)
        assert stats["requests_429_by_type"] == {"requests": 1, "tokens": 0}


def test_tpm_exhausted_gives_429_tokens():
    with SimulatorThread(SimConfig(tpm=1000, **FAST)) as sim:   # refill 16.7 tokens/s
        c = client(sim)
        chat(c, max_tokens=600, forced=600)
        with pytest.raises(openai.RateLimitError) as info:
            chat(c, max_tokens=600, forced=600)
        err = info.value
        assert err.type == "tokens" and err.code == "rate_limit_exceeded"
        assert "tokens per min (TPM)" in err.message
        retry_after = float(err.response.headers["retry-after"])
        # about (600 + PROMPT - remaining) / (1000/60) seconds; refill during the test shortens it
        assert 5 < retry_after <= (600 + PROMPT) * 60 / 1000
        assert sim.stats()["requests_429_by_type"]["tokens"] == 1


def test_reserve_mode_credits_back_unused_tokens():
    with SimulatorThread(SimConfig(tpm=6000, **FAST)) as sim:
        raw = chat(client(sim), max_tokens=1000, forced=5)
        used = raw.parse().usage.total_tokens
        remaining = int(raw.headers["x-ratelimit-remaining-tokens"])
        # Without the credit it would be about 6000 - (PROMPT + 1000).
        assert 6000 - used <= remaining <= 6000


def test_actual_mode_admits_on_prompt_then_charges_usage():
    with SimulatorThread(SimConfig(tpm=1000, charge="actual", **FAST)) as sim:
        c = client(sim)
        first = chat(c, max_tokens=900, forced=900)
        assert int(first.headers["x-ratelimit-remaining-tokens"]) < 1000 - 900
        chat(c, max_tokens=900, forced=900)    # reserve mode would refuse this one
        assert int(sim.stats()["remaining_tokens"]) == 0   # in debt now
        with pytest.raises(openai.RateLimitError) as info:
            chat(c, max_tokens=900, forced=900)
        assert info.value.type == "tokens"


def test_concurrent_requests_never_overspend_the_bucket():
    async def burst(base_url: str) -> list[int]:
        c = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)

        async def one() -> int:
            try:
                await c.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES,
                                                max_tokens=5)
                return 200
            except openai.RateLimitError:
                return 429

        try:
            return await asyncio.gather(*(one() for _ in range(12)))
        finally:
            await c.close()

    with SimulatorThread(SimConfig(rpm=5, base_latency_ms=50)) as sim:
        codes = asyncio.run(burst(sim.base_url))
        assert codes.count(200) == 5 and codes.count(429) == 7


def test_request_larger_than_capacity_is_400():
    with SimulatorThread(SimConfig(tpm=1000, **FAST)) as sim:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client(sim), max_tokens=1000)
        assert info.value.code == "request_too_large"
        assert "exceeds the token bucket capacity" in info.value.message


def test_unknown_model_is_404(sim):
    with pytest.raises(openai.NotFoundError) as info:
        chat(client(sim), model="gpt-5-nonexistent")
    assert info.value.code == "model_not_found"
    assert info.value.type == "invalid_request_error" and info.value.param is None
    assert info.value.body["message"] == \
        "The model `gpt-5-nonexistent` does not exist or you do not have access to it."


def test_unknown_parameter_is_400_naming_it_and_documented_ones_pass(sim):
    c = client(sim)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, extra_body={"temprature": 0.2})
    assert (info.value.type, info.value.param, info.value.code) == \
        ("invalid_request_error", "temprature", "unknown_parameter")
    assert info.value.body["message"] == "Unknown parameter: 'temprature'."
    raw = chat(c, temperature=0.2, top_p=0.9, seed=1, user="u", stop=["x"], forced=3)
    assert raw.parse().usage.completion_tokens == 3
    stats = sim.stats()
    assert stats["requests_invalid"] == 1 and stats["requests_ok"] == 1


def test_n_over_max_n_is_400_and_n_choices_are_served_up_to_it(sim):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client(sim), n=2)
    assert (info.value.param, info.value.code) == ("n", "unsupported_value")
    assert "Only the default (1) value is supported" in info.value.body["message"]
    with SimulatorThread(SimConfig(max_n=3, **FAST)) as many:
        completion = chat(client(many), n=3, forced=5).parse()
        assert [ch.index for ch in completion.choices] == [0, 1, 2]
        assert completion.usage.completion_tokens == 15
        streamed = list(client(many).chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES, max_tokens=8, n=2, stream=True,
            stream_options={"include_usage": True}))
        assert {ch.choices[0].index for ch in streamed if ch.choices} == {0, 1}
        assert streamed[-1].usage.completion_tokens == 2 * math.ceil(8 * 0.6)
        with pytest.raises(openai.BadRequestError) as info:
            chat(client(many), n=4)
        assert "Supported values are 1 to 3" in info.value.body["message"]


def test_prompt_past_the_context_window_is_400_context_length_exceeded():
    window = PROMPT + 20
    with SimulatorThread(SimConfig(context_window_tokens={"gpt-4o-mini": window}, **FAST)) as sim:
        assert chat(client(sim), max_tokens=20).parse().usage.prompt_tokens == PROMPT   # just fits
        with pytest.raises(openai.BadRequestError) as info:
            chat(client(sim), max_tokens=21)
        assert (info.value.type, info.value.param, info.value.code) == \
            ("invalid_request_error", "messages", "context_length_exceeded")
        assert info.value.body["message"] == (
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{window + 1} tokens ({PROMPT} in the messages, 21 in the completion). Please reduce "
            f"the length of the messages or completion.")
        assert chat(client(sim), max_tokens=500, model="gpt-4o").parse()   # no window for it
        assert sim.stats()["requests_invalid"] == 1


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"model": "gpt-4o-mini"}', "messages"),
    (b'{"model": "gpt-4o-mini", "messages": "hi"}', "messages"),
    (b'{"model": "gpt-4o-mini", "messages": [{"role": "user"}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "model"),
    (b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": "ten"}', "max_tokens"),
    (b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": 0}', "max_tokens"),
    (b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "n": 2}', "n"),
])
def test_malformed_body_is_400(sim, body, param):
    response = httpx.post(f"{sim.base_url}/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param and "code" in error
    assert "x-ratelimit-remaining-tokens" in response.headers


def test_stream_sends_openai_chunks_with_usage_and_counts_the_request(sim):
    c = client(sim)
    plain = c.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=30)
    chunks = list(c.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=30,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content and len(chunks) > 4
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens
    assert {ch.id for ch in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    without = list(c.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=30,
                                             stream=True))
    assert all(ch.usage is None for ch in without)
    stats = sim.stats()
    assert stats["requests_ok"] == 3 and stats["tokens_completion"] == 3 * plain.usage.completion_tokens


@pytest.mark.parametrize("extra,param", [({"stream": "yes"}, "stream"),
                                         ({"stream_options": {"include_usage": True}}, "stream_options")])
def test_bad_stream_fields_are_400(sim, extra, param):
    body = {"model": "gpt-4o-mini", "messages": MESSAGES, **extra}
    response = httpx.post(f"{sim.base_url}/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_fail_rate_is_deterministic_and_reset_reseeds():
    def outcomes(c: openai.OpenAI) -> list[bool]:
        out = []
        for _ in range(10):
            try:
                chat(c, forced=1)
                out.append(True)
            except openai.InternalServerError as exc:
                assert exc.type == "server_error"
                out.append(False)
        return out

    with SimulatorThread(SimConfig(fail_rate=0.5, seed=7, **FAST)) as sim:
        rng = random.Random(7)
        expected = [not rng.random() < 0.5 for _ in range(10)]
        assert outcomes(client(sim)) == expected
        assert sim.stats()["requests_error"] == expected.count(False)
        sim.reset_stats()
        assert outcomes(client(sim)) == expected


def test_stats_count_and_reset(sim):
    c = client(sim)
    chat(c, max_tokens=20, forced=4)
    chat(c, max_tokens=20, forced=6, model="gpt-4o")
    with pytest.raises(openai.NotFoundError):
        chat(c, model="nope")
    stats = sim.stats()
    assert stats["requests_ok"] == 2 and stats["requests_429"] == 0
    assert stats["requests_error"] == 0 and stats["requests_invalid"] == 1
    assert stats["tokens_prompt"] == 2 * PROMPT and stats["tokens_completion"] == 10
    assert stats["per_model"]["gpt-4o-mini"]["requests_ok"] == 1
    assert stats["per_model"]["gpt-4o"]["tokens_completion"] == 6
    series = stats["served_per_s"]
    assert sum(series["tokens"]) == 2 * PROMPT + 10 and sum(series["requests"]) == 2
    assert len(series["tokens"]) == len(series["requests"]) <= 600
    assert series["first_second"] <= stats["now_monotonic"]
    assert stats["started_monotonic"] <= stats["now_monotonic"]
    assert 0 <= stats["remaining_tokens"] <= 600_000   # refills 10k tokens/s
    sim.reset_stats()
    stats = sim.stats()
    assert (stats["requests_ok"], stats["tokens_prompt"], stats["per_model"]) == (0, 0, {})
    assert sum(stats["served_per_s"]["tokens"]) == 0
    assert stats["remaining_tokens"] == 600_000 and stats["remaining_requests"] == 6_000


def test_health_and_models(sim):
    assert httpx.get(sim.base_url.removesuffix("/v1") + "/health").json() == {"ok": True}
    assert [m.id for m in client(sim).models.list()] == [*SimConfig().models, *SimConfig().embedding_models]


# -- running it ----------------------------------------------------------------------
def test_thread_stops_cleanly():
    sim = SimulatorThread(SimConfig(**FAST)).start()
    url = sim.base_url
    assert re.match(r"^http://127\.0\.0\.1:\d+/v1$", url)
    sim.stop()
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.removesuffix("/v1") + "/health", timeout=1.0)


def test_register_and_flags_round_trip():
    parser = argparse.ArgumentParser(prog="gateway")
    register(parser.add_subparsers(dest="command", required=True))
    cfg = SimConfig(tpm=1234, rpm=56, burst_s=7.5, charge="actual", base_latency_ms=3.0,
                    ms_per_output_token=0.25, completion_fraction=0.5, default_max_tokens=64,
                    models=("a", "b"), fail_rate=0.1, seed=9, server_stack="python", max_n=3,
                    context_window_tokens={"a": 100, "b": 8192})
    args = parser.parse_args(["simulate-upstream", "--port", "0", *config_to_argv(cfg)])
    assert callable(args.func) and args.port == 0 and args.host == "127.0.0.1"
    assert config_from_args(args) == cfg
    defaults = parser.parse_args(["simulate-upstream"])
    assert config_from_args(defaults) == SimConfig() and defaults.port == 8099
    bad = parser.parse_args(["simulate-upstream", "--context-window-tokens", "a=many"])
    with pytest.raises(ConfigError, match="'a=many' is not MODEL=TOKENS"):
        config_from_args(bad)


def test_module_help():
    out = subprocess.run([sys.executable, "-m", "gateway_tasks.simulator.cli", "--help"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--ms-per-output-token" in out.stdout


@pytest.mark.parametrize("stack", ["native", "python"])
def test_simulator_process(stack):
    with SimulatorProcess(SimConfig(rpm=2, server_stack=stack, **FAST)) as proc:
        c = openai.OpenAI(base_url=proc.base_url, api_key="x", max_retries=0)
        assert c.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES,
                                         max_tokens=4).usage.prompt_tokens == PROMPT
        chat(c, forced=1)
        with pytest.raises(openai.RateLimitError):
            chat(c, forced=1)
        assert proc.stats()["requests_ok"] == 2
        pid_proc = proc.proc
    assert pid_proc.poll() is not None


# -- a required API key ------------------------------------------------------------------
SIM_KEY = "sk-sim-required-0123456789"


def test_a_required_api_key_is_checked_as_openai_does_and_never_shown():
    with SimulatorThread(SimConfig(api_key=SIM_KEY, **FAST)) as sim:
        right = openai.OpenAI(base_url=sim.base_url, api_key=SIM_KEY, max_retries=0)
        assert chat(right).parse().usage.prompt_tokens == PROMPT
        assert [m.id for m in right.models.list()] == [*SimConfig().models, *SimConfig().embedding_models]
        wrong = openai.OpenAI(base_url=sim.base_url, api_key="sk-not-it", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            chat(wrong)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        assert "sk-not-it" not in str(err.value.body)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        bare = httpx.post(f"{sim.base_url}/chat/completions", json={"model": "gpt-4o-mini", "messages": MESSAGES})
        assert bare.status_code == 401 and bare.json()["error"]["type"] == "invalid_request_error"
        stats = sim.stats()
        assert stats["requests_ok"] == 1 and stats["requests_unauthorized"] == 2
        assert stats["config"]["api_key_required"] is True and SIM_KEY not in json.dumps(stats)
        assert SIM_KEY not in repr(sim.config)
    with SimulatorThread(SimConfig(**FAST)) as open_sim:   # no key set: any key, or none, is taken
        assert httpx.post(f"{open_sim.base_url}/chat/completions", json={
            "model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 4}).status_code == 200
        assert open_sim.stats()["config"]["api_key_required"] is False


def test_the_api_key_flag_reads_its_default_from_the_environment_and_stays_off_the_command_line(monkeypatch):
    monkeypatch.setenv("SIMULATOR_API_KEY", SIM_KEY)
    parser = argparse.ArgumentParser(prog="gateway")
    register(parser.add_subparsers(dest="command", required=True))
    assert config_from_args(parser.parse_args(["simulate-upstream"])).api_key == SIM_KEY
    assert config_from_args(parser.parse_args(["simulate-upstream", "--api-key", "other"])).api_key == "other"
    monkeypatch.delenv("SIMULATOR_API_KEY")
    with SimulatorProcess(SimConfig(api_key=SIM_KEY, **FAST)) as proc:
        assert SIM_KEY not in " ".join(proc.argv())
        assert httpx.get(f"{proc.base_url}/models").status_code == 401
        assert httpx.get(f"{proc.base_url}/models", headers={"Authorization": f"Bearer {SIM_KEY}"}).status_code == 200
