"""A local OpenAI-compatible upstream with OpenAI-style TPM/RPM rate limits.

It stands in for a real provider in the demo, the tests and the benchmark, and
looks like one to the official ``openai`` SDK:

* ``POST /v1/chat/completions`` answers in the ``chat.completion`` shape.
  ``usage.prompt_tokens`` is ``tokens.count_prompt_tokens(messages)``, so the
  gateway's estimate equals what the upstream reports.  The completion length
  is ``max(1, ceil(max_tokens * completion_fraction))`` unless the body forces
  it with ``sim_completion_tokens`` (``extra_body`` in the SDK); it is capped
  at ``max_tokens`` and ``finish_reason`` is ``"length"`` when it reaches it.
  The reply is filler text and takes ``base_latency_ms +
  completion_tokens * ms_per_output_token`` to arrive.
* Two continuous-refill buckets (requests and tokens, refill ``rpm/60`` and
  ``tpm/60`` per second, capacity ``rpm|tpm * burst_s / 60``) admit requests.
  ``charge="reserve"`` debits ``prompt + max_tokens`` at admission and credits
  the unused part of ``max_tokens`` back when the reply completes;
  ``charge="actual"`` admits when the bucket holds the prompt tokens and
  debits ``prompt + completion`` on completion (the bucket may go into debt).
  A refused request gets 429 with an OpenAI-style body (type ``"requests"``
  or ``"tokens"``, code ``rate_limit_exceeded``), ``Retry-After`` (seconds,
  maybe fractional) and ``retry-after-ms``.  Every chat answer carries the
  ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers; limits
  are the per-minute rpm/tpm, remaining and reset describe the buckets.
* A request whose ``prompt + max_tokens`` exceeds the token capacity could
  never be admitted.  OpenAI answers 429 for that, which makes clients retry
  forever; the simulator answers **400** (``invalid_request_error``, code
  ``request_too_large``) so the mistake surfaces at once.
* ``fail_rate`` answers that fraction of valid requests with 500
  (``server_error``), drawn from ``random.Random(seed)`` before admission, so
  a failed request charges neither bucket and the failure pattern is
  reproducible (``POST /stats/reset`` re-seeds it).
* ``GET /stats`` counts requests and tokens, per model too, plus the tokens
  served per monotonic second over the last 10 minutes;
  ``POST /stats/reset`` zeroes them and refills the buckets.
  ``GET /health`` answers ``{"ok": true}``; ``GET /v1/models`` lists models.

Streaming and ``n > 1`` are rejected with 400.  Run it with ``serve`` (blocking),
``SimulatorThread`` (tests), ``SimulatorProcess`` (demo), ``python -m
gateway_tasks.devtools.simulator.app`` or ``gateway simulate-upstream``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gateway_tasks.core.errors import ApiError, ConfigError, GatewayError, InvalidRequest, UpstreamError
from gateway_tasks.core.settings import CHARGE_MODES, Pool, bucket_capacity
from gateway_tasks.devtools.simulator.bucket import Clock, TokenBucket, ceil_ms, format_duration, format_seconds
from gateway_tasks.core.tokens import count_prompt_tokens, validate_messages

SERIES_WINDOW_S = 600
_SUMMARY = (__doc__ or "").split("\n\n")[0]
FILLER_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing",
                "elit", "sed", "do", "eiusmod", "tempor", "incididunt", "ut", "labore",
                "et", "dolore", "magna", "aliqua")


# -- configuration ------------------------------------------------------------
@dataclass(frozen=True)
class SimConfig:
    """How the simulated upstream limits and answers traffic."""

    tpm: int = 600_000
    rpm: int = 6_000
    burst_s: float = 60.0
    charge: str = "reserve"
    base_latency_ms: float = 20.0
    ms_per_output_token: float = 0.05
    completion_fraction: float = 0.6
    default_max_tokens: int = 256
    models: tuple[str, ...] = ("gpt-4o-mini", "gpt-4o")
    fail_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.models, str):
            object.__setattr__(self, "models", (self.models,))
        elif not isinstance(self.models, tuple):
            object.__setattr__(self, "models", tuple(self.models))
        self.validate()

    def validate(self) -> "SimConfig":
        _check(self.tpm > 0, "tpm", self.tpm, "> 0 tokens per minute")
        _check(self.rpm > 0, "rpm", self.rpm, "> 0 requests per minute")
        _check(self.burst_s > 0, "burst_s", self.burst_s, "> 0 seconds")
        _check(self.charge in CHARGE_MODES, "charge", self.charge, f"one of {CHARGE_MODES}")
        _check(self.base_latency_ms >= 0, "base_latency_ms", self.base_latency_ms, ">= 0")
        _check(self.ms_per_output_token >= 0, "ms_per_output_token",
               self.ms_per_output_token, ">= 0")
        _check(0 < self.completion_fraction <= 1, "completion_fraction",
               self.completion_fraction, "in (0, 1]")
        _check(self.default_max_tokens > 0, "default_max_tokens", self.default_max_tokens, "> 0")
        _check(len(self.models) > 0 and all(isinstance(m, str) and m for m in self.models),
               "models", self.models, "at least one non-empty model name")
        _check(0 <= self.fail_rate <= 1, "fail_rate", self.fail_rate, "in [0, 1]")
        return self

    @property
    def token_capacity(self) -> float:
        return bucket_capacity(self.tpm, self.burst_s)

    @property
    def request_capacity(self) -> float:
        return max(1.0, bucket_capacity(self.rpm, self.burst_s))

    @classmethod
    def for_pool(cls, pool: Pool, **overrides: Any) -> "SimConfig":
        """A simulator with the same quota, burst, charge mode and models as ``pool``."""
        base: dict[str, Any] = dict(tpm=pool.tpm, rpm=pool.rpm, burst_s=pool.burst_s,
                                    charge=pool.charge, models=pool.models)
        base.update(overrides)
        return cls(**base)


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"simulator: {name}={value!r} is invalid; expected {expected}")


# -- errors answered to clients -------------------------------------------------
INVALID = "invalid_request_error"


def error_body(exc: ApiError) -> dict[str, Any]:
    """OpenAI's error document for ``exc``: ``code`` and ``param`` come from its extras."""
    return {"error": {"message": exc.message, "type": exc.type,
                      "param": exc.extra.get("param"), "code": exc.extra.get("code")}}


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    forced_completion_tokens: int | None


def _int_field(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ApiError(400, INVALID, f"{name} must be an integer >= {minimum}, got {value!r}",
                       code="invalid_value", param=name)
    return value


def parse_chat_request(body: Any, config: SimConfig) -> ChatRequest:
    """Validate a decoded chat.completions body; raise ApiError (400/404)."""
    if not isinstance(body, dict):
        raise ApiError(400, INVALID, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, INVALID, "model is required and must be a non-empty string",
                       code="missing_required_parameter", param="model")
    if model not in config.models:
        raise ApiError(404, INVALID,
                       f"The model `{model}` does not exist or you do not have access to it. "
                       f"This simulator serves: {', '.join(config.models)}",
                       code="model_not_found", param="model")
    if body.get("stream"):
        raise ApiError(400, INVALID, "stream=true is not supported by the simulator; "
                                     "send a non-streaming request", code="unsupported_value",
                       param="stream")
    n = _int_field(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError(400, INVALID, f"n={n} is not supported by the simulator; only n=1",
                       code="unsupported_value", param="n")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list):
        raise ApiError(400, INVALID, "messages is required and must be a list of "
                                     "{'role', 'content'} objects",
                       code="invalid_type", param="messages")
    try:
        messages = validate_messages(raw_messages)
    except InvalidRequest as exc:
        raise ApiError(400, INVALID, str(exc), code="invalid_value", param="messages") from None
    max_tokens = _int_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", 1)
    forced = _int_field(body, "sim_completion_tokens", 0)
    return ChatRequest(model=model, messages=messages,
                       max_tokens=config.default_max_tokens if max_tokens is None else max_tokens,
                       forced_completion_tokens=forced)


def completion_tokens_for(request: ChatRequest, config: SimConfig) -> int:
    """How many tokens the simulated reply has (never more than max_tokens)."""
    if request.forced_completion_tokens is not None:
        return min(request.forced_completion_tokens, request.max_tokens)
    return min(request.max_tokens,
               max(1, math.ceil(request.max_tokens * config.completion_fraction)))


def filler_text(n_words: int) -> str:
    return " ".join(FILLER_WORDS[i % len(FILLER_WORDS)] for i in range(n_words))


# -- statistics -----------------------------------------------------------------
class SimStats:
    """Counters and a per-second series of served tokens (last 10 minutes)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.in_flight = 0   # a gauge, not a counter: reset() keeps it
        self.reset()

    def reset(self) -> None:
        self.started_monotonic = self._clock()
        self.requests_ok = 0
        self.requests_429 = 0
        self.requests_429_by_type = {"requests": 0, "tokens": 0}
        self.requests_error = 0
        self.requests_invalid = 0
        self.tokens_prompt = 0
        self.tokens_completion = 0
        self.per_model: dict[str, dict[str, int]] = {}
        self._series: dict[int, list[int]] = {}   # monotonic second -> [tokens, requests]

    def _model(self, model: str) -> dict[str, int]:
        return self.per_model.setdefault(model, {"requests_ok": 0, "requests_429": 0,
                                                 "requests_error": 0, "tokens_prompt": 0,
                                                 "tokens_completion": 0})

    def record_ok(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.requests_ok += 1
        self.tokens_prompt += prompt_tokens
        self.tokens_completion += completion_tokens
        per = self._model(model)
        per["requests_ok"] += 1
        per["tokens_prompt"] += prompt_tokens
        per["tokens_completion"] += completion_tokens
        second = int(self._clock())
        cell = self._series.setdefault(second, [0, 0])
        cell[0] += prompt_tokens + completion_tokens
        cell[1] += 1
        self._prune(second)

    def record_429(self, model: str, kind: str) -> None:
        self.requests_429 += 1
        self.requests_429_by_type[kind] += 1
        self._model(model)["requests_429"] += 1

    def record_error(self, model: str) -> None:
        self.requests_error += 1
        self._model(model)["requests_error"] += 1

    def record_invalid(self) -> None:
        self.requests_invalid += 1

    def _prune(self, now_second: int) -> None:
        oldest = now_second - SERIES_WINDOW_S + 1
        for second in [s for s in self._series if s < oldest]:
            del self._series[second]

    def snapshot(self) -> dict[str, Any]:
        now_s = self._clock()
        now_second = int(now_s)
        self._prune(now_second)
        first = max(int(self.started_monotonic), now_second - SERIES_WINDOW_S + 1)
        seconds = range(first, now_second + 1)
        return {
            "requests_ok": self.requests_ok,
            "requests_429": self.requests_429,
            "requests_429_by_type": dict(self.requests_429_by_type),
            "requests_error": self.requests_error,
            "requests_invalid": self.requests_invalid,
            "requests_in_flight": self.in_flight,
            "tokens_prompt": self.tokens_prompt,
            "tokens_completion": self.tokens_completion,
            "per_model": {m: dict(c) for m, c in self.per_model.items()},
            "started_monotonic": self.started_monotonic,
            "now_monotonic": now_s,
            # served_per_s.tokens[i] = prompt+completion tokens of the requests
            # completed during monotonic second first_second + i.
            "served_per_s": {
                "first_second": first,
                "tokens": [self._series.get(s, (0, 0))[0] for s in seconds],
                "requests": [self._series.get(s, (0, 0))[1] for s in seconds],
            },
        }


# -- admission --------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    ok: bool
    kind: str = ""             # "requests" or "tokens" when refused
    retry_after_s: float = 0.0
    requested_tokens: int = 0  # what the token bucket was asked for


class Simulator:
    """The rate-limit state of one simulated upstream.  Synchronous methods
    only, so on one event loop each check-and-debit is atomic."""

    def __init__(self, config: SimConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.tokens = TokenBucket(config.token_capacity, config.tpm / 60.0, clock)
        self.requests = TokenBucket(config.request_capacity, config.rpm / 60.0, clock)
        self.stats = SimStats(clock)
        self.rng = random.Random(config.seed)

    def too_large(self, prompt_tokens: int, max_tokens: int) -> bool:
        return prompt_tokens + max_tokens > self.config.token_capacity

    def admission_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        if self.config.charge == "reserve":
            return prompt_tokens + max_tokens
        return prompt_tokens

    def should_fail(self) -> bool:
        return self.config.fail_rate > 0 and self.rng.random() < self.config.fail_rate

    def admit(self, prompt_tokens: int, max_tokens: int) -> Admission:
        """Check both buckets and debit them only if both have room."""
        need = self.admission_tokens(prompt_tokens, max_tokens)
        requests_ok = self.requests.can_take(1)
        tokens_ok = self.tokens.can_take(need)
        if not (requests_ok and tokens_ok):
            wait_s = max(self.requests.wait_s(1), self.tokens.wait_s(need))
            return Admission(False, "requests" if not requests_ok else "tokens", wait_s, need)
        self.requests.take(1)
        if self.config.charge == "reserve":
            self.tokens.take(need)
        return Admission(True, requested_tokens=need)

    def complete(self, prompt_tokens: int, max_tokens: int, completion_tokens: int) -> None:
        """Settle the token bucket once the reply is done."""
        if self.config.charge == "reserve":
            self.tokens.give(max_tokens - completion_tokens)
        else:
            self.tokens.take(prompt_tokens + completion_tokens)

    def reset(self) -> None:
        self.tokens.fill()
        self.requests.fill()
        self.stats.reset()
        self.rng = random.Random(self.config.seed)

    def rate_limit_headers(self) -> dict[str, str]:
        return {
            "x-ratelimit-limit-requests": str(self.config.rpm),
            "x-ratelimit-limit-tokens": str(self.config.tpm),
            "x-ratelimit-remaining-requests": str(self.requests.remaining()),
            "x-ratelimit-remaining-tokens": str(self.tokens.remaining()),
            "x-ratelimit-reset-requests": format_duration(self.requests.reset_s()),
            "x-ratelimit-reset-tokens": format_duration(self.tokens.reset_s()),
        }

    def rate_limit_message(self, model: str, admission: Admission) -> str:
        wait = format_duration(admission.retry_after_s)
        if admission.kind == "requests":
            used = self.requests.capacity - self.requests.level
            return (f"Rate limit reached for {model} on requests per min (RPM): "
                    f"Limit {self.config.rpm}, Used {max(0, math.ceil(used))}, Requested 1. "
                    f"Please try again in {wait}.")
        used = self.tokens.capacity - self.tokens.level
        return (f"Rate limit reached for {model} on tokens per min (TPM): "
                f"Limit {self.config.tpm}, Used {max(0, math.ceil(used))}, "
                f"Requested {admission.requested_tokens}. Please try again in {wait}.")


# -- HTTP app ---------------------------------------------------------------------
def create_app(config: SimConfig) -> FastAPI:
    """The simulator's FastAPI app; its state is ``app.state.simulator``."""
    config.validate()
    sim = Simulator(config)
    app = FastAPI(title="gateway-tasks upstream simulator", docs_url=None, redoc_url=None)
    app.state.simulator = sim

    def error(exc: ApiError) -> JSONResponse:
        """The error document, with the buckets' headers and then the error's own."""
        return JSONResponse(error_body(exc), status_code=exc.status,
                            headers={**sim.rate_limit_headers(), **exc.headers})

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        snap = sim.stats.snapshot()
        snap["config"] = asdict(config)
        snap["remaining_tokens"] = sim.tokens.remaining()
        snap["remaining_requests"] = sim.requests.remaining()
        return snap

    @app.post("/stats/reset")
    async def stats_reset() -> dict[str, bool]:
        sim.reset()
        return {"ok": True}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list",
                "data": [{"id": m, "object": "model", "created": created,
                          "owned_by": "gateway-tasks-simulator"} for m in config.models]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        started_s = time.monotonic()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            sim.stats.record_invalid()
            return error(ApiError(400, INVALID, f"the request body is not valid JSON: {exc}"))
        try:
            chat = parse_chat_request(body, config)
            prompt_tokens = count_prompt_tokens(chat.messages)
            if sim.too_large(prompt_tokens, chat.max_tokens):
                raise ApiError(
                    400, INVALID, f"Request too large for {chat.model}: prompt_tokens ({prompt_tokens}) + "
                         f"max_tokens ({chat.max_tokens}) = {prompt_tokens + chat.max_tokens} "
                         f"exceeds the token bucket capacity ({int(config.token_capacity)} = "
                         f"tpm {config.tpm} * burst_s {config.burst_s:g} / 60); it could never "
                         f"be admitted. Lower max_tokens or shorten the prompt.",
                    code="request_too_large", param="max_tokens")
        except ApiError as exc:
            sim.stats.record_invalid()
            return error(exc)

        if sim.should_fail():
            sim.stats.record_error(chat.model)
            await asyncio.sleep(config.base_latency_ms / 1000.0)
            return error(ApiError(500, "server_error",
                                  "The simulator injected a server error (fail_rate).",
                                  code="simulated_failure"))

        # check and debit: no await in between
        admission = sim.admit(prompt_tokens, chat.max_tokens)
        if not admission.ok:
            sim.stats.record_429(chat.model, admission.kind)
            retry = {"retry-after": format_seconds(admission.retry_after_s),
                     "retry-after-ms": str(ceil_ms(admission.retry_after_s))}
            return error(ApiError(429, admission.kind, sim.rate_limit_message(chat.model, admission),
                                  headers=retry, code="rate_limit_exceeded"))

        completion_tokens = completion_tokens_for(chat, config)
        latency_ms = config.base_latency_ms + completion_tokens * config.ms_per_output_token
        sim.stats.in_flight += 1
        try:
            await asyncio.sleep(latency_ms / 1000.0)
        finally:
            sim.stats.in_flight -= 1
            sim.complete(prompt_tokens, chat.max_tokens, completion_tokens)
        sim.stats.record_ok(chat.model, prompt_tokens, completion_tokens)

        request_id = uuid.uuid4().hex
        finish = "length" if completion_tokens == chat.max_tokens else "stop"
        payload = {
            "id": f"chatcmpl-sim{request_id[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": chat.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": filler_text(completion_tokens),
                            "refusal": None},
                "logprobs": None,
                "finish_reason": finish,
            }],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "system_fingerprint": "fp_simulator",
        }
        headers = sim.rate_limit_headers()
        headers["x-request-id"] = f"req_{request_id}"
        headers["openai-processing-ms"] = str(round((time.monotonic() - started_s) * 1000))
        return JSONResponse(payload, headers=headers)

    return app


# -- running it ---------------------------------------------------------------------
def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"simulator: cannot listen on {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _server(config: SimConfig, host: str, port: int) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(create_app(config), host=host, port=port,
                                         log_level="warning", access_log=False,
                                         lifespan="off"))


def serve(config: SimConfig, host: str = "127.0.0.1", port: int = 8099) -> None:
    """Run the simulator in the foreground until interrupted."""
    sock = _bind(host, port)
    bound_port = sock.getsockname()[1]
    print(f"simulate-upstream: {_url(host, bound_port)}/v1 (tpm={config.tpm}, rpm={config.rpm}, "
          f"burst_s={config.burst_s:g}, charge={config.charge}, "
          f"models={','.join(config.models)})", file=sys.stderr, flush=True)
    try:
        _server(config, host, bound_port).run(sockets=[sock])
    except KeyboardInterrupt:   # uvicorn re-raises Ctrl-C after a clean shutdown
        pass
    finally:
        sock.close()


def _wait_healthy(root_url: str, timeout_s: float, alive: Any) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if not alive():
            raise UpstreamError(f"simulator at {root_url} exited before answering /health")
        try:
            if httpx.get(f"{root_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.02)
    raise UpstreamError(f"simulator at {root_url} did not answer /health within "
                        f"{timeout_s:g}s ({last})")


class _Endpoint:
    root_url: str

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, e.g. http://127.0.0.1:PORT/v1."""
        return f"{self.root_url}/v1"

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.root_url}/stats", timeout=5.0)
        response.raise_for_status()
        return response.json()

    def reset_stats(self) -> None:
        httpx.post(f"{self.root_url}/stats/reset", timeout=5.0).raise_for_status()


class SimulatorThread(_Endpoint):
    """Run the simulator in a daemon thread (``with SimulatorThread(cfg) as sim:``).

    ``port=0`` picks a free loopback port.  ``.simulator`` is the live state.
    """

    def __init__(self, config: SimConfig | None = None, port: int = 0,
                 host: str = "127.0.0.1", startup_timeout_s: float = 10.0) -> None:
        self.config = config or SimConfig()
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self._sock = _bind(host, port)
        self.port: int = self._sock.getsockname()[1]
        self.root_url = _url(host, self.port)
        self._server = _server(self.config, host, self.port)
        self.simulator: Simulator = self._server.config.app.state.simulator
        self._thread: threading.Thread | None = None

    def start(self) -> "SimulatorThread":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"simulator-{self.port}", daemon=True)
        self._thread.start()
        try:
            _wait_healthy(self.root_url, self.startup_timeout_s, self._thread.is_alive)
        except GatewayError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> "SimulatorThread":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def config_to_argv(config: SimConfig) -> list[str]:
    """The command-line flags that rebuild ``config`` (inverse of config_from_args)."""
    return ["--tpm", str(config.tpm), "--rpm", str(config.rpm),
            "--burst-s", repr(config.burst_s), "--charge", config.charge,
            "--base-latency-ms", repr(config.base_latency_ms),
            "--ms-per-output-token", repr(config.ms_per_output_token),
            "--completion-fraction", repr(config.completion_fraction),
            "--default-max-tokens", str(config.default_max_tokens),
            "--models", ",".join(config.models),
            "--fail-rate", repr(config.fail_rate), "--seed", str(config.seed)]


def _free_port(host: str) -> int:
    with _bind(host, 0) as sock:
        return sock.getsockname()[1]


class SimulatorProcess(_Endpoint):
    """Run the simulator as ``python -m gateway_tasks.devtools.simulator.app`` in a subprocess.

    ``port=0`` picks a free port first.  Its output goes to ``.log_path``,
    quoted in the error if it fails to start and removed on stop.
    """

    def __init__(self, config: SimConfig | None = None, port: int = 0,
                 host: str = "127.0.0.1", startup_timeout_s: float = 30.0,
                 python: str = sys.executable) -> None:
        self.config = config or SimConfig()
        self.host = host
        self.port = port or _free_port(host)
        self.root_url = _url(host, self.port)
        self.startup_timeout_s = startup_timeout_s
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = ""

    def argv(self) -> list[str]:
        return [self.python, "-m", "gateway_tasks.devtools.simulator.app", "--host", self.host,
                "--port", str(self.port), *config_to_argv(self.config)]

    def start(self) -> "SimulatorProcess":
        project_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (project_root, env.get("PYTHONPATH")) if p)
        fd, self.log_path = tempfile.mkstemp(prefix="gateway-simulator-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
        proc = self.proc
        try:
            _wait_healthy(self.root_url, self.startup_timeout_s, lambda: proc.poll() is None)
        except GatewayError as exc:
            tail = Path(self.log_path).read_text(errors="replace")[-2000:]
            self.stop()
            raise UpstreamError(f"{exc}; simulator output:\n{tail}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5.0)
            self.proc = None
        if self.log_path:
            Path(self.log_path).unlink(missing_ok=True)
            self.log_path = ""

    def __enter__(self) -> "SimulatorProcess":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# -- command line ---------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimConfig()
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    parser.add_argument("--port", type=int, default=8099, help="listen port, 0 = any free "
                        "(default %(default)s)")
    parser.add_argument("--tpm", type=int, default=d.tpm,
                        help="tokens per minute (default %(default)s)")
    parser.add_argument("--rpm", type=int, default=d.rpm,
                        help="requests per minute (default %(default)s)")
    parser.add_argument("--burst-s", type=float, default=d.burst_s,
                        help="bucket capacity in seconds of quota (default %(default)s)")
    parser.add_argument("--charge", choices=CHARGE_MODES, default=d.charge,
                        help="reserve prompt+max_tokens at admission, or charge actual usage "
                             "at completion (default %(default)s)")
    parser.add_argument("--base-latency-ms", type=float, default=d.base_latency_ms,
                        help="latency of every reply (default %(default)s)")
    parser.add_argument("--ms-per-output-token", type=float, default=d.ms_per_output_token,
                        help="extra latency per completion token (default %(default)s)")
    parser.add_argument("--completion-fraction", type=float, default=d.completion_fraction,
                        help="completion length as a fraction of max_tokens (default %(default)s)")
    parser.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                        help="max_tokens when a request sets none (default %(default)s)")
    parser.add_argument("--models", default=",".join(d.models),
                        help="comma-separated accepted model names (default %(default)s)")
    parser.add_argument("--fail-rate", type=float, default=d.fail_rate,
                        help="fraction of requests answered 500 (default %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="seed of the failure draws (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build a SimConfig from parsed flags; raise ConfigError if a value is invalid."""
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    return SimConfig(tpm=args.tpm, rpm=args.rpm, burst_s=args.burst_s, charge=args.charge,
                     base_latency_ms=args.base_latency_ms,
                     ms_per_output_token=args.ms_per_output_token,
                     completion_fraction=args.completion_fraction,
                     default_max_tokens=args.default_max_tokens, models=models,
                     fail_rate=args.fail_rate, seed=args.seed)


def _run(args: argparse.Namespace) -> int:
    serve(config_from_args(args), host=args.host, port=args.port)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``simulate-upstream`` command to the ``gateway`` CLI."""
    parser = subparsers.add_parser(
        "simulate-upstream", help="run a local OpenAI-compatible upstream with TPM/RPM limits",
        description=_SUMMARY)
    add_arguments(parser)
    parser.set_defaults(func=_run)


def main(argv: Sequence[str] | None = None) -> int:
    from gateway_tasks.cli.main import run_standalone
    return run_standalone("python -m gateway_tasks.devtools.simulator.app", _SUMMARY, add_arguments, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
