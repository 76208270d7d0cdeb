"""What the simulator counts for ``GET /stats``: requests by outcome, tokens,
per model too, and the tokens served per monotonic second over the last 10
minutes (``served_per_s``), which the benchmark maps onto its windows."""

from __future__ import annotations

import time
from typing import Any

from gateway_tasks.simulator.bucket import Clock

SERIES_WINDOW_S = 600


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
        self.requests_unauthorized = 0   # 401: not the API key SimConfig.api_key requires
        self.tokens_prompt = 0
        self.tokens_completion = 0
        self.per_model: dict[str, dict[str, int]] = {}
        self._series: dict[int, list[int]] = {}   # monotonic second -> [tokens, requests]
        # monotonic second -> [tokens charged at admission, requests admitted]
        self._admitted: dict[int, list[int]] = {}

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

    def record_admitted(self, charged_tokens: int) -> None:
        """A request admitted, ``charged_tokens`` counted against the quota at admission."""
        second = int(self._clock())
        cell = self._admitted.setdefault(second, [0, 0])
        cell[0] += charged_tokens
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

    def record_unauthorized(self) -> None:
        self.requests_unauthorized += 1

    def _prune(self, now_second: int) -> None:
        oldest = now_second - SERIES_WINDOW_S + 1
        for series in (self._series, self._admitted):
            for second in [s for s in series if s < oldest]:
                del series[second]

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
            "requests_unauthorized": self.requests_unauthorized,
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
            # admitted_per_s.tokens[i] = tokens charged at admission (prompt + max_tokens under
            # charge="reserve") of the requests admitted during second first_second + i
            "admitted_per_s": {
                "first_second": first,
                "tokens": [self._admitted.get(s, (0, 0))[0] for s in seconds],
                "requests": [self._admitted.get(s, (0, 0))[1] for s in seconds],
            },
        }
