"""The tenant-cron scripts as typed calls (``gateway_tasks.core.scripts.ScriptCall``):
lua/beat/cron_fire.lua settles one (entry, nominal time), lua/beat/cron_admitted.lua counts a
claimed run once its tenant's hourly quota answered, lua/beat/cron_resync.lua moves a due
entry to the time its hash says, lua/beat/cron_record.lua stores a run's outcome.

Settling one due entry, whichever script did it, ends in a ``CronOutcome``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import layout, text
from gateway_tasks.core.stats import CRON_DUPLICATE, CRON_FIRED
from gateway_tasks.tenants.quota import QuotaTakeCall

# cron_fire.lua's action argument: beat.schedule.FIRE, ORPHAN or the reason to skip
ORPHAN = "orphan"      # a due member without its hash: only drop the member

# outcomes that are not counted in Keys.cron_stats
CLAIMED = "claimed"    # settled for a fire: its tenant's hourly quota is taken next
MOVED = "moved"        # another process settled the entry (or it was updated) meanwhile
GONE = "gone"          # the entry no longer exists
RESYNCED = "resynced"  # the due score disagreed with the hash and was moved to it


@dataclass(frozen=True)
class CronOutcome:
    status: str             # claimed, duplicate, a skip reason, moved, gone, resynced
    payload_json: str = ""  # the entry's payload when claimed


@dataclass(frozen=True)
class EntryCall:
    """A script call on one cron entry."""

    keys: Keys
    entry_id: str


@dataclass(frozen=True)
class CronFireCall(EntryCall):
    """Claim or skip one (entry, nominal time), at most once, and reschedule the entry (the
    beat's slot).  A claimed run's hourly quota is then taken in its tenant's slot: ``quota``."""

    SCRIPT: ClassVar[str] = "beat/cron_fire"

    tenant_id: str
    planned_score_ms: int       # the due score the plan was made from
    nominal_ms: int             # the nominal time settled
    next_nominal_ms: int
    next_fire_ms: int           # the new due score
    action: str                 # FIRE, ORPHAN or the reason to skip (misfire, unknown_tenant, ...)
    max_per_hour: int           # the tier's hourly quota (``quota``'s, not the script's)
    now_ms: int
    idempotency_ttl_ms: int
    tier: str                   # stored for listing
    next_jitter_offset_s: int   # stored for listing

    @classmethod
    def orphan(cls, keys: Keys, entry_id: str, planned_score_ms: int, now_ms: int) -> "CronFireCall":
        """Drop a due member whose hash is gone (the script checks again)."""
        return cls(keys, entry_id, tenant_id="-", planned_score_ms=planned_score_ms, nominal_ms=0,
                   next_nominal_ms=0, next_fire_ms=0, action=ORPHAN, max_per_hour=0, now_ms=now_ms,
                   idempotency_ttl_ms=1, tier="", next_jitter_offset_s=0)

    @property
    def script_keys(self) -> list[str]:
        k, eid = self.keys, self.entry_id
        return layout(self.SCRIPT).keys(due=k.cron_due, entry=k.cron(eid), fired=k.cron_fired(eid, self.nominal_ms),
                                        stats=k.cron_stats, payload=k.cron_payload(eid))

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(
            entry_id=self.entry_id, planned_score_ms=self.planned_score_ms, nominal_ms=self.nominal_ms,
            next_nominal_ms=self.next_nominal_ms, next_fire_ms=self.next_fire_ms, action=self.action,
            now_ms=self.now_ms, idempotency_ttl_ms=self.idempotency_ttl_ms, tier=self.tier,
            jitter_offset_s=self.next_jitter_offset_s, duplicate_outcome=CRON_DUPLICATE)

    def parse(self, reply: Any) -> CronOutcome:
        status, payload = reply
        return CronOutcome(text(status), text(payload))

    def quota(self) -> QuotaTakeCall:
        """The claimed run's task of the hour, taken in its tenant's counter (the one every
        submit counts in; the hour named from the beat's clock, as the claim's)."""
        return QuotaTakeCall(self.keys, self.tenant_id, self.now_ms, self.max_per_hour, 0, 0)


@dataclass(frozen=True)
class CronAdmittedCall(EntryCall):
    """A claimed run counted once its quota answered: fired, or skipped for the quota."""

    SCRIPT: ClassVar[str] = "beat/cron_admitted"

    status: str                 # CRON_FIRED | CRON_QUOTA
    nominal_ms: int
    now_ms: int

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(entry=self.keys.cron(self.entry_id), stats=self.keys.cron_stats)

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(status=self.status, nominal_ms=self.nominal_ms, now_ms=self.now_ms,
                                        fired_outcome=CRON_FIRED)

    def parse(self, reply: Any) -> bool:
        """False: the entry is gone (the stats counted it)."""
        return bool(reply)


@dataclass(frozen=True)
class CronResyncCall(EntryCall):
    """Move a due entry to the fire time its hash says, if its score is still the one read."""

    SCRIPT: ClassVar[str] = "beat/cron_resync"

    read_score_ms: int
    new_score_ms: int

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(due=self.keys.cron_due)

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(entry_id=self.entry_id, read_score_ms=self.read_score_ms,
                                        new_score_ms=self.new_score_ms)

    def parse(self, reply: Any) -> CronOutcome:
        return CronOutcome(RESYNCED if reply else MOVED)


@dataclass(frozen=True)
class CronRecordCall(EntryCall):
    """Store a run's outcome on its entry, unless the entry was deleted meanwhile."""

    SCRIPT: ClassVar[str] = "beat/cron_record"

    last_error: str | None = None     # "" = none; None: left as it is
    last_task_id: str | None = None   # None: left as it is
    last_status: str | None = None    # None: left as cron_fire.lua / cron_admitted.lua set it
    retry_at_ms: int | None = None    # a deferred run's retry time, 0 = none pending; None: left

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(entry=self.keys.cron(self.entry_id))

    @property
    def script_args(self) -> list[str]:
        retry = None if self.retry_at_ms is None else str(self.retry_at_ms)
        fields = (("last_status", self.last_status), ("last_task_id", self.last_task_id),
                  ("last_error", self.last_error), ("retry_at_ms", retry))
        return layout(self.SCRIPT).args(
            fields=[item for name, value in fields if value is not None for item in (name, value)])

    def parse(self, reply: Any) -> bool:
        """False: the entry is gone, nothing was written."""
        return bool(reply)
