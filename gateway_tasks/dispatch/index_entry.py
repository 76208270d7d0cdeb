"""The router's index entry of one queued task: small, fixed, never the prompt.

    <tenant>|<seq>|<delivery tag>|<est tokens>|<enqueued ms>|<tenant weight>|<message bytes>

Entries live in one sorted set per tier and pool (``Keys.index``), every score
0, so Redis orders them by their bytes: a tenant's entries form one contiguous
range (tenant ids never contain '|', which sorts after every character they
may contain), in enqueue order inside it (``seq`` is 16 hex digits), its
interactive tasks first: a scheduled task's seq is ``'s'`` + 16 hex digits
(``gateway_tasks.dispatch.lanes``), after every hex digit.  A task put back
(requeue, crash restore) re-enters with its original entry, so it returns to
the front of its tenant's line (of its lane) with its original enqueue time.
The message's size lets lua/dispatch/pick.lua hand a small message back inline without
asking its length first; entries queued before it was recorded (six fields) are
read as well, their size unknown.
lua/dispatch/enqueue.lua builds entries, lua/dispatch/pick.lua and lua/dispatch/release.lua read them;
this module is the same format for Python (tests, tools).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway_tasks.dispatch.lanes import INTERACTIVE, SCHEDULED, SCHEDULED_SEQ_PREFIX

SEP = "|"


@dataclass(frozen=True)
class IndexEntry:
    tenant: str
    seq: int
    tag: str
    est_tokens: int
    enqueued_ms: int
    weight: float
    lane: str = INTERACTIVE
    message_b: int | None = None   # the message's size (None: an entry from before it was kept)

    def encode(self) -> str:
        mark = SCHEDULED_SEQ_PREFIX if self.lane == SCHEDULED else ""
        size = [] if self.message_b is None else [str(self.message_b)]
        return SEP.join([self.tenant, f"{mark}{self.seq:016x}", self.tag, str(self.est_tokens),
                         str(self.enqueued_ms), _num(self.weight), *size])

    @classmethod
    def decode(cls, text: str | bytes) -> "IndexEntry":
        if isinstance(text, bytes):
            text = text.decode()
        tenant, seq, tag, est, enq, weight, *size = text.split(SEP)
        if len(size) > 1:
            raise ValueError(f"an index entry has 6 or 7 fields, not {6 + len(size)}: {text!r}")
        lane = INTERACTIVE
        if seq.startswith(SCHEDULED_SEQ_PREFIX):
            seq, lane = seq[len(SCHEDULED_SEQ_PREFIX):], SCHEDULED
        return cls(tenant, int(seq, 16), tag, int(est), int(enq), float(weight), lane,
                   int(size[0]) if size else None)


def tenant_range(tenant: str) -> tuple[str, str]:
    """ZRANGEBYLEX bounds of one tenant's entries."""
    return f"[{tenant}{SEP}", f"[{tenant}{SEP}\xff"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _est_tokens(entries: list[bytes]) -> list[int]:
    """The estimated tokens of the readable ones of index entries."""
    ests = []
    for raw in entries:
        try:
            ests.append(IndexEntry.decode(raw).est_tokens)
        except (ValueError, UnicodeDecodeError):
            continue
    return ests


def mean_est_tokens(entries: list[bytes]) -> float | None:
    """The mean estimated tokens of index entries (None: none readable)."""
    ests = _est_tokens(entries)
    return sum(ests) / len(ests) if ests else None


def backlog_tokens(entries: list[bytes], depth: int) -> float:
    """Estimated tokens of a queue of ``depth`` tasks from (a sample of) its index entries:
    their sum when the sample is the whole queue, else the sample's mean times the depth."""
    ests = _est_tokens(entries)
    if not ests or depth <= 0:
        return 0.0
    return float(sum(ests)) if len(ests) >= depth else sum(ests) / len(ests) * depth
