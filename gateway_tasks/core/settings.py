"""Typed settings: defaults, then a TOML file (GATEWAY_CONFIG), then env vars.

Every value is validated when loaded; a bad value raises ConfigError naming the
setting, the value and what is expected, so a misconfigured worker fails at
start instead of mis-scheduling traffic later.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from typing import Any, Iterable, Mapping
from urllib.parse import urlsplit

from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import queue_name
from gateway_tasks.core.urls import (CLUSTER_SCHEMES, REDIS_SCHEMES, TLS_CERT_REQS, TLS_SCHEMES, cluster_nodes,
                                     is_cluster_url, with_redis_auth_and_tls, without_credentials)

MIN_SECRET_CHARS = 16
# a tier's scheduled lag, at most: a tag this far ahead still compares exactly as an integer score
MAX_SCHEDULED_LAG_TOKENS = 1_000_000_000
POLICIES = ("fifo", "strict", "aging", "wfq")
# the aging policy's score maths (gateway_tasks/dispatch/priority.py): linear = base_weight +
# alpha x wait; capped = bands 1000 apart by tier rank, +100 per 60 s waited, at most 800
AGING_PRESETS = ("linear", "capped")
CHARGE_MODES = ("reserve", "actual")
# how an upstream counts its quota (Pool.window; docs/rate-limits.md): "bucket" a continuous
# token bucket as OpenAI describes, refunding what a reply did not use; "strict" a 60 s sliding
# window charging prompt + max_tokens at admission, never refunded
WINDOW_MODES = ("bucket", "strict")
# window="strict": the burst comes out of the refill (any 60 s admits at most the quota), so it
# is kept short -- quota used at steady state is 1 - burst_s / 60
STRICT_MAX_BURST_S = 6.0


@dataclass(frozen=True)
class Tier:
    """A class of tenants and how the router treats its traffic."""

    name: str
    base_weight: float                 # the policy aging's base score (vip 100, normal 20, batch 1)
    aging_alpha_per_ms: float          # aging: score gained per ms waited (Score = base + alpha x wait_ms)
    share: float                       # wfq: the tier's share of the tokens while every tier is backlogged
    jitter_window_s: int               # tenant crons of the tier fire within this window after their time
    max_wait_ms: int                   # a task waiting longer is promoted, and raises the load level
    max_concurrency_per_tenant: int    # tasks of one tenant in flight at once, per pool
    max_tasks_per_hour: int            # tasks one tenant may submit per clock hour (crons included)
    retry_budget_ratio: float          # retries the tier may spend, as a fraction of its completed tasks
    # whether the load level may lower the quality of its model (an action's model =
    # "fallback"); caps and deferral of Overload.actions apply to any tier
    can_degrade: bool
    # the last fraction of every pool bucket that only this tier's interactive work may use
    reserved_share: float = 0.0
    queue_max_len: int = 100_000       # tasks queued in the tier per pool: more are refused (QueueFull)
    # interactive work queued longer is dropped before dispatch (Expired), its tokens
    # refunded; scheduled work never goes stale; 0 = never
    queue_ttl_s: float = 0.0
    aliases: tuple[str, ...] = ()      # other names of the tier (enterprise, pro, free)
    # retries of one task (429 requeues included) before it fails with RetryBudgetExceeded,
    # on top of the tier-wide retry_budget_ratio that stops retry storms
    max_retries: int = 3
    # each tenant's own token bucket (TPM, checked at submit next to its hourly quota);
    # 0 = none.  A tenant's own ``tpm`` (gateway tenant add --tpm) overrides it.
    tenant_tpm: int = 0
    # overload (Settings.overload.actions): a held deferral of this tier is released at the
    # latest when this daily window opens, "HH:MM-HH:MM" in Overload.off_peak_timezone (the
    # night's low traffic), and work deferred inside it is released at once ("" = none)
    off_peak: str = ""
    # lanes (gateway_tasks/dispatch/lanes.py): inside the tier, a tenant whose next task is
    # scheduled (a cron run) waits behind interactive work by this many weighted tokens of
    # virtual time at most, then goes in fair order; 0 = no lanes (one fair order for all)
    scheduled_lag_tokens: int = 8192
    # tenant crons (beat): how many one tenant may register; their fires per clock hour
    # together are also held to max_tasks_per_hour at registration (beat.admission)
    max_crons_per_tenant: int = 20

    def validate(self) -> None:
        where = f"tier {self.name!r}"
        _require(bool(self.name) and self.name.isidentifier(), where, "name", self.name,
                 "a non-empty identifier (letters, digits, _)")
        _require(self.base_weight >= 0, where, "base_weight", self.base_weight, ">= 0")
        _require(self.aging_alpha_per_ms >= 0, where, "aging_alpha_per_ms",
                 self.aging_alpha_per_ms, ">= 0")
        _require(0 < self.share <= 100, where, "share", self.share, "in (0, 100]")
        _require(self.jitter_window_s >= 0, where, "jitter_window_s", self.jitter_window_s, ">= 0")
        _require(self.max_wait_ms > 0, where, "max_wait_ms", self.max_wait_ms, "> 0")
        _require(self.max_concurrency_per_tenant > 0, where, "max_concurrency_per_tenant",
                 self.max_concurrency_per_tenant, "> 0")
        _require(self.max_tasks_per_hour > 0, where, "max_tasks_per_hour",
                 self.max_tasks_per_hour, "> 0")
        _require(0 <= self.retry_budget_ratio <= 1, where, "retry_budget_ratio",
                 self.retry_budget_ratio, "in [0, 1]")
        _require(0 <= self.reserved_share < 1, where, "reserved_share", self.reserved_share,
                 "in [0, 1)")
        _require(self.queue_max_len > 0, where, "queue_max_len", self.queue_max_len, "> 0")
        _require(self.queue_ttl_s >= 0, where, "queue_ttl_s", self.queue_ttl_s, ">= 0")
        _require(self.max_retries >= 0, where, "max_retries", self.max_retries, ">= 0")
        _require(self.tenant_tpm >= 0, where, "tenant_tpm", self.tenant_tpm,
                 ">= 0 tokens per minute (0 = no per-tenant TPM quota)")
        _require(isinstance(self.off_peak, str) and (not self.off_peak or daily_window(self.off_peak) is not None),
                 where, "off_peak", self.off_peak, "\"HH:MM-HH:MM\" (a daily window; \"\" = none)")
        _require(isinstance(self.scheduled_lag_tokens, int) and not isinstance(self.scheduled_lag_tokens, bool)
                 and 0 <= self.scheduled_lag_tokens <= MAX_SCHEDULED_LAG_TOKENS, where, "scheduled_lag_tokens",
                 self.scheduled_lag_tokens, f"a whole number of tokens in [0, {MAX_SCHEDULED_LAG_TOKENS:_}] "
                 f"(0 = no scheduled lane)")
        _require(isinstance(self.max_crons_per_tenant, int) and not isinstance(self.max_crons_per_tenant, bool)
                 and self.max_crons_per_tenant >= 0, where, "max_crons_per_tenant", self.max_crons_per_tenant,
                 "a whole number >= 0 (0 = the tier's tenants may register no cron)")


@dataclass(frozen=True)
class Pool:
    """An upstream (OpenAI-compatible endpoint) with its own TPM/RPM quota."""

    name: str
    base_url: str                      # the upstream's OpenAI-compatible endpoint, e.g. https://api.openai.com/v1
    api_key: str = field(repr=False)   # the upstream's key inline (prefer api_key_env), never shown
    models: tuple[str, ...]            # the models this pool serves; the first is the default
    tpm: int                           # the upstream's tokens-per-minute quota
    rpm: int                           # the upstream's requests-per-minute quota
    burst_s: float = 60.0              # bucket capacity: this many seconds of tpm/rpm
    # "reserve": the upstream charges prompt + max_tokens at admission, then settles (OpenAI);
    # "actual": only the tokens used count (the estimate uses a learned completion length)
    charge: str = "reserve"
    # how the upstream counts (WINDOW_MODES): "bucket" (default) or "strict" (docs/rate-limits.md)
    window: str = "bucket"
    # the tier reserve (Tier.reserved_share) is held back from other tiers only while a reserved
    # tier has work queued on this pool or had a task dispatched here in the last reserve_hold_s
    reserve_hold_s: float = 60.0
    timeout_s: float = 60.0            # one upstream call\'s timeout
    # the model a level's action with model = "fallback" routes to (Overload.actions), for a
    # model of this pool that Overload.fallback_models does not map ("" = none)
    fallback_model: str = ""
    # tasks queued on this pool, all tiers together: when full, an arrival evicts the newest
    # queued task of a lower tier (lua/dispatch/evict.lua), else it is refused (QueueFull); 0 = no limit
    queue_capacity: int = 100_000
    # pools reserved tiers fail over to when this one is drained by a 429, failing (circuit
    # open) or cannot admit within the tier's max wait: another key, or another provider
    backup_pools: tuple[str, ...] = ()
    # the environment variable holding the API key: read when the settings are loaded, in
    # each process's own environment; where it is not set the pool has no key in that process
    # (only workers call the upstream, and a worker refuses to start without its pools' keys)
    api_key_env: str = ""
    # the most choices (``n``) one request may ask for: its completion reserve is max_tokens x n;
    # a request asking for more is refused at admission (1: n > 1 is refused)
    max_n: int = 1

    @property
    def model(self) -> str:
        return self.models[0]

    def validate(self) -> None:
        where = f"pool {self.name!r}"
        _require(bool(self.name) and self.name.replace("-", "_").isidentifier(), where, "name",
                 self.name, "a non-empty name of letters, digits, '_' or '-'")
        _require(self.base_url.startswith(("http://", "https://")), where, "base_url",
                 self.base_url, "an http(s) URL such as http://127.0.0.1:8099/v1")
        _require(len(self.models) > 0 and all(self.models), where, "models", self.models,
                 "at least one model name")
        _require(self.tpm > 0, where, "tpm", self.tpm, "> 0 tokens per minute")
        _require(self.rpm > 0, where, "rpm", self.rpm, "> 0 requests per minute")
        _require(0 < self.burst_s <= 60, where, "burst_s", self.burst_s, "in (0, 60]")
        _require(self.charge in CHARGE_MODES, where, "charge", self.charge,
                 f"one of {CHARGE_MODES}")
        _require(self.window in WINDOW_MODES, where, "window", self.window, f"one of {WINDOW_MODES}")
        _require(self.window != "strict" or self.burst_s <= STRICT_MAX_BURST_S, where, "burst_s",
                 self.burst_s, f"<= {STRICT_MAX_BURST_S:g} s with window = \"strict\" (a sliding window "
                 f"admits at most tpm in any 60 s: the burst is taken out of the refill)")
        _require(self.window != "strict" or self.charge == "reserve", where, "charge", self.charge,
                 "\"reserve\" with window = \"strict\" (a strict upstream charges prompt + max_tokens)")
        _require(self.window != "strict" or self.rpm > self.request_capacity, where, "rpm", self.rpm,
                 "more than the request capacity (rpm * burst_s / 60, at least 1) with window = \"strict\"")
        _require(self.reserve_hold_s >= 0, where, "reserve_hold_s", self.reserve_hold_s, ">= 0 s")
        _require(self.timeout_s > 0, where, "timeout_s", self.timeout_s, "> 0")
        _require(self.queue_capacity >= 0, where, "queue_capacity", self.queue_capacity,
                 ">= 0 tasks (0 = no shared limit)")
        _require(isinstance(self.max_n, int) and not isinstance(self.max_n, bool) and self.max_n >= 1,
                 where, "max_n", self.max_n, "an integer >= 1 (1 = n > 1 is refused)")

    @property
    def token_capacity(self) -> float:
        return bucket_capacity(self.tpm, self.burst_s)

    @property
    def request_capacity(self) -> float:
        return request_bucket_capacity(self.rpm, self.burst_s)

    def rates(self) -> tuple[float, float, float, float]:
        """(token capacity, tokens per ms, request capacity, requests per ms) of its bucket."""
        return bucket_rates_of(self.tpm, self.rpm, self.burst_s, self.window)

    def public(self) -> "Pool":
        """This pool without its secret: no API key, no credentials in the URL."""
        return replace(self, api_key="", base_url=without_credentials(self.base_url))

    def key_problem(self, who: str = "this process") -> str:
        """'' when this pool has its API key here, else what is missing and how to give it
        (never the key itself)."""
        if self.api_key:
            return ""
        if self.api_key_env:
            var = self.api_key_env
            return (f"pool {self.name!r}: api_key_env={var!r} but {var} is not set in {who}'s "
                    f"environment; export {var}=<the upstream's API key>")
        return (f"pool {self.name!r}: no API key; set api_key_env = \"VAR\" in its [[pools]] table "
                f"and export VAR=<the upstream's API key>, or api_key")


def bucket_capacity(per_minute: float, burst_s: float) -> float:
    """A per-minute quota's bucket size when it may burst for burst_s seconds."""
    return per_minute * burst_s / 60.0


def bucket_rates_of(tpm: float, rpm: float, burst_s: float, window: str) -> tuple[float, float, float, float]:
    """(token capacity, tokens per ms, request capacity, requests per ms) of a pool's bucket.

    "bucket": capacity burst_s of quota, refilled at the quota.  "strict": a 60 s sliding
    window admits at most the quota in any 60 s, and a bucket admits at most capacity + 60 s
    of refill in any 60 s, so the refill is the quota less the capacity: the spend is smoothed
    over the window."""
    tcap, rcap = bucket_capacity(tpm, burst_s), request_bucket_capacity(rpm, burst_s)
    if window == "strict":
        return (tcap, max(0.0, tpm - tcap) / 60_000.0, rcap, max(0.0, rpm - rcap) / 60_000.0)
    return (tcap, tpm / 60_000.0, rcap, rpm / 60_000.0)


def request_bucket_capacity(rpm: float, burst_s: float) -> float:
    """The request bucket's size: ``bucket_capacity``, but room for at least one request."""
    return max(1.0, bucket_capacity(rpm, burst_s))


def default_tiers() -> tuple[Tier, ...]:
    return (
        Tier("vip", base_weight=100, aging_alpha_per_ms=0.05, share=70, jitter_window_s=0,
             max_wait_ms=2_000, max_concurrency_per_tenant=50, max_tasks_per_hour=500,
             retry_budget_ratio=0.2, can_degrade=False, reserved_share=0.2, queue_ttl_s=15.0,
             max_retries=5, aliases=("enterprise",), max_crons_per_tenant=100),
        # interactive tiers drop work that waited past 15 s before dispatch: its caller has gone
        Tier("normal", base_weight=20, aging_alpha_per_ms=0.02, share=20, jitter_window_s=120,
             max_wait_ms=30_000, max_concurrency_per_tenant=10, max_tasks_per_hour=60,
             retry_budget_ratio=0.1, can_degrade=False, max_retries=3, aliases=("pro",),
             queue_ttl_s=15.0, max_crons_per_tenant=20),
        # no queue TTL for batch (queue_ttl_s 0): batch work of any age is still useful -- nobody
        # is waiting on the other end, the caller polls or is called back for the result
        Tier("batch", base_weight=1, aging_alpha_per_ms=0.005, share=10, jitter_window_s=600,
             max_wait_ms=300_000, max_concurrency_per_tenant=2, max_tasks_per_hour=10,
             retry_budget_ratio=0.05, can_degrade=True, max_retries=1, aliases=("free",),
             max_crons_per_tenant=5),
    )


def default_pools() -> tuple[Pool, ...]:
    return (
        Pool("default", base_url="http://127.0.0.1:8099/v1", api_key="sk-local-simulator",
             models=("gpt-4o-mini", "gpt-4o"), tpm=600_000, rpm=6_000),
    )


MAX_LEVEL = 4  # load levels L0 (normal) .. L4 (the most degraded)
EXECUTE, DEFER = "execute", "defer"
REQUESTED, FALLBACK = "requested", "fallback"
# the design document's reason codes (any lower-case code of letters, digits and _ is accepted)
CAPACITY_PRESSURE, SYSTEM_OVERLOAD = "capacity_pressure", "system_overload"
_REASON_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_WINDOW = re.compile(r"([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-3]):([0-5]\d)")


def daily_window(text: str) -> tuple[int, int] | None:
    """"HH:MM-HH:MM" as (start, end) in minutes after midnight (end < start: it spans
    midnight); None when malformed or empty (start == end)."""
    m = _WINDOW.fullmatch(text)
    if m is None:
        return None
    start, end = int(m[1]) * 60 + int(m[2]), int(m[3]) * 60 + int(m[4])
    return None if start == end else (start, end)


@dataclass(frozen=True)
class LevelAction:
    """One cell of the degradation table: what new work of ``tier`` (a tier's name or
    alias) gets at load ``level`` (gateway_tasks/overload/actions.py applies it).

    ``execute``: run it, with ``max_tokens_cap`` (max_tokens = min(requested, cap)) or a
    fixed ``max_tokens`` (0 = as requested), on the ``model`` requested or its fallback.
    ``defer``: do not run it now; ``retry_after_s`` and the ``reason`` code say when and why
    (held and released later, or refused when the caller asks for a refusal)."""

    level: int                         # the load level, 1..4
    tier: str                          # the tier (or an alias of it)
    action: str = EXECUTE              # "execute" or "defer"
    max_tokens_cap: int = 0            # execute: max_tokens = min(requested, this) (0 = no cap)
    max_tokens: int = 0                # execute: max_tokens fixed at this (0 = as requested)
    model: str = REQUESTED             # execute: "requested", or "fallback" (its model's fallback)
    retry_after_s: float = 0.0         # defer: when to try again
    reason: str = ""                   # defer: the reason code (capacity_pressure, system_overload)

    @property
    def where(self) -> str:
        return f"[overload.actions.L{self.level}.{self.tier}]"

    def validate(self) -> "LevelAction":
        w = self.where
        _require(isinstance(self.level, int) and 1 <= self.level <= MAX_LEVEL, w, "level", self.level,
                 f"L1..L{MAX_LEVEL} (L0 always executes as requested)")
        _require(self.action in (EXECUTE, DEFER), w, "action", self.action, f"{EXECUTE!r} or {DEFER!r}")
        for name in ("max_tokens_cap", "max_tokens"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, w, name, value,
                     "a whole number of tokens >= 0 (0 = none)")
        _require(self.model in (REQUESTED, FALLBACK), w, "model", self.model, f"{REQUESTED!r} or {FALLBACK!r}")
        if self.action == EXECUTE:
            _require(not (self.max_tokens_cap and self.max_tokens), w, "max_tokens", self.max_tokens,
                     "0 when max_tokens_cap is set (a cap, or a fixed max_tokens, not both)")
            _require(not self.retry_after_s and not self.reason, w, "retry_after_s",
                     (self.retry_after_s, self.reason), "unset for an execute (retry_after_s and reason "
                     "belong to a defer)")
        else:
            _require(isinstance(self.retry_after_s, (int, float)) and not isinstance(self.retry_after_s, bool)
                     and 0 < self.retry_after_s <= 7 * 86_400, w, "retry_after_s", self.retry_after_s,
                     "> 0 seconds (at most 7 days) for a defer")
            _require(isinstance(self.reason, str) and bool(_REASON_CODE.fullmatch(self.reason)), w, "reason",
                     self.reason, "a reason code of lower-case letters, digits and _ (e.g. "
                     f"{CAPACITY_PRESSURE!r}, {SYSTEM_OVERLOAD!r})")
            _require(not self.max_tokens_cap and not self.max_tokens and self.model == REQUESTED, w, "action",
                     self.action, "an execute when max_tokens_cap, max_tokens or model is set")
        return self


def _cells(table: dict[str, dict[str, dict[str, Any]]]) -> tuple[LevelAction, ...]:
    return tuple(LevelAction(level, tier, **cell) for level in range(1, MAX_LEVEL + 1)
                 for tier, cell in table.get(f"L{level}", {}).items())


_DEFER_300 = {"action": DEFER, "retry_after_s": 300.0, "reason": CAPACITY_PRESSURE}
_DEFER_600 = {"action": DEFER, "retry_after_s": 600.0, "reason": SYSTEM_OVERLOAD}
# the degradation presets (Overload.degradation); a tier a preset does not name executes as
# requested at every level, and so does every tier at L0
DEGRADATION_PRESETS: dict[str, tuple[LevelAction, ...]] = {
    # the design document's table (free = batch, pro = normal, enterprise = vip)
    "design": _cells({
        "L1": {"free": {"max_tokens_cap": 2048}},
        "L2": {"pro": {"max_tokens_cap": 2048}, "free": {"max_tokens": 1024, "model": FALLBACK}},
        "L3": {"pro": _DEFER_300, "free": _DEFER_300},
        "L4": {"enterprise": {"max_tokens_cap": 2048}, "pro": _DEFER_600, "free": _DEFER_600},
    }),
    # the table this project shipped before the design's (normal needs can_degrade = true)
    "project": _cells({
        "L1": {"pro": {"max_tokens_cap": 2048}, "free": {"max_tokens_cap": 2048}},
        "L2": {"pro": {"max_tokens_cap": 1024, "model": FALLBACK},
               "free": {"max_tokens_cap": 1024, "model": FALLBACK}},
        "L3": {"pro": {"max_tokens_cap": 1024, "model": FALLBACK},
               "free": {"action": DEFER, "retry_after_s": 600.0, "reason": CAPACITY_PRESSURE}},
        "L4": {"pro": {"action": DEFER, "retry_after_s": 300.0, "reason": SYSTEM_OVERLOAD},
               "free": {"action": DEFER, "retry_after_s": 600.0, "reason": SYSTEM_OVERLOAD}},
    }),
    "none": (),   # no degradation: every tier executes as requested at every level
}


@dataclass(frozen=True)
class Overload:
    """The load-level controller (gateway_tasks/overload/controller.py) and what each level does
    (gateway_tasks/overload/actions.py)."""

    enabled: bool = True           # run the controller (off: the level stays L0)
    tick_s: float = 1.0            # one decision per tick for the whole deployment
    window_s: float = 10.0         # rates (tokens used, errors) are measured over this window
    hold_s: float = 30.0           # a level falls only after its trigger stayed off this long
    # pool utilisation (tokens the upstream reported over the window / the pool's TPM)
    # above which the level is at least L1, L2, L3
    utilisation_thresholds: tuple[float, ...] = (0.75, 0.85, 0.95)
    # the same thresholds applied ahead of time: the tasks queued for a pool (estimated
    # tokens / its TPM) commit it to at least that utilisation over the next window
    backlog_signal: bool = True
    error_rate_threshold: float = 0.1   # upstream (5xx, timeouts, 429) / calls over the window
    error_rate_level: int = 4           # the level an error rate over the threshold asks for
    error_min_calls: int = 20           # fewer calls in the window: the error rate is not judged
    queue_depth_threshold: int = 10_000  # tasks queued, all tiers and pools: above it -> L4
    queue_depth_level: int = 4           # the level a queue deeper than the threshold asks for
    # a tier whose dispatched tasks waited past its max_wait_ms (mean over the window), or
    # whose oldest queued task (among the tenants next in line) is older than that
    wait_level: int = 3
    # what each level does to each tier: a preset of DEGRADATION_PRESETS ...
    degradation: str = "design"
    # ... with these cells in place of the preset's (TOML: [overload.actions.L3.batch] tables)
    actions: tuple[LevelAction, ...] = ()
    # model -> fallback model (a pool's fallback_model covers the models not listed)
    fallback_models: tuple[tuple[str, str], ...] = (("claude-sonnet-4-6", "claude-haiku-4-5-20251001"),
                                                    ("gpt-4o", "gpt-4o-mini"), ("deepseek-r1", "deepseek-v3"))
    # per-tenant attribution (gateway_tasks/overload/attribution.py): at most this many tenants
    # over their fair share, holding together at least held_demand_share of a pool's demand, are
    # held at the level they cause instead of the deployment (0 = off)
    held_tenants_max: int = 1
    held_demand_share: float = 0.5     # ... the share of a pool's demand those tenants must hold together
    # the IANA time zone of the tiers' off_peak windows
    off_peak_timezone: str = "UTC"
    # held deferrals released at most per tick (the controller's; oldest first)
    deferred_release_per_tick: int = 500

    def validate(self) -> "Overload":
        w = "overload"
        _require(self.tick_s > 0, w, "tick_s", self.tick_s, "> 0 seconds")
        _require(self.window_s >= self.tick_s, w, "window_s", self.window_s, f">= tick_s ({self.tick_s})")
        _require(self.hold_s >= self.tick_s, w, "hold_s", self.hold_s, f">= tick_s ({self.tick_s})")
        th = self.utilisation_thresholds
        _require(len(th) == 3 and all(0 < x for x in th) and list(th) == sorted(th), w,
                 "utilisation_thresholds", th, "three increasing fractions > 0 (L1, L2, L3)")
        _require(0 < self.error_rate_threshold <= 1, w, "error_rate_threshold",
                 self.error_rate_threshold, "in (0, 1]")
        for name in ("error_rate_level", "queue_depth_level", "wait_level"):
            value = getattr(self, name)
            _require(isinstance(value, int) and 0 <= value <= MAX_LEVEL, w, name, value,
                     f"an integer in [0, {MAX_LEVEL}] (0 = off)")
        _require(self.error_min_calls >= 1, w, "error_min_calls", self.error_min_calls, ">= 1")
        _require(isinstance(self.backlog_signal, bool), w, "backlog_signal", self.backlog_signal,
                 "true or false")
        _require(self.queue_depth_threshold > 0, w, "queue_depth_threshold",
                 self.queue_depth_threshold, "> 0 tasks")
        _require(isinstance(self.held_tenants_max, int) and self.held_tenants_max >= 0, w, "held_tenants_max",
                 self.held_tenants_max, "an integer >= 0 (0 = no tenant is held apart)")
        _require(0 < self.held_demand_share <= 1, w, "held_demand_share", self.held_demand_share, "in (0, 1]")
        _require(self.degradation in DEGRADATION_PRESETS, w, "degradation", self.degradation,
                 f"one of {sorted(DEGRADATION_PRESETS)}")
        seen: set[tuple[int, str]] = set()
        for cell in self.actions:
            _require(isinstance(cell, LevelAction), w, "actions", cell, "tables of level actions")
            cell.validate()
            _require((cell.level, cell.tier) not in seen, cell.where, "tier", cell.tier, "one cell per level and tier")
            seen.add((cell.level, cell.tier))
        for pair in self.fallback_models:
            _require(len(pair) == 2 and all(isinstance(m, str) and m for m in pair) and pair[0] != pair[1],
                     w, "fallback_models", pair, "model = \"another model\"")
        _require(isinstance(self.off_peak_timezone, str) and _timezone_ok(self.off_peak_timezone), w,
                 "off_peak_timezone", self.off_peak_timezone, "an IANA time zone such as \"UTC\" or "
                 "\"Asia/Shanghai\"")
        _require(isinstance(self.deferred_release_per_tick, int) and self.deferred_release_per_tick >= 1, w,
                 "deferred_release_per_tick", self.deferred_release_per_tick, ">= 1 task")
        return self

    def fallback_for(self, model: str, pool_fallback: str = "") -> str:
        """The fallback model of ``model`` ("" = none)."""
        for src, dst in self.fallback_models:
            if src == model:
                return dst
        return pool_fallback if pool_fallback != model else ""

    def cell(self, level: int, tier: "Tier") -> LevelAction | None:
        """The table's cell for ``tier`` (matched by name or alias) at ``level``: the
        configured one, else the preset's; None = execute as requested."""
        names = (tier.name, *tier.aliases)
        for cells in (self.actions, DEGRADATION_PRESETS.get(self.degradation, ())):
            for c in cells:
                if c.level == level and c.tier in names:
                    return c
        return None


def _timezone_ok(name: str) -> bool:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Circuit:
    """The circuit breaker of each pool (lua/upstream/circuit.lua, gateway_tasks/upstream/circuit.py)."""

    failure_threshold: int = 5     # consecutive 5xx / timeouts / connection errors: open
    open_s: float = 2.0            # open this long, then one half-open probe
    probe_timeout_s: float = 30.0  # a probe that never reports back frees the half-open slot

    def validate(self) -> "Circuit":
        _require(self.failure_threshold >= 1, "circuit", "failure_threshold", self.failure_threshold, ">= 1")
        _require(self.open_s > 0, "circuit", "open_s", self.open_s, "> 0 seconds")
        _require(self.probe_timeout_s > 0, "circuit", "probe_timeout_s", self.probe_timeout_s, "> 0 seconds")
        return self


@dataclass(frozen=True)
class Settings:
    # the deployment's Redis: redis://[user:password@]host:port/db (rediss:// for TLS), or a Redis
    # Cluster, redis+cluster://host1:port,host2:port (rediss+cluster:// for TLS; any of its
    # masters, the others are discovered), which then needs control_redis_url
    redis_url: str = ""
    # a small standalone Redis for Celery's own machinery, which cannot live on a cluster (kombu's
    # bindings, worker control and its replies, task events for Flower): required with a cluster
    # redis_url, optional otherwise ('' = redis_url).  Queues, tenants, buckets and results stay
    # on redis_url; REDIS_USERNAME, REDIS_PASSWORD and REDIS_TLS_* apply to both
    control_redis_url: str = ""
    key_prefix: str = "gt:"            # every Redis key starts with it: several deployments per Redis
    policy: str = "wfq"                # the order between tiers: fifo | strict | aging | wfq
    tiers: tuple[Tier, ...] = field(default_factory=default_tiers)   # the tenant tiers ([[tiers]])
    pools: tuple[Pool, ...] = field(default_factory=default_pools)   # the upstreams ([[pools]])
    max_prompt_tokens: int = 128_000   # a longer prompt is refused at submit (PromptTooLarge)
    max_request_bytes: int = 4_194_304  # REST request bodies (a 128k-token prompt is ~512 KB)
    # nesting levels of a request's JSON (REST bodies, messages and extra_body of every submit)
    max_json_depth: int = 64
    default_max_tokens: int = 256      # max_tokens of a request that names none
    result_ttl_s: int = 86_400         # how long a task's result is kept
    # the last-resort restore of a dispatched task whose lease stopped being renewed
    visibility_timeout_s: int = 3_600
    # a dispatcher's hold on a task it took: renewed while it lives; a task whose lease
    # expired (its worker died) goes back to the front of its tenant's line
    lease_s: float = 5.0
    # worker slots each dispatcher keeps free for interactive work of reserved tiers (vip):
    # work that may not use the pool's token reserve (other tiers, scheduled vip runs) is
    # picked only while more than this many of its slots are free, so a vip user finds a slot
    # at once behind a storm; at least one slot stays for everything else, and none is kept
    # by a dispatcher that serves no reserved tier (0 = off)
    reserved_worker_slots: int = 1
    # how long a worker thread runs Python before the interpreter asks it to hand the GIL to
    # another that waits (sys.setswitchinterval); a thread whose upstream reply has arrived
    # waits up to this for each of the several times it takes the GIL back while other
    # threads are busy (the SDK's parse, other tasks' dispatch and settle) -- see workers/interpreter.py
    worker_switch_interval_ms: float = 5.0
    # a ready worker moves its startup objects (~150k: the SDK, Celery, pools) out of the
    # garbage collector's full collections (gc.freeze): each of those stopped every thread for
    # 85-224 ms in the cron storm -- see workers/interpreter.py
    worker_gc_freeze: bool = True
    # how long an API process authenticates a key it authenticated before from memory, without
    # Redis (0 = off); a key rotated or a tenant deleted is dropped at once by every API process
    # listening for it, and none uses the cache while not listening (gateway_tasks/tenants/auth_cache.py)
    auth_cache_s: float = 2.0
    auth_cache_entries: int = 10_000   # keys kept per API process at most (the oldest go first)
    # secrets: from the environment (GATEWAY_API_KEY_SECRET, GATEWAY_ADMIN_KEY), never shown,
    # logged or passed to Celery (public() blanks them)
    api_key_secret: str = field(default="", repr=False)   # HMAC key of the stored API key hashes
    admin_key: str = field(default="", repr=False)        # the REST admin credential (/v1/admin/*)
    # the secret before a rotation: keys hashed with it still authenticate, and are rehashed
    api_key_secret_previous: str = field(default="", repr=False)
    # Redis AUTH / ACL and TLS, kept out of the URL (REDIS_USERNAME, REDIS_PASSWORD,
    # REDIS_TLS_*): merged into redis_url at construction when the URL has none of its own
    redis_username: str = ""
    redis_password: str = field(default="", repr=False)   # Redis AUTH password (REDIS_PASSWORD), never shown
    redis_tls_ca_file: str = ""        # rediss://: the CA bundle that signed the server's certificate
    redis_tls_cert_file: str = ""      # rediss:// with client certificates (mTLS)
    redis_tls_key_file: str = ""       # rediss:// with client certificates: the client's key
    redis_tls_cert_reqs: str = "required"   # rediss://: none | optional | required

    def __post_init__(self) -> None:
        for name in ("redis_url", "control_redis_url"):
            composed = with_redis_auth_and_tls(
                getattr(self, name), username=self.redis_username, password=self.redis_password,
                ca_file=self.redis_tls_ca_file, cert_file=self.redis_tls_cert_file,
                key_file=self.redis_tls_key_file, cert_reqs=self.redis_tls_cert_reqs)
            object.__setattr__(self, name, composed)
    # producers refuse submits (RedisFull) once Redis uses this fraction of its maxmemory,
    # so the dispatch machinery (picks, acks, results) keeps head-room; 0 = never refuse early
    redis_memory_refuse_ratio: float = 0.9
    # ... and once less than this is left below maxmemory, whatever the ratio: a worker
    # connecting to a full queue needs ~1 MiB at once (its connections' buffers)
    redis_memory_reserve_mib: float = 4.0
    # a queued task with a deadline_s is promoted inside its tier once less than this is left
    # (lua/dispatch/deadline.lua, lua/dispatch/pick.lua); 0 = no deadline boost
    deadline_boost_s: float = 60.0
    # ... and across tiers: an urgent task competes at its tier's band less 1500 (>= 0), so an
    # urgent normal task goes with VIP work (the older first), an urgent batch one after VIP
    # before normal (gateway_tasks/dispatch/priority.py); false: it stays inside its tier
    deadline_boost_across_tiers: bool = True
    # the aging policy's preset: "linear" or "capped" (gateway_tasks/dispatch/priority.py)
    aging: str = "linear"
    # a tenant's usage counters (GET /v1/usage, gateway_tasks.usage) are kept this many days
    usage_retention_days: int = 31
    # the Batch API (gateway_tasks.batches): the directory its files are stored in ('' = the
    # Batch API is off; Redis keeps only their index)
    batch_dir: str = ""
    batch_max_tenant_bytes: int = 1_073_741_824   # each tenant's stored batch files (bytes), at most
    batch_max_lines: int = 50_000             # requests one batch input file may hold
    batch_lines_in_flight: int = 500          # a batch's lines queued at once (the rest as those finish)
    batch_max_file_bytes: int = 104_857_600   # one uploaded file (POST /v1/files: its own body limit)
    batch_tier: str = ""   # lines run in this tier, or the tenant's own when lower ('' = the lowest tier)
    overload: Overload = field(default_factory=Overload)   # load levels and degradation ([overload])
    circuit: Circuit = field(default_factory=Circuit)      # each pool's circuit breaker ([circuit])
    # where these settings were loaded from (set by load_settings, shown at each process's
    # start and by `gateway status`; not a setting: a file or JSON cannot hold it)
    config_source: str = field(default="", compare=False)

    def validate(self) -> "Settings":
        _require(self.policy in POLICIES, "settings", "policy", self.policy, f"one of {POLICIES}")
        _require(bool(self.key_prefix) and ":" in self.key_prefix and " " not in self.key_prefix
                 and not {"{", "}"} & set(self.key_prefix),   # a hash tag there: every key in one slot
                 "settings", "key_prefix", self.key_prefix, "a prefix ending in ':' without '{' or '}', e.g. 'gt:'")
        _require(len(self.tiers) > 0, "settings", "tiers", self.tiers, "at least one tier")
        _require(len(self.pools) > 0, "settings", "pools", self.pools, "at least one pool")
        _require(self.max_prompt_tokens > 0, "settings", "max_prompt_tokens",
                 self.max_prompt_tokens, "> 0")
        _require(0.5 <= self.lease_s < self.visibility_timeout_s, "settings", "lease_s", self.lease_s,
                 f"at least 0.5 and below visibility_timeout_s ({self.visibility_timeout_s})")
        _require(self.reserved_worker_slots >= 0, "settings", "reserved_worker_slots",
                 self.reserved_worker_slots, ">= 0 slots (0 = off)")
        _require(isinstance(self.worker_gc_freeze, bool), "settings", "worker_gc_freeze", self.worker_gc_freeze,
                 "true or false")
        _require(0 <= self.auth_cache_s <= 60, "settings", "auth_cache_s", self.auth_cache_s,
                 "in [0, 60] seconds (0 = off)")
        _require(isinstance(self.auth_cache_entries, int) and not isinstance(self.auth_cache_entries, bool)
                 and 1 <= self.auth_cache_entries <= 10_000_000, "settings", "auth_cache_entries",
                 self.auth_cache_entries, "an integer from 1 to 10,000,000 keys")
        _require(0.05 <= self.worker_switch_interval_ms <= 1000, "settings", "worker_switch_interval_ms",
                 self.worker_switch_interval_ms, "in [0.05, 1000] ms (CPython's default: 5)")
        _require(0 <= self.redis_memory_refuse_ratio <= 1, "settings", "redis_memory_refuse_ratio",
                 self.redis_memory_refuse_ratio, "in [0, 1] (0 = off)")
        _require(self.redis_memory_reserve_mib >= 0, "settings", "redis_memory_reserve_mib",
                 self.redis_memory_reserve_mib, ">= 0 MiB")
        _require(self.deadline_boost_s >= 0, "settings", "deadline_boost_s", self.deadline_boost_s,
                 ">= 0 seconds (0 = no deadline boost)")
        _require(isinstance(self.deadline_boost_across_tiers, bool), "settings", "deadline_boost_across_tiers",
                 self.deadline_boost_across_tiers, "true or false")
        _require(self.aging in AGING_PRESETS, "settings", "aging", self.aging, f"one of {AGING_PRESETS}")
        for name, low, high in (("usage_retention_days", 1, 3660), ("batch_max_tenant_bytes", 1, 2 ** 50),
                                ("batch_max_lines", 1, 1_000_000), ("batch_lines_in_flight", 1, 100_000),
                                ("batch_max_file_bytes", 1, 2 ** 40)):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high, "settings",
                     name, value, f"an integer from {low} to {high}")
        _require(isinstance(self.batch_dir, str), "settings", "batch_dir", self.batch_dir,
                 "a directory path ('' = the Batch API is off)")
        _require(self.batch_tier == "" or any(self.batch_tier in (t.name, *t.aliases) for t in self.tiers),
                 "settings", "batch_tier", self.batch_tier, f"'' (the lowest tier) or a tier name {[t.name for t in self.tiers]}")
        _require(self.default_max_tokens > 0, "settings", "default_max_tokens",
                 self.default_max_tokens, "> 0")
        _require(self.max_request_bytes > 0, "settings", "max_request_bytes",
                 self.max_request_bytes, "> 0 bytes")
        _require(isinstance(self.max_json_depth, int) and not isinstance(self.max_json_depth, bool)
                 and 4 <= self.max_json_depth <= 512, "settings", "max_json_depth",
                 self.max_json_depth, "an integer from 4 to 512 levels")
        self._validate_redis()
        for name in ("api_key_secret", "admin_key", "api_key_secret_previous"):
            value = getattr(self, name)
            if not isinstance(value, str) or (value and len(value) < MIN_SECRET_CHARS):
                # never echo a secret, not even a bad one
                raise ConfigError(f"settings: {name} is invalid; expected empty (off) or a string of at "
                                  f"least {MIN_SECRET_CHARS} characters")
        names: set[str] = set()
        for tier in self.tiers:
            tier.validate()
            for n in (tier.name, *tier.aliases):
                if n in names:
                    raise ConfigError(f"tier name or alias {n!r} is used twice")
                names.add(n)
        pool_names = [p.name for p in self.pools]
        if len(set(pool_names)) != len(pool_names):
            raise ConfigError(f"pool names must be unique, got {pool_names}")
        for pool in self.pools:
            pool.validate()
            for backup in pool.backup_pools:
                _require(backup in pool_names and backup != pool.name, f"pool {pool.name!r}",
                         "backup_pools", pool.backup_pools, f"names of other pools among {pool_names}")
        self.overload.validate()
        self.circuit.validate()
        served = {m for p in self.pools for m in p.models}
        for pool in self.pools:
            if pool.fallback_model:
                _require(pool.fallback_model in served, f"pool {pool.name!r}", "fallback_model",
                         pool.fallback_model, f"a model some pool serves ({sorted(served)})")
        for cell in self.overload.actions:
            _require(any(cell.tier in (t.name, *t.aliases) for t in self.tiers), cell.where, "tier", cell.tier,
                     f"a tier's name or alias ({[n for t in self.tiers for n in (t.name, *t.aliases)]})")
        for tier in self.tiers:
            for level in range(1, MAX_LEVEL + 1):
                cell = self.overload.cell(level, tier)
                _require(cell is None or cell.model != FALLBACK or tier.can_degrade, cell.where if cell else "",
                         "model", FALLBACK, f"'requested': tier {tier.name!r} has can_degrade = false (set it "
                         f"true to let the load level lower its model)")
        for src, dst in self.overload.fallback_models:
            # a map entry for a model no pool serves is harmless (never requested); its target
            # must be served, else degrading would turn a servable request into a failing one
            _require(src not in served or dst in served, "overload", "fallback_models", (src, dst),
                     f"a fallback model some pool serves ({sorted(served)})")
        return self

    def _validate_redis(self) -> None:
        scheme = urlsplit(self.redis_url).scheme if self.redis_url else ""
        if self.redis_url and scheme not in REDIS_SCHEMES:
            raise ConfigError(f"settings: redis_url={without_credentials(self.redis_url)!r} is invalid; "
                              f"expected redis://, rediss:// (TLS), unix:// or, for a Redis Cluster, "
                              f"redis+cluster://host1:port,host2:port (rediss+cluster:// for TLS)")
        if scheme in CLUSTER_SCHEMES:
            self._validate_cluster_url()
        control = urlsplit(self.control_redis_url).scheme if self.control_redis_url else ""
        if self.control_redis_url and control not in ("redis", "rediss", "unix"):
            raise ConfigError(f"settings: control_redis_url={without_credentials(self.control_redis_url)!r} is "
                              f"invalid; expected one standalone Redis: redis://host:port/db, rediss:// (TLS) "
                              f"or unix:// (Celery's control machinery cannot live on a cluster)")
        _require(self.redis_tls_cert_reqs in TLS_CERT_REQS, "settings", "redis_tls_cert_reqs",
                 self.redis_tls_cert_reqs, f"one of {TLS_CERT_REQS}")
        tls_files = [n for n in ("redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file")
                     if getattr(self, n)]
        if tls_files and self.redis_url and scheme not in TLS_SCHEMES:
            raise ConfigError(f"settings: {', '.join(tls_files)} set but redis_url is not rediss://: "
                              f"use rediss://host:port/db (rediss+cluster://host1:port,... for a cluster) for TLS")
        if tls_files and self.control_redis_url and control != "rediss":
            raise ConfigError(f"settings: {', '.join(tls_files)} set but control_redis_url is not rediss://: "
                              f"use rediss://host:port/db for the control Redis too")
        if self.redis_username and not self.redis_password and "@" not in urlsplit(self.redis_url).netloc:
            raise ConfigError("settings: redis_username is set without redis_password "
                              "(REDIS_PASSWORD): an ACL user needs its password")

    def _validate_cluster_url(self) -> None:
        shown = without_credentials(self.redis_url)
        try:
            cluster_nodes(self.redis_url)
        except ValueError as exc:
            raise ConfigError(f"settings: redis_url={shown!r} is invalid ({exc}); expected "
                              f"redis+cluster://host1:port,host2:port") from None
        if urlsplit(self.redis_url).path.strip("/") not in ("", "0"):
            raise ConfigError(f"settings: redis_url={shown!r} is invalid; a Redis Cluster has only "
                              f"database 0 (leave the path out, or /0)")
        if not self.control_redis_url:
            raise ConfigError(f"settings: redis_url={shown!r} is a Redis Cluster, and Celery's control "
                              f"machinery (kombu's bindings, worker control and replies, task events) cannot "
                              f"live on one; set control_redis_url (GATEWAY_CONTROL_REDIS_URL) to a small "
                              f"standalone Redis, e.g. GATEWAY_CONTROL_REDIS_URL=redis://control-host:6379/0 "
                              f"(docs/redis-cluster.md)")

    @property
    def redis_cluster(self) -> bool:
        """Whether redis_url names a Redis Cluster."""
        return is_cluster_url(self.redis_url)

    @property
    def broker_url(self) -> str:
        """Where Celery's broker connection goes: control_redis_url, else redis_url."""
        return self.control_redis_url or self.redis_url

    # -- look-ups -----------------------------------------------------------
    def tier(self, name: str) -> Tier:
        for tier in self.tiers:
            if name == tier.name or name in tier.aliases:
                return tier
        known = ", ".join(t.name for t in self.tiers)
        raise ConfigError(f"unknown tier {name!r}; known tiers: {known}")

    def pool(self, name: str) -> Pool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise ConfigError(f"unknown pool {name!r}; known pools: {[p.name for p in self.pools]}")

    def pool_for_model(self, model: str | None) -> Pool:
        if not model:
            return self.pools[0]
        for pool in self.pools:
            if model in pool.models:
                return pool
        served = sorted({m for p in self.pools for m in p.models})
        raise ConfigError(f"no pool serves model {model!r}; served models: {served}")

    def tier_rank(self, name: str) -> int:
        """A tier's place in ``tiers`` (0 = the highest: tiers are listed highest first);
        an arrival may evict queued work of a tier ranked below its own."""
        wanted = self.tier(name).name
        return next(i for i, t in enumerate(self.tiers) if t.name == wanted)

    @property
    def batch_lines_tier(self) -> str:
        """The tier a batch's lines run in (unless the tenant's own ranks lower): ``batch_tier``,
        else the lowest tier."""
        return self.tier(self.batch_tier).name if self.batch_tier else self.tiers[-1].name

    def queue_name(self, tier: str, pool: str) -> str:
        """The Celery queue (a Redis list) of one tier's traffic to one pool."""
        return queue_name(self.tier(tier).name, pool)

    def queue_names(self) -> list[str]:
        return [self.queue_name(t.name, p.name) for p in self.pools for t in self.tiers]

    def with_(self, **changes: Any) -> "Settings":
        return replace(self, **changes).validate()

    def require_keys(self, pool_names: Iterable[str], who: str = "this worker") -> None:
        """A ConfigError naming every pool of ``pool_names`` without its API key here, the
        variable it names and how to set it (a worker's check at start: only the processes
        that call the upstream need the keys)."""
        wanted = set(pool_names)
        problems = [p.key_problem(who) for p in self.pools if p.name in wanted]
        problems = [p for p in problems if p]
        if problems:
            raise ConfigError("; ".join(problems))

    def require_redis_url(self, who: str) -> str:
        """The Redis URL, or a ConfigError saying that `who` needs one and how to give it."""
        if not self.redis_url:
            raise ConfigError(f"{who} needs REDIS_URL (the deployment's Redis), e.g. "
                              f"REDIS_URL=redis://127.0.0.1:6379/0; `gateway redis` runs one to keep "
                              f"and `make demo` an embedded one")
        return self.redis_url

    def public(self) -> "Settings":
        """These settings without secrets (the pools' API keys, credentials in the Redis
        URL, the API-key hashing secret and the admin credential): safe to show, log or pass in the broker's transport options."""
        return replace(self, redis_url=without_credentials(self.redis_url),
                       control_redis_url=without_credentials(self.control_redis_url),
                       pools=tuple(p.public() for p in self.pools), api_key_secret="", admin_key="",
                       api_key_secret_previous="", redis_password="", redis_username="")


def boolean(text: str) -> bool:
    """An environment variable's yes or no: 1/true/yes/on or 0/false/no/off (any case)."""
    value = _BOOLEANS.get(text.strip().lower())
    if value is None:
        raise ValueError(f"not one of {sorted(_BOOLEANS)}")
    return value


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _require(ok: bool, where: str, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {name}={value!r} is invalid; expected {expected}")


def _check_keys(cls: type, data: Mapping[str, Any], where: str) -> None:
    allowed = {f.name for f in fields(cls)}
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    _check_keys(cls, data, where)
    kwargs = dict(data)
    for key in ("aliases", "models", "backup_pools"):
        if key in kwargs:
            value = kwargs[key]
            if isinstance(value, str):
                value = [value]
            kwargs[key] = tuple(value)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _pool(data: Mapping[str, Any], where: str, env: Mapping[str, str], resolve_keys: bool) -> Pool:
    """A pool from its table; ``api_key_env = "OPENAI_API_KEY"`` reads the key from the
    environment, so a settings file never has to hold a secret.  A variable that is not set
    here leaves the pool without its key in this process -- loading never fails for it: the
    API, beat, Flower and the CLI route and account by a pool's other fields, and a worker
    checks its pools' keys at start (workers/startup.py).  With ``resolve_keys`` off no
    variable is read at all (a public view: keys are blank)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a table of pool settings, got {data!r}")
    _check_keys(Pool, data, where)
    data = dict(data)
    var = data.get("api_key_env") or ""
    if var:
        if not isinstance(var, str) or not _ENV_NAME.fullmatch(var):
            # never echo it: a key pasted here in place of a variable's name is a secret
            raise ConfigError(f"{where}: api_key_env is not an environment variable name (letters, "
                              f"digits and _, not starting with a digit); it names the variable "
                              f"that holds the key, e.g. api_key_env = \"OPENAI_API_KEY\"")
        if not data.get("api_key"):
            data["api_key"] = env.get(var, "") if resolve_keys else ""
    if "api_key" not in data:
        raise ConfigError(f"{where}: set api_key_env (the name of an environment variable holding "
                          f"the upstream's API key) or api_key")
    return _build(Pool, data, where)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _overload(data: Any) -> Overload:
    """[overload] as a table: lists become tuples, fallback_models a table or a list of pairs."""
    if isinstance(data, Overload):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"[overload]: expected a table, got {data!r}")
    _check_keys(Overload, data, "[overload]")
    kwargs = dict(data)
    if "utilisation_thresholds" in kwargs:
        kwargs["utilisation_thresholds"] = tuple(kwargs["utilisation_thresholds"])
    if "actions" in kwargs:
        kwargs["actions"] = _actions(kwargs["actions"])
    if "fallback_models" in kwargs:
        raw = kwargs["fallback_models"]
        pairs = raw.items() if isinstance(raw, Mapping) else raw
        try:
            kwargs["fallback_models"] = tuple((str(a), str(b)) for a, b in pairs)
        except (TypeError, ValueError):
            raise ConfigError(f"[overload]: fallback_models={raw!r} is invalid; expected a table "
                              f"model = \"fallback model\"") from None
    try:
        return Overload(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"[overload]: {exc}") from None


def _actions(raw: Any) -> tuple[LevelAction, ...]:
    """[overload.actions] as TOML writes it ({"L3": {"batch": {...}}}) or as settings_to_json
    does (a list of cells with their level and tier)."""
    if isinstance(raw, Mapping):
        cells = []
        for level_name, tiers in raw.items():
            where = f"[overload.actions.{level_name}]"
            if not (isinstance(level_name, str) and re.fullmatch(r"L[1-9]", level_name)):
                raise ConfigError(f"{where}: expected a level L1..L{MAX_LEVEL}")
            if not isinstance(tiers, Mapping):
                raise ConfigError(f"{where}: expected a table of tiers, got {tiers!r}")
            for tier, cell in tiers.items():
                if not isinstance(cell, Mapping):
                    raise ConfigError(f"{where[:-1]}.{tier}]: expected a table, got {cell!r}")
                cells.append(_cell({**cell, "level": int(level_name[1:]), "tier": tier}))
        return tuple(cells)
    if isinstance(raw, (list, tuple)):
        return tuple(c if isinstance(c, LevelAction) else _cell(c) for c in raw)
    raise ConfigError(f"[overload]: actions={raw!r} is invalid; expected tables [overload.actions.L3.batch]")


def _cell(data: Any) -> LevelAction:
    if not isinstance(data, Mapping):
        raise ConfigError(f"[overload.actions]: expected a table, got {data!r}")
    where = f"[overload.actions.L{data.get('level')}.{data.get('tier')}]"
    allowed = {f.name for f in fields(LevelAction)}
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed - {'level', 'tier'})}")
    try:
        return LevelAction(**data)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# environment variables that set one setting each, over the file's (see load_settings)
ENV_SETTINGS: dict[str, tuple[str, Any]] = {
    "REDIS_URL": ("redis_url", str),
    "GATEWAY_CONTROL_REDIS_URL": ("control_redis_url", str),
    "GATEWAY_KEY_PREFIX": ("key_prefix", str),
    "GATEWAY_POLICY": ("policy", str),
    "GATEWAY_AGING": ("aging", str),
    "GATEWAY_MAX_PROMPT_TOKENS": ("max_prompt_tokens", int),
    "GATEWAY_RESERVED_WORKER_SLOTS": ("reserved_worker_slots", int),
    "GATEWAY_WORKER_SWITCH_INTERVAL_MS": ("worker_switch_interval_ms", float),
    "GATEWAY_WORKER_GC_FREEZE": ("worker_gc_freeze", boolean),
    "GATEWAY_AUTH_CACHE_S": ("auth_cache_s", float),
    "GATEWAY_API_KEY_SECRET": ("api_key_secret", str),
    "GATEWAY_ADMIN_KEY": ("admin_key", str),
    "GATEWAY_API_KEY_SECRET_PREVIOUS": ("api_key_secret_previous", str),
    "REDIS_USERNAME": ("redis_username", str),
    "REDIS_PASSWORD": ("redis_password", str),
    "REDIS_TLS_CA_FILE": ("redis_tls_ca_file", str),
    "REDIS_TLS_CERT_FILE": ("redis_tls_cert_file", str),
    "REDIS_TLS_KEY_FILE": ("redis_tls_key_file", str),
    "REDIS_TLS_CERT_REQS": ("redis_tls_cert_reqs", str),
    "GATEWAY_BATCH_DIR": ("batch_dir", str),
    "GATEWAY_USAGE_RETENTION_DAYS": ("usage_retention_days", int),
}

# every variable load_settings reads its settings from: a child process given its
# parent's settings as GATEWAY_SETTINGS_JSON must inherit none of these, each of which
# would override a setting (or, GATEWAY_CONFIG, replace the source).  Pools'
# api_key_env variables are not settings: a child keeps them.
SETTINGS_ENV_VARS: tuple[str, ...] = ("GATEWAY_CONFIG", "GATEWAY_SETTINGS_JSON", "GATEWAY_POOLS_JSON",
                                      *ENV_SETTINGS)



def load_settings(env: Mapping[str, str] | None = None, *, resolve_keys: bool = True,
                  **overrides: Any) -> Settings:
    """Defaults, then the TOML file named by GATEWAY_CONFIG, then env vars, then overrides.

    Pools' ``api_key_env`` variables are read from ``env`` (a pool whose variable is not
    set there has no key: see ``_pool``); ``resolve_keys=False`` reads none.  The result
    records where it came from in ``config_source``."""
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    path = env.get("GATEWAY_CONFIG", "")
    if env.get("GATEWAY_SETTINGS_JSON"):
        source = "GATEWAY_SETTINGS_JSON" + (f" (GATEWAY_CONFIG={path} ignored)" if path else "")
        try:
            data = json.loads(env["GATEWAY_SETTINGS_JSON"])
        except json.JSONDecodeError as exc:
            raise ConfigError(f"GATEWAY_SETTINGS_JSON is not valid JSON: {exc}") from None
    elif path:
        source = f"GATEWAY_CONFIG={os.path.abspath(path)}"
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"GATEWAY_CONFIG={path!r}: file not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"GATEWAY_CONFIG={path!r}: invalid TOML: {exc}") from None
    else:
        source = BUILT_IN_DEFAULTS
    if "config_source" in data:
        raise ConfigError("config_source is not a setting: it records where the settings were loaded from")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key == "tiers":
            kwargs["tiers"] = tuple(_build(Tier, t, f"[[tiers]] #{i}") for i, t in enumerate(value))
        elif key == "pools":
            kwargs["pools"] = tuple(_pool(p, f"[[pools]] #{i}", env, resolve_keys) for i, p in enumerate(value))
        elif key == "overload":
            kwargs["overload"] = _overload(value)
        elif key == "circuit":
            kwargs["circuit"] = _build(Circuit, value, "[circuit]") if isinstance(value, Mapping) else value
        else:
            kwargs[key] = value
    for var, (name, conv) in ENV_SETTINGS.items():
        if env.get(var):
            try:
                kwargs[name] = conv(env[var])
            except ValueError as exc:
                why = f" ({exc})" if conv is boolean else ""   # int()'s and float()'s own words add nothing
                raise ConfigError(f"{var}={env[var]!r} is not a valid {conv.__name__}{why}") from None
    pools_json = env.get("GATEWAY_POOLS_JSON")
    if pools_json:
        try:
            raw = json.loads(pools_json)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"GATEWAY_POOLS_JSON is not valid JSON: {exc}") from None
        kwargs["pools"] = tuple(_pool(p, f"GATEWAY_POOLS_JSON[{i}]", env, resolve_keys)
                                for i, p in enumerate(raw))
        source += ", pools from GATEWAY_POOLS_JSON"
    if overrides:
        source += f", overridden in code: {', '.join(sorted(overrides))}"
    kwargs.update(overrides)
    allowed = {f.name for f in fields(Settings)} - {"config_source"}
    unknown = set(kwargs) - allowed
    if unknown:
        raise ConfigError(f"unknown settings {sorted(unknown)}; allowed: {sorted(allowed)}")
    return Settings(**kwargs, config_source=source).validate()


BUILT_IN_DEFAULTS = "built-in defaults (GATEWAY_CONFIG is unset)"


def settings_to_json(settings: Settings) -> str:
    """The settings as JSON (same shape as the TOML file); load with GATEWAY_SETTINGS_JSON."""
    data = asdict(settings)
    del data["config_source"]   # where these came from; the loader of the JSON records its own
    return json.dumps(data)


@lru_cache(maxsize=32)
def settings_from_json(text: str) -> Settings:
    """Parse settings_to_json() output (cached: workers look this up per task).  Inline keys
    stay as they are; no ``api_key_env`` variable is read -- the public view in the broker's
    transport options is parsed with this, and a process that calls the upstream uses its own
    settings, loaded from its own environment."""
    return load_settings(env={"GATEWAY_SETTINGS_JSON": text}, resolve_keys=False)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (loaded once from the environment)."""
    return load_settings()
