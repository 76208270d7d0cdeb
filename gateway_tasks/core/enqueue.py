"""lua/enqueue.lua as a typed call: push one Celery message onto its tier queue,
stamped with Redis TIME, unless the queue is full (tail drop); ring the bell."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gateway_tasks.core.bell import BELL_MAX
from gateway_tasks.core.keys import Keys


@dataclass(frozen=True)
class Enqueued:
    accepted: bool            # False: the queue was at its length limit, nothing was pushed
    queue_length: int         # after the push (or when refused)
    enqueued_ms: int | None   # the Redis TIME stamped on the message (None when refused)


@dataclass(frozen=True)
class EnqueueCall:
    SCRIPT: ClassVar[str] = "enqueue"

    keys: Keys
    queue: str              # the Celery queue, gt.<tier>.<pool>
    message_json: str       # the kombu envelope: a JSON object ('{...}')
    queue_max_len: int      # the tier's queue_max_len
    bell_max: int = BELL_MAX

    @property
    def script_keys(self) -> list[str]:
        return [self.keys.queue(self.queue), self.keys.bell]

    @property
    def script_args(self) -> list[str | int]:
        return [self.message_json, self.queue_max_len, self.bell_max]

    def parse(self, reply: Any) -> Enqueued:
        if int(reply[0]) == 0:
            return Enqueued(False, int(reply[1]), None)
        return Enqueued(True, int(reply[2]), int(reply[1]))
