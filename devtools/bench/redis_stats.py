"""What a Redis server says it spent, for the dispatch benchmark: INFO commandstats
(calls and microseconds per command), INFO cpu (the process's CPU seconds), and
the slowlog at threshold 0 -- every top-level command with its duration and
arguments, so EVALSHA's time can be split by script and PUBLISH's by channel.

On Redis 7 the commands a script runs (``redis.call``) are counted in
commandstats and logged in the slowlog too, as client ``?:0``; the EVALSHA
that ran them already includes their time.  ``top_level`` drops them, so sums
never count a microsecond twice.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import redis

SCRIPT_CLIENT = "?:0"          # the slowlog's client address of commands run by a script
SLOWLOG_MAX_LEN = 1_000_000    # entries kept while a breakdown is recorded


@dataclass(frozen=True)
class Cost:
    """Calls of a command and the microseconds Redis spent executing them."""

    calls: int = 0
    usec: int = 0

    @property
    def us_per_call(self) -> float | None:
        return round(self.usec / self.calls, 2) if self.calls else None

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.calls + other.calls, self.usec + other.usec)

    def __sub__(self, other: "Cost") -> "Cost":
        return Cost(self.calls - other.calls, self.usec - other.usec)


def commandstats(client: redis.Redis) -> dict[str, Cost]:
    """INFO commandstats as {command: Cost} (lower-case names, 'config|set' for sub-commands)."""
    out = {}
    for key, value in client.info("commandstats").items():
        if isinstance(value, dict):
            out[key.removeprefix("cmdstat_")] = Cost(int(value["calls"]), int(value["usec"]))
    return out


def stats_delta(before: Mapping[str, Cost], after: Mapping[str, Cost]) -> dict[str, Cost]:
    """What every command cost between two commandstats snapshots (unchanged ones left out)."""
    out = {}
    for name, cost in after.items():
        grown = cost - before.get(name, Cost())
        if grown.calls or grown.usec:
            out[name] = grown
    return out


def cpu_s(client: redis.Redis) -> float:
    """The server process's CPU seconds so far (INFO cpu: used_cpu_sys + used_cpu_user)."""
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def reads_processed(client: redis.Redis) -> int:
    """Read events the server handled so far (INFO stats total_reads_processed, Redis 6+):
    one per client round trip -- a pipeline is one -- whatever it carried (0 when not told)."""
    return int(client.info("stats").get("total_reads_processed", 0))


@dataclass(frozen=True)
class Point:
    """One moment of a server: its CPU seconds, its commandstats and its read events."""

    cpu_s: float
    commands: dict[str, Cost]
    reads: int = 0


def point(client: redis.Redis) -> Point:
    return Point(cpu_s(client), commandstats(client), reads_processed(client))


# -- the slowlog, as a per-command recorder ------------------------------------------
@contextlib.contextmanager
def recording(client: redis.Redis) -> Iterator[None]:
    """Log every command (slowlog threshold 0) for the block; the old settings come back."""
    old = client.config_get("slowlog-*")
    client.config_set("slowlog-max-len", SLOWLOG_MAX_LEN)
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    try:
        yield
    finally:
        client.config_set("slowlog-log-slower-than", old.get("slowlog-log-slower-than", 10000))
        client.config_set("slowlog-max-len", old.get("slowlog-max-len", 128))


def slowlog_entries(client: redis.Redis) -> list[dict[str, Any]]:
    """Every entry logged (the whole slowlog), oldest first, then it is reset."""
    entries = client.slowlog_get(SLOWLOG_MAX_LEN)
    client.slowlog_reset()
    return list(reversed(entries))


def is_script_call(entry: Mapping[str, Any]) -> bool:
    """Whether a slowlog entry is a command a script ran (not one a client sent)."""
    return _text(entry.get("client_address")) == SCRIPT_CLIENT


def top_level(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of commands clients sent (not those a script ran)."""
    return [e for e in entries if not is_script_call(e)]


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")


def entry_words(entry: Mapping[str, Any]) -> list[str]:
    """A slowlog entry's command and arguments as text (long ones are cut by Redis)."""
    return _text(entry.get("command")).split(" ")
