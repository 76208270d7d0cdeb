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

The tenant model sizes a platform from its tenants instead of a measured QPS:

    baseline QPS = tenants x tasks per tenant per hour / 3600
    peak QPS     = tenants x tasks per tenant per hour / jitter window (s) x peak multiplier
    instances    = int(peak QPS / (1000 / inference ms) x safety factor) + 1

computed for no jitter (a 1 s window) and for the given window (300 s by default).

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


# -- the tenant model: instances from tenants, their tasks and the jitter window ----------
SECONDS_PER_HOUR = 3600
NO_JITTER_WINDOW_S = 1.0            # every task fires in the same second
DEFAULT_JITTER_WINDOW_S = 300.0


def tenant_baseline_qps(tenants: float, tasks_per_tenant_per_hour: float) -> float:
    """The hour's mean requests/s: tenants x tasks per tenant per hour / 3600."""
    _positive("tenants", tenants)
    _positive("tasks_per_tenant_per_hour", tasks_per_tenant_per_hour, allow_zero=True)
    return tenants * tasks_per_tenant_per_hour / SECONDS_PER_HOUR


def tenant_peak_qps(tenants: float, tasks_per_tenant_per_hour: float, jitter_window_s: float,
                    peak_multiplier: float) -> float:
    """Peak requests/s when the hour's tasks are spread evenly over a jitter window of
    ``jitter_window_s`` seconds: tenants x tasks / window x peak multiplier."""
    _positive("tenants", tenants)
    _positive("tasks_per_tenant_per_hour", tasks_per_tenant_per_hour, allow_zero=True)
    _positive("jitter_window_s", jitter_window_s)
    _positive("peak_multiplier", peak_multiplier)
    return tenants * tasks_per_tenant_per_hour / jitter_window_s * peak_multiplier


def instance_qps_from_inference_ms(inference_ms: float) -> float:
    """Requests/s one instance serves, one inference of ``inference_ms`` at a time."""
    _positive("inference_ms", inference_ms)
    return 1000.0 / inference_ms


def tenant_instances(peak_qps: float, inference_ms: float, safety_factor: float) -> int:
    """int(peak QPS / instance QPS x safety factor) + 1: the tenant model's count, one
    more than the whole part (so an exact 720.0 is 721; float noise below 1e-9 ignored)."""
    _positive("peak_qps", peak_qps, allow_zero=True)
    _positive("safety_factor", safety_factor)
    if safety_factor < 1:
        raise ConfigError(f"capacity: safety_factor={safety_factor!r} is invalid; expected >= 1")
    raw = peak_qps / instance_qps_from_inference_ms(inference_ms) * safety_factor
    return math.floor(raw + _EPS) + 1


@dataclass(frozen=True)
class TenantLoad:
    """The tenant model's inputs."""

    tenants: float
    tasks_per_tenant_per_hour: float
    peak_multiplier: float
    inference_ms: float
    p99_target_ms: float
    safety_factor: float = DEFAULT_SAFETY_FACTOR
    jitter_window_s: float = DEFAULT_JITTER_WINDOW_S


@dataclass(frozen=True)
class TenantPlan:
    """The tenant model's figures, without jitter (a 1 s window) and with the load's window."""

    load: TenantLoad
    baseline_qps: float
    peak_qps_no_jitter: float
    peak_qps_jittered: float
    instances_no_jitter: int
    instances_jittered: int
    instance_qps: float

    @property
    def inference_within_p99_target(self) -> bool:
        """Whether one inference alone fits the p99 latency target."""
        return self.load.inference_ms <= self.load.p99_target_ms

    def as_dict(self) -> dict[str, object]:
        return {
            "inputs": {"tenants": self.load.tenants,
                       "tasks_per_tenant_per_hour": self.load.tasks_per_tenant_per_hour,
                       "peak_multiplier": self.load.peak_multiplier,
                       "inference_ms": self.load.inference_ms, "p99_target_ms": self.load.p99_target_ms,
                       "safety_factor": self.load.safety_factor,
                       "jitter_window_s": self.load.jitter_window_s},
            "instance_qps": self.instance_qps,
            "baseline_qps": self.baseline_qps,
            "peak_qps_no_jitter": self.peak_qps_no_jitter,
            "peak_qps_jittered": self.peak_qps_jittered,
            "instances_no_jitter": self.instances_no_jitter,
            "instances_jittered": self.instances_jittered,
            "inference_within_p99_target": self.inference_within_p99_target,
        }


def tenant_plan(load: TenantLoad) -> TenantPlan:
    """The tenant model's five figures for ``load``."""
    _positive("p99_target_ms", load.p99_target_ms)
    base = tenant_baseline_qps(load.tenants, load.tasks_per_tenant_per_hour)
    peak_1 = tenant_peak_qps(load.tenants, load.tasks_per_tenant_per_hour, NO_JITTER_WINDOW_S,
                             load.peak_multiplier)
    peak_w = tenant_peak_qps(load.tenants, load.tasks_per_tenant_per_hour, load.jitter_window_s,
                             load.peak_multiplier)
    return TenantPlan(
        load=load, baseline_qps=base, peak_qps_no_jitter=peak_1, peak_qps_jittered=peak_w,
        instances_no_jitter=tenant_instances(peak_1, load.inference_ms, load.safety_factor),
        instances_jittered=tenant_instances(peak_w, load.inference_ms, load.safety_factor),
        instance_qps=instance_qps_from_inference_ms(load.inference_ms))
