"""The capacity model, pure: how many instances a load needs.

    tokens/s  = QPS x tokens per request
    raw       = max(tokens/s / instance tokens/s,  QPS / instance requests/s)
    instances = ceil(raw x safety factor)           (safety factor 1.5 by default)

An instance's throughput is given in tokens/s (a model server), in requests/s,
or as its concurrency and the mean upstream latency (a gateway worker: Little's
law, requests/s = concurrent calls / latency).  Both limits may be given; the
tighter one decides.  The baseline load sizes the warm pool (the minimum
replicas kept running), the peak load the maximum; the upstream quota needed
is the peak's tokens per minute times the same factor, compared with the
pools' TPM.

No I/O here: ``gateway capacity`` (gateway_tasks.cli.capacity) feeds it flags
or the rates it measured in Redis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway_tasks.core.errors import ConfigError

DEFAULT_SAFETY_FACTOR = 1.5
_EPS = 1e-9          # 3.0000000000000004 instances are 3


def _positive(name: str, value: float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or math.isinf(value) or value < 0 or (value == 0 and not allow_zero):
        expected = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"capacity: {name}={value!r} is invalid; expected a finite number {expected}")


def ceil_instances(raw: float) -> int:
    """Whole instances for a fractional need (float noise below 1e-9 is ignored)."""
    return max(0, math.ceil(raw - _EPS))


def instance_rps_from_concurrency(concurrency: float, latency_s: float) -> float:
    """Little's law: requests/s one instance sustains with ``concurrency`` calls in
    flight that each take ``latency_s``."""
    _positive("concurrency", concurrency)
    _positive("latency_s", latency_s)
    return concurrency / latency_s


@dataclass(frozen=True)
class Instance:
    """What one instance sustains: tokens/s and/or requests/s (at least one)."""

    tokens_per_s: float | None = None
    requests_per_s: float | None = None

    def __post_init__(self) -> None:
        _positive("instance tokens_per_s", self.tokens_per_s)
        _positive("instance requests_per_s", self.requests_per_s)
        if self.tokens_per_s is None and self.requests_per_s is None:
            raise ConfigError("capacity: give the per-instance throughput as tokens/s, requests/s, "
                              "or concurrency and latency")


def raw_instances(qps: float, tokens_per_request: float, instance: Instance) -> float:
    """Instances the load needs with no margin (fractional)."""
    _positive("qps", qps, allow_zero=True)
    _positive("tokens_per_request", tokens_per_request, allow_zero=True)
    need = 0.0
    if instance.tokens_per_s is not None:
        need = max(need, qps * tokens_per_request / instance.tokens_per_s)
    if instance.requests_per_s is not None:
        need = max(need, qps / instance.requests_per_s)
    return need


def instances_needed(qps: float, tokens_per_request: float, instance: Instance,
                     safety_factor: float = DEFAULT_SAFETY_FACTOR, minimum: int = 0) -> int:
    """ceil(raw instances x safety factor), at least ``minimum``."""
    _positive("safety_factor", safety_factor)
    if safety_factor < 1:
        raise ConfigError(f"capacity: safety_factor={safety_factor!r} is invalid; expected >= 1")
    return max(minimum, ceil_instances(raw_instances(qps, tokens_per_request, instance) * safety_factor))


@dataclass(frozen=True)
class LoadLine:
    """One load level of a plan."""

    name: str
    qps: float
    tokens_per_s: float
    tokens_per_minute: float
    raw_instances: float
    instances: int


@dataclass(frozen=True)
class CapacityPlan:
    tokens_per_request: float
    instance: Instance
    safety_factor: float
    baseline: LoadLine
    peak: LoadLine
    upstream_tpm_needed: float          # peak TPM x safety factor
    upstream_tpm_available: float | None
    peak_over_baseline: float | None

    @property
    def warm_pool(self) -> int:
        """Minimum replicas: the baseline's instances (at least 1)."""
        return max(1, self.baseline.instances)

    @property
    def max_replicas(self) -> int:
        return max(self.warm_pool, self.peak.instances)

    @property
    def upstream_ok(self) -> bool | None:
        if self.upstream_tpm_available is None:
            return None
        return self.upstream_tpm_needed <= self.upstream_tpm_available + _EPS

    def as_dict(self) -> dict[str, object]:
        line = lambda ln: {"qps": ln.qps, "tokens_per_s": ln.tokens_per_s,  # noqa: E731
                           "tokens_per_minute": ln.tokens_per_minute,
                           "raw_instances": round(ln.raw_instances, 4), "instances": ln.instances}
        return {
            "tokens_per_request": self.tokens_per_request,
            "instance": {"tokens_per_s": self.instance.tokens_per_s,
                         "requests_per_s": self.instance.requests_per_s},
            "safety_factor": self.safety_factor,
            "baseline": line(self.baseline), "peak": line(self.peak),
            "peak_over_baseline": self.peak_over_baseline,
            "warm_pool_min_replicas": self.warm_pool, "max_replicas": self.max_replicas,
            "upstream_tpm_needed": self.upstream_tpm_needed,
            "upstream_tpm_available": self.upstream_tpm_available,
            "upstream_ok": self.upstream_ok,
        }


def _line(name: str, qps: float, tpr: float, instance: Instance, safety: float) -> LoadLine:
    raw = raw_instances(qps, tpr, instance)
    return LoadLine(name, qps, qps * tpr, qps * tpr * 60.0, raw, ceil_instances(raw * safety))


def plan(baseline_qps: float, peak_qps: float, tokens_per_request: float, instance: Instance,
         safety_factor: float = DEFAULT_SAFETY_FACTOR,
         upstream_tpm: float | None = None) -> CapacityPlan:
    """The capacity plan of a baseline and a peak load."""
    _positive("baseline_qps", baseline_qps, allow_zero=True)
    _positive("peak_qps", peak_qps, allow_zero=True)
    _positive("upstream_tpm", upstream_tpm)
    if peak_qps < baseline_qps:
        raise ConfigError(f"capacity: peak_qps={peak_qps!r} is below baseline_qps={baseline_qps!r}")
    instances_needed(0, 0, instance, safety_factor)       # validates the factor
    base = _line("baseline", baseline_qps, tokens_per_request, instance, safety_factor)
    peak = _line("peak", peak_qps, tokens_per_request, instance, safety_factor)
    return CapacityPlan(
        tokens_per_request=tokens_per_request, instance=instance, safety_factor=safety_factor,
        baseline=base, peak=peak, upstream_tpm_needed=peak.tokens_per_minute * safety_factor,
        upstream_tpm_available=upstream_tpm,
        peak_over_baseline=(peak_qps / baseline_qps) if baseline_qps > 0 else None)
