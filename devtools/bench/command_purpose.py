"""What a Redis command of a Celery/gateway deployment is for, from its words:
EVALSHA by script, PUBLISH by channel (task events, results, control), other
commands by the key they touch (result backend, bell, queue, kombu's unacked
records...).  The dispatch benchmark groups the slowlog by these labels to say
where Redis time goes per task.

EVALSHA durations in a recorded run include the slowlog's own cost of logging
every command the script ran (Redis 7 logs those too, just before the
EVALSHA).  ``evalsha_by_script`` counts them per script, and ``calibrated``
takes one constant per logged command off, fitted so the scripts' total equals
the EVALSHA time of a run without the slowlog (``cmdstat_evalsha``)."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from devtools.bench.redis_stats import Cost, entry_words, is_script_call

# (substring of a key or channel, what it is), first match wins
KEY_PURPOSES = (
    ("celeryev", "task events"),
    ("celery-task-meta", "result backend"),
    ("pidbox", "worker control"),
    ("task-owner", "task owner"),
    ("unacked", "kombu unacked"),
    ("_kombu.binding", "kombu bindings"),
    ("}:bell", "bell"),
    ("}:", "pool state"),
)
QUEUE_COMMANDS = {"lpush", "rpush", "rpop", "brpop", "lpop", "blpop", "llen"}


def key_purpose(key: str) -> str | None:
    for part, purpose in KEY_PURPOSES:
        if part in key:
            return purpose
    return None


def purpose(words: Sequence[str], scripts: Mapping[str, str]) -> str:
    """A label such as 'evalsha pick', 'publish: task events', 'set: result backend'.

    ``scripts`` maps a script's SHA1 to its name."""
    if not words or not words[0]:
        return "?"
    cmd = words[0].lower()
    if cmd == "evalsha":
        return f"evalsha {scripts.get(words[1], '?') if len(words) > 1 else '?'}"
    if cmd in ("multi", "exec"):
        return "multi/exec"
    if len(words) < 2:
        return cmd
    found = key_purpose(words[1])
    if found is None and cmd in QUEUE_COMMANDS:
        found = "queue"
    return f"{cmd}: {found}" if found else cmd


def breakdown(entries: Iterable[Mapping], scripts: Mapping[str, str]) -> dict[str, Cost]:
    """Slowlog entries grouped by purpose: calls and microseconds of each."""
    out: dict[str, Cost] = {}
    for entry in entries:
        label = purpose(entry_words(entry), scripts)
        out[label] = out.get(label, Cost()) + Cost(1, int(entry.get("duration", 0)))
    return out


def evalsha_by_script(entries: Iterable[Mapping], scripts: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Per script: EVALSHA calls, their logged microseconds, and how many commands they ran.
    ``entries`` in the order Redis logged them (oldest first), script calls included."""
    out: dict[str, dict[str, int]] = {}
    ran = 0
    for entry in entries:
        if is_script_call(entry):
            ran += 1
            continue
        words = entry_words(entry)
        if words[0].lower() == "evalsha":
            row = out.setdefault(scripts.get(words[1], "?") if len(words) > 1 else "?",
                                 {"calls": 0, "usec": 0, "ran": 0})
            row["calls"] += 1
            row["usec"] += int(entry.get("duration", 0))
            row["ran"] += ran
        ran = 0
    return out


def calibrated(by_script: Mapping[str, Mapping[str, int]], clean_usec: float) -> tuple[dict[str, Cost], float]:
    """The scripts' EVALSHA time less the slowlog's cost of logging what they ran: one
    constant (returned, microseconds per logged command) fitted to ``clean_usec``."""
    logged = sum(r["usec"] for r in by_script.values())
    ran = sum(r["ran"] for r in by_script.values())
    per_logged_us = max(0.0, (logged - clean_usec) / ran) if ran else 0.0
    return ({name: Cost(r["calls"], max(0, round(r["usec"] - per_logged_us * r["ran"])))
             for name, r in by_script.items()}, per_logged_us)
