"""The tenant-cron loop without Celery: leader election plus due processing.

One ``tick``:

1. not leader: try the lock; still not leader -> sleep a quarter tick interval;
2. leader: renew the lock (lost -> follower again);
3. read the due head of the sorted set (ZRANGEBYSCORE ... LIMIT, up to 8
   chunks at a time, ordered by tier so VIP runs go first), in chunks,
   plan each entry in Python (cron maths, misfire grace, jitter for the next
   run), then settle each through ``cron_fire.lua`` in one pipeline: that
   script atomically checks the idempotency key (SET NX PX) and moves the
   entry to its next fire time, in the beat's slot; each run it claimed then
   takes its tenant's hourly quota (``quota_take.lua``, in the tenant's slot)
   and is counted fired or skipped for the quota (``cron_admitted.lua``);
4. call the fire function for the runs the script admitted -- VIP first, one
   at a time or up to ``fire_concurrency`` at once on a thread pool -- and
   record their task ids (or errors) on the entries;
5. return the seconds until the next due entry, capped at half a tick interval
   (the lock's TTL is 1.5 ticks: ``beat.lock`` gives the timing).

A run the load level deferred (``Deferred`` from the submit: overload refuses its
tier's new work) is tried again after the error's ``retry_after_s`` when that
comes before the entry's next run (``beat.schedule.deferred_retry_ms``), else
the next run supersedes it.  Retries wait in ``Keys.cron_retry``; each tick
first claims the due ones (ZREM: one process gets each) and fires them with
the same idempotency key -- the hourly quota was counted at the first try.

Runs are at most once per (entry, nominal time): they are settled before the
fire function is called, so a crash between the two loses that run rather
than repeating it.  The lock makes one process active; the idempotency key and
the score check keep runs single even if two processes process the same due
entries (a paused leader whose lock lapsed, tests calling run_due directly).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import redis

from gateway_tasks.core.errors import ConfigError, Deferred
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Settings
from gateway_tasks.core.stats import (CRON_DEFERRED, CRON_FIRE_ERROR, CRON_FIRED, CRON_MISFIRE, CRON_QUOTA,
                                      CRON_RETRIED, CRON_SUPERSEDED, CRON_UNKNOWN_TENANT, CRON_UNKNOWN_TIER)

from beat.cron_calls import CLAIMED, CronAdmittedCall, CronFireCall, CronOutcome, CronRecordCall, CronResyncCall
from beat.entry import CronEntry
from beat.fire import FireFn, gateway_fire, task_id_of
from beat.jitter import jitter_offset_s
from beat.lock import BeatLock, follower_retry_s, leader_renew_s, lock_ttl_ms
from beat.schedule import FIRE, MISFIRE_GRACE_S, NOT_DUE, actual_ms, deferred_retry_ms, iso_utc, plan_fire
from beat.store import CronStore, Due

log = logging.getLogger(__name__)

DEFAULT_TICK_INTERVAL_S = 1.0
DEFAULT_BATCH_SIZE = 500
PRIORITY_CHUNKS = 8           # due entries ordered by tier are read this many chunks at a time
DEFAULT_FIRE_CONCURRENCY = 1   # fire calls in flight at once (gateway_beat_fire_concurrency)
QUARANTINE_S = 60          # an entry that cannot be planned is retried this much later
PLAN_ERROR = "error"       # the status of an entry that cannot be planned


@dataclass(frozen=True)
class CronRow:
    """The fields of a due entry's hash that planning reads (None: missing)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("tenant_id", "task_id", "cron", "period_s",
                                         "jitter_offset_s", "next_nominal_ms", "tier", "run_secret",
                                         "tenant_gen")

    tenant_id: str | None
    task_id: str | None
    cron: str | None
    period_s: str | None
    jitter_offset_s: str | None
    next_nominal_ms: str | None
    tier: str | None
    run_secret: str | None = None
    tenant_gen: str | None = None

    @classmethod
    def from_reply(cls, values: list[bytes | None]) -> "CronRow":
        """From ``HMGET key *FIELDS``."""
        return cls(*(v.decode() if v is not None else None for v in values))


@dataclass(frozen=True)
class Planned:
    """One due entry and the script call that settles it."""

    due: Due
    row: CronRow
    call: CronFireCall | CronResyncCall


@dataclass(frozen=True)
class Run:
    """One run to fire: a due entry cron_fire.lua claimed within its quota, or a deferred run tried again."""

    entry_id: str
    entry: CronEntry         # with the run's tier and jitter window
    nominal_ms: int
    scheduled_ms: int        # the actual (jittered) time it was due at
    next_fire_ms: int        # the entry's next due time: a retry must come before it
    retry: bool = False      # a deferred run tried again

    @property
    def member(self) -> str:
        """Its member in ``Keys.cron_retry``."""
        return retry_member(self.entry_id, self.nominal_ms)


def retry_member(entry_id: str, nominal_ms: int) -> str:
    return f"{entry_id}|{nominal_ms}"


def parse_retry_member(member: bytes | str) -> tuple[str, int] | None:
    """'<entry id>|<nominal ms>' -> (entry id, nominal ms); None when malformed."""
    text = member.decode() if isinstance(member, bytes) else member
    entry_id, sep, nominal = text.rpartition("|")
    if not sep or not entry_id or not nominal.isdigit():
        return None
    return entry_id, int(nominal)


@dataclass(frozen=True)
class Fired:
    """What firing a run left to write: its record (a deferred run's retry time in it) and
    the ``Keys.cron_stats`` counters it adds."""

    record: CronRecordCall
    counted: tuple[str, ...] = ()


@dataclass
class FiredRun:
    entry_id: str
    tier: str
    nominal_ms: int
    scheduled_ms: int        # the actual (jittered) time it was due at
    task_id: str | None
    done_s: float            # seconds after the start of run_due when the fire call returned
    error: str | None = None


@dataclass
class TickReport:
    now_ms: int
    leader: bool
    statuses: Counter = field(default_factory=Counter)
    fired: list[FiredRun] = field(default_factory=list)
    due_seen: int = 0
    more_due: bool = False
    lost_leadership: bool = False
    next_fire_ms: int | None = None
    delay_s: float = 0.0
    duration_s: float = 0.0

    @property
    def fired_count(self) -> int:
        return self.statuses.get(CRON_FIRED, 0)


class CronEngine:
    def __init__(self, client: redis.Redis, settings: Settings, fire: FireFn | None = None, *,
                 clock: Callable[[], float] = time.time,
                 tick_interval_s: float = DEFAULT_TICK_INTERVAL_S,
                 misfire_grace_s: int = MISFIRE_GRACE_S,
                 batch_size: int = DEFAULT_BATCH_SIZE,
                 idempotency_ttl_s: int | None = None,
                 token: str | None = None,
                 fire_concurrency: int = DEFAULT_FIRE_CONCURRENCY):
        if tick_interval_s <= 0:
            raise ConfigError(f"beat tick_interval_s={tick_interval_s!r} is invalid; expected > 0")
        if batch_size <= 0:
            raise ConfigError(f"beat batch_size={batch_size!r} is invalid; expected > 0")
        if fire_concurrency < 1:
            raise ConfigError(f"beat fire_concurrency={fire_concurrency!r} is invalid; expected >= 1")
        if misfire_grace_s < 0:
            raise ConfigError(f"beat misfire_grace_s={misfire_grace_s!r} is invalid; expected >= 0")
        max_window_s = max(t.jitter_window_s for t in settings.tiers)
        # A settled (entry, nominal) must stay marked for as long as a stale plan
        # could still reach it: its actual time is at most max_window_s after the
        # nominal one, and it is retried for misfire_grace_s after that.
        floor_s = max_window_s + misfire_grace_s
        if idempotency_ttl_s is None:
            idempotency_ttl_s = max(3600, 2 * floor_s)
        if idempotency_ttl_s <= floor_s:
            raise ConfigError(f"beat idempotency_ttl_s={idempotency_ttl_s} is too short; expected > "
                              f"largest jitter window + misfire grace = {floor_s}")
        self.r = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.store = CronStore(client, settings)
        self.fire = fire if fire is not None else gateway_fire(settings)
        self.clock = clock
        self.tick_interval_s = float(tick_interval_s)
        self.misfire_grace_s = int(misfire_grace_s)
        self.batch_size = int(batch_size)
        self.idempotency_ttl_ms = int(idempotency_ttl_s * 1000)
        self.lock = BeatLock(client, self.keys.beat_lock, ttl_ms=lock_ttl_ms(self.tick_interval_s),
                             token=token)
        self.scripts = scripts_for(client)
        self.fire_concurrency = int(fire_concurrency)
        self._pool: ThreadPoolExecutor | None = None
        self._report_lock = threading.Lock()

    # -- the loop --------------------------------------------------------------
    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    @property
    def is_leader(self) -> bool:
        return self.lock.held

    def tick(self, now_ms: int | None = None) -> TickReport:
        """One scheduler iteration; ``report.delay_s`` is how long to sleep."""
        now = self.now_ms() if now_ms is None else now_ms
        was_leader = self.lock.held
        leader = self.lock.renew() if was_leader else self.lock.acquire()
        if leader != was_leader:
            log.info("beat: %s the tenant-cron leader lock (%s)",
                     "took" if leader else "lost", self.lock.token)
        if not leader:
            return TickReport(now, leader=False, delay_s=follower_retry_s(self.tick_interval_s))
        report = self.run_due(now, budget_s=self.tick_interval_s, keep_leading=self.lock.renew)
        if report.statuses:
            log.info("beat: tenant crons %s in %.1f ms", dict(report.statuses),
                     report.duration_s * 1000)
        if report.more_due:
            report.delay_s = 0.0
        else:
            report.next_fire_ms = self.store.next_fire_ms()
            renew_s = leader_renew_s(self.tick_interval_s)
            if report.next_fire_ms is None:
                report.delay_s = renew_s
            else:
                after = self.now_ms() if now_ms is None else now
                report.delay_s = min(renew_s,
                                     max(0.0, (report.next_fire_ms - after) / 1000.0))
        return report

    def run_due(self, now_ms: int, budget_s: float | None = None,
                keep_leading: Callable[[], bool] | None = None) -> TickReport:
        """Settle every entry due at ``now_ms`` (chunks of batch_size).

        Stops early when ``budget_s`` of wall time is used (``more_due``) or when
        ``keep_leading()`` -- called before every chunk after the first -- says
        the lock was lost.
        """
        report = TickReport(now_ms, leader=True)
        start = time.monotonic()
        self._retry_due(now_ms, report, start, keep_leading)
        first = True
        stop = False
        while not stop:
            window = self._by_tier(self.store.due(now_ms, self.batch_size * PRIORITY_CHUNKS))
            if not window:
                break
            for i in range(0, len(window), self.batch_size):
                batch = window[i:i + self.batch_size]
                if not first and keep_leading is not None and not keep_leading():
                    report.lost_leadership = True
                    report.leader = False
                    stop = True
                    break
                first = False
                report.due_seen += len(batch)
                self._process(batch, now_ms, report, start, keep_leading)
                if budget_s is not None and time.monotonic() - start >= budget_s:
                    report.more_due = bool(self.store.due(now_ms, 1))
                    stop = True
                    break
        report.duration_s = time.monotonic() - start
        return report

    def _by_tier(self, due: list[Due]) -> list[Due]:
        """Due entries in tier order (vip first), due order within a tier: when a storm
        makes many runs due at once, the tiers without jitter go out first."""
        if len(due) <= 1:
            return due
        with self.r.pipeline(transaction=False) as pipe:
            for d in due:
                pipe.hget(self.keys.cron(d.entry_id), "tier")
            tiers = pipe.execute()
        rank: dict[str, int] = {}
        for i, t in enumerate(self.settings.tiers):
            for name in (t.name, *t.aliases):
                rank[name] = i
        last = len(self.settings.tiers)
        order = sorted(range(len(due)),
                       key=lambda i: rank.get(tiers[i].decode() if tiers[i] else "", last))
        return [due[i] for i in order]

    def close(self) -> None:
        """Release the lock if held (a follower takes over at its next tick)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.lock.held:
            try:
                self.lock.release()
            except redis.RedisError:
                log.warning("beat: could not release the leader lock", exc_info=True)

    # -- one chunk ---------------------------------------------------------------
    def _process(self, batch: list[Due], now_ms: int, report: TickReport,
                 start: float, keep_leading: Callable[[], bool] | None = None) -> None:
        rows = self._load_rows(batch)
        current_tier = self._current_tiers(rows)
        planned: list[Planned] = []
        positions: list[int] = []        # of each planned call's reply in the pipeline
        with self.r.pipeline(transaction=False) as pipe:
            for due, row in zip(batch, rows):
                step = self._plan(due, row, current_tier, now_ms, pipe, report)
                if step is None:
                    continue
                positions.append(len(pipe))
                self.scripts.queue(step.call, pipe)
                planned.append(step)
            results = pipe.execute()

        for row in rows:      # a generation that ended: its crons go (skipped above, not fired)
            if row.tenant_gen and f"{row.tenant_id}/{row.tenant_gen}" in current_tier:
                self.store.delete(row.tenant_id, row.task_id)  # type: ignore[arg-type]
        claimed: list[tuple[Planned, CronFireCall, CronOutcome]] = []
        for step, position in zip(planned, positions):
            outcome = step.call.parse(results[position])
            if outcome.status == CLAIMED and isinstance(step.call, CronFireCall):
                claimed.append((step, step.call, outcome))
            else:
                report.statuses[outcome.status] += 1
        runs: list[Run] = []
        for (step, call, outcome), status in zip(claimed, self._take_quotas([c for _, c, _ in claimed], now_ms)):
            report.statuses[status] += 1
            if status == CRON_FIRED:
                entry = self._entry(step.row, step.due.fire_ms, outcome.payload_json)
                entry.tier = call.tier
                entry.window_s = self._window_s(call.tier)
                runs.append(Run(step.due.entry_id, entry, call.nominal_ms, step.due.fire_ms,
                                call.next_fire_ms))
        self._fire_and_record(runs, report, start, keep_leading)

    def _take_quotas(self, claimed: list[CronFireCall], now_ms: int) -> list[str]:
        """The claimed runs' tasks of the hour, each taken in its tenant's slot (one round trip),
        then each run counted in the beat's (one more): CRON_FIRED (to fire) or CRON_QUOTA (the
        tenant's hourly quota is spent: skipped), per run.  A crash between the claim and the
        fire loses the run, never repeats it (its idempotency key is set)."""
        if not claimed:
            return []
        taken, _ = self.scripts.run_together([call.quota() for call in claimed])
        statuses = [CRON_FIRED if t.ok else CRON_QUOTA for t in taken]
        self.scripts.run_together([CronAdmittedCall(self.keys, call.entry_id, status, call.nominal_ms, now_ms)
                                   for call, status in zip(claimed, statuses)])
        return statuses

    def _fire_and_record(self, runs: list[Run], report: TickReport, start: float,
                         keep_leading: Callable[[], bool] | None) -> None:
        """Fire runs due together in tier order (vip first), then in due order; write their
        records, the deferred ones' retries and the outcome counters in one pipeline."""
        rank = {t.name: i for i, t in enumerate(self.settings.tiers)}
        runs = sorted(runs, key=lambda run: rank.get(run.entry.tier, len(rank)))
        fired = self._fire_all(runs, report, start, keep_leading)
        if not fired:
            return
        with self.r.pipeline(transaction=False) as pipe:
            for run, done in zip(runs, fired):
                self.scripts.queue(done.record, pipe)
                if done.record.retry_at_ms:
                    pipe.zadd(self.keys.cron_retry, {run.member: done.record.retry_at_ms})
            for status, n in Counter(c for done in fired for c in done.counted).items():
                pipe.hincrby(self.keys.cron_stats, status, n)
            pipe.execute()

    # -- deferred runs, tried again ----------------------------------------------
    def _retry_due(self, now_ms: int, report: TickReport, start: float,
                   keep_leading: Callable[[], bool] | None) -> None:
        """Fire the deferred runs whose retry time has come (up to batch_size a tick).
        Each is claimed with ZREM first, so one process fires it; one whose entry's next
        run is due by now (or whose entry, tenant or tier is gone) is superseded."""
        members = self.r.zrangebyscore(self.keys.cron_retry, "-inf", now_ms, start=0, num=self.batch_size)
        if not members:
            return
        with self.r.pipeline(transaction=False) as pipe:
            for m in members:
                pipe.zrem(self.keys.cron_retry, m)
            claimed = [m for m, n in zip(members, pipe.execute()) if n]
        parsed = [p for p in (parse_retry_member(m) for m in claimed) if p is not None]
        dropped = len(claimed) - len(parsed)   # malformed members: superseded too
        with self.r.pipeline(transaction=False) as pipe:
            for eid, _ in parsed:
                pipe.hmget(self.keys.cron(eid), CronRow.FIELDS)
                pipe.get(self.keys.cron_payload(eid))
                pipe.zscore(self.keys.cron_due, eid)
            raw = pipe.execute()
        rows = [CronRow.from_reply(raw[3 * i]) for i in range(len(parsed))]
        current_tier = self._current_tiers(rows)
        runs: list[Run] = []
        superseded: list[str] = []   # entries still there whose retry is dropped
        for i, ((eid, nominal), row) in enumerate(zip(parsed, rows)):
            payload, next_fire = raw[3 * i + 1], raw[3 * i + 2]
            tier = self._tier_of(current_tier, row)
            run = None
            if (row.tenant_id is not None and row.cron is not None and payload is not None
                    and next_fire is not None and now_ms < int(next_fire) and tier is not None):
                try:
                    entry = self._entry(row, int(next_fire), payload.decode())
                    entry.tier = self.settings.tier(tier).name
                except (ConfigError, ValueError, TypeError):
                    entry = None
                if entry is not None:
                    entry.window_s = self._window_s(entry.tier)
                    run = Run(eid, entry, nominal, now_ms, int(next_fire), retry=True)
            if run is None:
                superseded.append(eid)
                log.info("beat: deferred cron run %s (nominal %s) not tried again: its next run "
                         "is due, or the entry, its tenant or its tier is gone", eid, iso_utc(nominal))
            else:
                runs.append(run)
        if superseded or dropped:
            report.statuses[CRON_SUPERSEDED] += len(superseded) + dropped
            with self.r.pipeline(transaction=False) as pipe:
                pipe.hincrby(self.keys.cron_stats, CRON_SUPERSEDED, len(superseded) + dropped)
                for eid in superseded:   # (cron_record.lua writes nothing on a deleted entry)
                    self.scripts.queue(CronRecordCall(self.keys, eid, last_status=CRON_SUPERSEDED,
                                                      retry_at_ms=0), pipe)
                pipe.execute()
        self._fire_and_record(runs, report, start, keep_leading)

    def _load_rows(self, batch: list[Due]) -> list[CronRow]:
        with self.r.pipeline(transaction=False) as pipe:
            for due in batch:
                pipe.hmget(self.keys.cron(due.entry_id), CronRow.FIELDS)
            return [CronRow.from_reply(raw) for raw in pipe.execute()]

    def _current_tiers(self, rows: list[CronRow]) -> dict[str, str | None]:
        """Tenant id -> its tier now (None: no longer registered).  A row registered by a
        tenant generation that ended (the tenant deleted, perhaps registered again) is
        keyed '<tenant>/<row's gen>' -> None: skipped, then deleted (``_process``)."""
        tenant_ids = sorted({row.tenant_id for row in rows if row.tenant_id})
        with self.r.pipeline(transaction=False) as pipe:
            for tenant in tenant_ids:
                pipe.hmget(self.keys.tenant(tenant), "tier", "gen")
            now = {t: (tier.decode() if tier is not None else None, (gen or b"").decode())
                   for t, (tier, gen) in zip(tenant_ids, pipe.execute())}
        out: dict[str, str | None] = {t: tier for t, (tier, _) in now.items()}
        for row in rows:
            if row.tenant_id in now and row.tenant_gen:
                tier, gen = now[row.tenant_id]
                if tier is None or (gen and row.tenant_gen != gen):
                    out[f"{row.tenant_id}/{row.tenant_gen}"] = None
        return out

    @staticmethod
    def _tier_of(current_tier: dict[str, str | None], row: CronRow) -> str | None:
        if row.tenant_gen and f"{row.tenant_id}/{row.tenant_gen}" in current_tier:
            return None
        return current_tier.get(row.tenant_id or "")

    def _fire_all(self, runs: list[Run], report: TickReport, start: float,
                  keep_leading: Callable[[], bool] | None) -> list[Fired]:
        """Fire the runs, ``fire_concurrency`` at a time, renewing the lock meanwhile; what
        each left to write, in the order of ``runs``.

        The runs are settled already (cron_fire.lua, or claimed from the retries), so they
        are fired even if the lock is lost while they go out."""
        renewed = time.monotonic()

        def renew_if_due() -> None:
            nonlocal renewed
            if keep_leading is not None and time.monotonic() - renewed > leader_renew_s(self.tick_interval_s):
                keep_leading()
                renewed = time.monotonic()

        if self.fire_concurrency <= 1 or len(runs) <= 1:
            out = []
            for run in runs:
                renew_if_due()
                out.append(self._fire(run, report, start))
            return out
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.fire_concurrency,
                                            thread_name_prefix="beat-fire")
        futures = [self._pool.submit(self._fire, run, report, start) for run in runs]
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=self.tick_interval_s / 4, return_when=FIRST_COMPLETED)
            renew_if_due()
        return [f.result() for f in futures]

    def _fire(self, run: Run, report: TickReport, start: float) -> Fired:
        """Call the fire function for a run; the record of its outcome (and, deferred, when
        to try it again: ``beat.schedule.deferred_retry_ms``)."""
        eid, nominal, entry = run.entry_id, run.nominal_ms, run.entry
        task_id, error, status, retry_at = None, None, CRON_FIRE_ERROR, None
        try:
            if not entry.run_secret:
                entry.run_secret = self.store.run_secret(eid)
            task_id = task_id_of(self.fire(entry, nominal))
        except Deferred as exc:
            # overload: the tier's new work is deferred at this load level -- refused by
            # design, not an error; tried again after its retry time unless the next run
            # comes first
            retry_at = deferred_retry_ms(report.now_ms, exc.retry_after_s, run.next_fire_ms)
            then = (f"; tried again at {iso_utc(retry_at)}" if retry_at is not None
                    else "; not tried again: the next run comes first")
            error, status = f"{type(exc).__name__}: {exc}"[:480] + then, CRON_DEFERRED
            log.warning("beat: cron %s (nominal %s) deferred%s: %s", eid, nominal, then, exc)
        except Exception as exc:  # noqa: BLE001 -- one failing submit must not stop beat
            error = f"{type(exc).__name__}: {exc}"[:500]
            log.exception("beat: firing cron %s (nominal %s) failed", eid, nominal)
        if error is None:
            done = Fired(CronRecordCall(self.keys, eid, last_error="", last_task_id=task_id or "",
                                        last_status=CRON_FIRED if run.retry else None, retry_at_ms=0),
                         (CRON_RETRIED,) if run.retry else ())
        else:
            superseded = (CRON_SUPERSEDED,) if status == CRON_DEFERRED and retry_at is None else ()
            done = Fired(CronRecordCall(self.keys, eid, last_error=error, last_task_id="",
                                        last_status=status, retry_at_ms=retry_at or 0),
                         (status, *superseded))
        with self._report_lock:            # _fire may run on the fire threads
            report.statuses.update(done.counted)
            report.fired.append(FiredRun(eid, entry.tier, nominal, run.scheduled_ms, task_id,
                                         time.monotonic() - start, error))
        return done

    def _plan(self, due: Due, row: CronRow, current_tier: dict[str, str | None], now_ms: int,
              pipe: redis.client.Pipeline, report: TickReport) -> Planned | None:
        """The script call that settles a due entry; None after quarantining an
        entry that cannot be planned (its calls are queued on ``pipe``)."""
        keys = self.keys
        eid, score = due
        tenant = row.tenant_id
        if tenant is None or row.cron is None or row.next_nominal_ms is None:
            # A sorted-set member without its hash: drop it (the script re-checks).
            return Planned(due, row, CronFireCall.orphan(keys, eid, score, now_ms))
        try:
            stored_offset = int(row.jitter_offset_s)  # type: ignore[arg-type]
            pending = int(row.next_nominal_ms)
            period_s = int(row.period_s)  # type: ignore[arg-type]
            plan = plan_fire(row.cron, pending, stored_offset, now_ms, self.misfire_grace_s)
        except Exception as exc:  # noqa: BLE001 -- a corrupt entry must not block the others
            log.error("beat: cannot plan cron %s: %s; retrying in %ss", eid, exc, QUARANTINE_S)
            pipe.zadd(keys.cron_due, {eid: now_ms + QUARANTINE_S * 1000}, xx=True)
            self.scripts.queue(CronRecordCall(keys, eid, last_error=f"{type(exc).__name__}: {exc}"[:500],
                                              last_status=PLAN_ERROR), pipe)
            report.statuses[PLAN_ERROR] += 1
            return None
        if plan.action == NOT_DUE:
            # The hash says later than the score we read: usually another process
            # settled the entry meanwhile (then the score moved too: "moved");
            # otherwise the two disagree and the hash wins ("resynced").
            return Planned(due, row, CronResyncCall(keys, eid, read_score_ms=score,
                                                    new_score_ms=actual_ms(pending, stored_offset)))

        action = FIRE if plan.action == FIRE else CRON_MISFIRE
        tier_name = self._tier_of(current_tier, row)
        max_per_hour = 0
        next_offset = stored_offset
        if tier_name is None:
            action, tier_name = CRON_UNKNOWN_TENANT, row.tier or ""
        else:
            try:
                tier = self.settings.tier(tier_name)
            except ConfigError:
                action = CRON_UNKNOWN_TIER
            else:
                tier_name = tier.name
                max_per_hour = tier.max_tasks_per_hour
                # The tenant's tier may have changed since registration: the next
                # run uses the current tier's window (deterministic either way).
                next_offset = jitter_offset_s(tenant, row.task_id, tier.jitter_window_s, period_s)
        return Planned(due, row, CronFireCall(
            keys, eid, tenant, planned_score_ms=score, nominal_ms=plan.nominal_ms,
            next_nominal_ms=plan.next_nominal_ms,
            next_fire_ms=actual_ms(plan.next_nominal_ms, next_offset), action=action,
            max_per_hour=max_per_hour, now_ms=now_ms, idempotency_ttl_ms=self.idempotency_ttl_ms,
            tier=tier_name, next_jitter_offset_s=next_offset))

    def _window_s(self, tier_name: str) -> int:
        try:
            return self.settings.tier(tier_name).jitter_window_s
        except ConfigError:
            return 0

    @staticmethod
    def _entry(row: CronRow, score: int, payload_json: str) -> CronEntry:
        return CronEntry(
            tenant_id=row.tenant_id, task_id=row.task_id, cron=row.cron,  # type: ignore[arg-type]
            payload=json.loads(payload_json) if payload_json else {}, tier=row.tier or "",
            window_s=0, period_s=int(row.period_s),  # type: ignore[arg-type]
            jitter_offset_s=int(row.jitter_offset_s),  # type: ignore[arg-type]
            next_nominal_ms=int(row.next_nominal_ms),  # type: ignore[arg-type]
            next_fire_ms=score, run_secret=row.run_secret or "")
