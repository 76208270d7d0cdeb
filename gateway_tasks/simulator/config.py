"""SimConfig: how the simulated upstream limits and answers traffic, validated
at construction (a bad value raises ConfigError naming it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import CHARGE_MODES, WINDOW_MODES, Pool, bucket_capacity, request_bucket_capacity

# how the simulator serves HTTP (uvicorn's event loop, HTTP parser): "native" is uvloop and
# httptools (C), "python" the pure-Python asyncio loop and h11.  One event loop serves every
# request, so under a storm's ~100 requests/s in bursts the pure-Python stack queued them for
# tens of ms before and after the simulated latency: time a remote upstream does not spend on
# the gateway's CPU, which a benchmark would then count as the gateway's
SERVER_STACKS = {"native": ("uvloop", "httptools"), "python": ("asyncio", "h11")}


@dataclass(frozen=True)
class SimConfig:
    """How the simulated upstream limits and answers traffic."""

    tpm: int = 600_000
    rpm: int = 6_000
    burst_s: float = 60.0
    charge: str = "reserve"
    # "bucket": continuous-refill buckets of burst_s of quota; "strict": at most tpm tokens and
    # rpm requests admitted in any 60 s (prompt + max_tokens charged at admission, never given
    # back; Retry-After is the exact time until the request fits; burst_s is not used)
    window: str = "bucket"
    base_latency_ms: float = 20.0
    ms_per_output_token: float = 0.05
    completion_fraction: float = 0.6
    default_max_tokens: int = 256
    models: tuple[str, ...] = ("gpt-4o-mini", "gpt-4o")
    fail_rate: float = 0.0
    seed: int = 0
    reply_text: str = ""   # the completion's text ('' = filler words of the simulated length)
    server_stack: str = "native"   # SERVER_STACKS: uvicorn's loop and HTTP parser
    # the API key every /v1 request must bear (Authorization: Bearer), else 401 as OpenAI
    # answers; '' = any key or none.  Never shown (not in repr, /stats or the start line)
    api_key: str = field(default="", repr=False)
    # the largest n (choices per request) served; a larger n is a 400 (param n), as from a
    # model that does not support it (1: only the default)
    max_n: int = 1
    # (model, tokens) pairs: a request to that model whose prompt + max_tokens exceeds its
    # context window is a 400 context_length_exceeded; a model not named has no limit here
    context_window_tokens: tuple[tuple[str, int], ...] = ()
    # the models POST /v1/embeddings serves (gateway_tasks.simulator.embeddings), and the
    # length of their vectors when a request names no ``dimensions``
    embedding_models: tuple[str, ...] = ("text-embedding-3-small", "text-embedding-3-large")
    embedding_dimensions: int = 64

    def __post_init__(self) -> None:
        for name in ("models", "embedding_models"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        windows = self.context_window_tokens
        pairs = windows.items() if isinstance(windows, dict) else windows
        object.__setattr__(self, "context_window_tokens", tuple((m, t) for m, t in pairs))
        self.validate()

    def validate(self) -> "SimConfig":
        _check(self.tpm > 0, "tpm", self.tpm, "> 0 tokens per minute")
        _check(self.rpm > 0, "rpm", self.rpm, "> 0 requests per minute")
        _check(self.burst_s > 0, "burst_s", self.burst_s, "> 0 seconds")
        _check(self.charge in CHARGE_MODES, "charge", self.charge, f"one of {CHARGE_MODES}")
        _check(self.window in WINDOW_MODES, "window", self.window, f"one of {WINDOW_MODES}")
        _check(self.window == "bucket" or self.charge == "reserve", "charge", self.charge,
               "'reserve' with window='strict' (it charges prompt + max_tokens at admission)")
        _check(self.base_latency_ms >= 0, "base_latency_ms", self.base_latency_ms, ">= 0")
        _check(self.ms_per_output_token >= 0, "ms_per_output_token",
               self.ms_per_output_token, ">= 0")
        _check(0 < self.completion_fraction <= 1, "completion_fraction",
               self.completion_fraction, "in (0, 1]")
        _check(self.default_max_tokens > 0, "default_max_tokens", self.default_max_tokens, "> 0")
        _check(len(self.models) > 0 and all(isinstance(m, str) and m for m in self.models),
               "models", self.models, "at least one non-empty model name")
        _check(all(isinstance(m, str) and m for m in self.embedding_models), "embedding_models",
               self.embedding_models, "non-empty model names")
        _check(isinstance(self.embedding_dimensions, int) and not isinstance(self.embedding_dimensions, bool)
               and 1 <= self.embedding_dimensions <= 4096, "embedding_dimensions", self.embedding_dimensions,
               "an integer in [1, 4096]")
        _check(0 <= self.fail_rate <= 1, "fail_rate", self.fail_rate, "in [0, 1]")
        _check(self.server_stack in SERVER_STACKS, "server_stack", self.server_stack,
               f"one of {sorted(SERVER_STACKS)}")
        if not isinstance(self.api_key, str):
            raise ConfigError("simulator: api_key is invalid; expected a string ('' = any key)")
        _check(isinstance(self.max_n, int) and not isinstance(self.max_n, bool) and self.max_n >= 1,
               "max_n", self.max_n, "an integer >= 1")
        _check(all(isinstance(m, str) and m and isinstance(t, int) and not isinstance(t, bool) and t > 0
                   for m, t in self.context_window_tokens),
               "context_window_tokens", self.context_window_tokens, "(model, tokens > 0) pairs")
        return self

    def context_window(self, model: str) -> int | None:
        """The model's context window in tokens; None when it has none here."""
        return dict(self.context_window_tokens).get(model)

    @property
    def uvicorn_loop_http(self) -> tuple[str, str]:
        """(loop, http) for uvicorn.Config."""
        return SERVER_STACKS[self.server_stack]

    @property
    def token_capacity(self) -> float:
        return float(self.tpm) if self.window == "strict" else bucket_capacity(self.tpm, self.burst_s)

    @property
    def request_capacity(self) -> float:
        return float(self.rpm) if self.window == "strict" else request_bucket_capacity(self.rpm, self.burst_s)

    @classmethod
    def for_pool(cls, pool: Pool, **overrides: Any) -> "SimConfig":
        """A simulator with the same quota, burst, charge mode and models as ``pool``."""
        base: dict[str, Any] = dict(tpm=pool.tpm, rpm=pool.rpm, burst_s=pool.burst_s,
                                    charge=pool.charge, window=pool.window, models=pool.models)
        base.update(overrides)
        return cls(**base)


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"simulator: {name}={value!r} is invalid; expected {expected}")
