"""The wall time of a whole bench command: the last line of every bench report,
so the README can state how long a benchmark really takes."""

from __future__ import annotations

import time


class Stopwatch:
    """Started when made; ``elapsed_s()`` is the wall time since, in seconds."""

    def __init__(self) -> None:
        self.started_s = time.monotonic()

    def elapsed_s(self) -> float:
        return round(time.monotonic() - self.started_s, 1)


def took_line(elapsed_s: float) -> str:
    return f"bench took {elapsed_s:.0f} s"
