"""TPM/RPM admission: ``Simulator``, the rate-limit state of one simulated upstream.

A requests bucket and a tokens bucket (``bucket.TokenBucket``) admit or refuse
each request, charged as ``config.charge`` says (reserve or actual; see the
package docstring); a refusal is a 429 ApiError with ``Retry-After``.  It
also renders the ``x-ratelimit-*`` headers, keeps the ``stats.SimStats`` and
draws the injected failures (``fail_rate``) from ``random.Random(seed)``.
``held_tokens`` is what the token bucket holds for requests in flight (their
``prompt + max_tokens`` under ``charge="reserve"``, nothing under
``"actual"``): with the bucket's level and ``wasted`` refill, it lets a
benchmark account for every token of quota over a window.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from gateway_tasks.core.errors import ApiError
from gateway_tasks.simulator.bucket import (Clock, SlidingWindow, TokenBucket, ceil_ms, format_duration,
                                            format_seconds)
from gateway_tasks.simulator.config import SimConfig
from gateway_tasks.simulator.stats import SimStats


@dataclass(frozen=True)
class Admission:
    """The answer of ``Simulator.admit``: admitted, or which bucket refused and for how long."""

    ok: bool
    kind: str = ""             # "requests" or "tokens" when refused
    retry_after_s: float = 0.0
    requested_tokens: int = 0  # what the token bucket was asked for


class Simulator:
    """The rate-limit state of one simulated upstream.  Synchronous methods
    only, so on one event loop each check-and-debit is atomic."""

    def __init__(self, config: SimConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.tokens: TokenBucket | SlidingWindow
        self.requests: TokenBucket | SlidingWindow
        if config.window == "strict":   # a 60 s sliding window: charges kept, never given back
            self.tokens = SlidingWindow(config.tpm, 60.0, clock)
            self.requests = SlidingWindow(config.rpm, 60.0, clock)
        else:
            self.tokens = TokenBucket(config.token_capacity, config.tpm / 60.0, clock)
            self.requests = TokenBucket(config.request_capacity, config.rpm / 60.0, clock)
        self.stats = SimStats(clock)
        self.rng = random.Random(config.seed)
        self.held_tokens = 0

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
            self.held_tokens += need
        self.stats.record_admitted(need)
        return Admission(True, requested_tokens=need)

    def complete(self, prompt_tokens: int, max_tokens: int, completion_tokens: int) -> None:
        """Settle the token bucket once the reply is done."""
        if self.config.charge == "reserve":
            self.tokens.give(max_tokens - completion_tokens)
            self.held_tokens -= prompt_tokens + max_tokens
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

    def refusal(self, model: str, admission: Admission) -> ApiError:
        """The 429 for a refused admission, with ``Retry-After`` and ``retry-after-ms``."""
        retry = {"retry-after": format_seconds(admission.retry_after_s),
                 "retry-after-ms": str(ceil_ms(admission.retry_after_s))}
        return ApiError(429, admission.kind, self.rate_limit_message(model, admission),
                        headers=retry, code="rate_limit_exceeded")
