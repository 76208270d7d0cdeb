"""A streaming task's upstream call: the upstream's chunks go to the API
process as they arrive (``gateway_tasks.upstream.chunks``), then 'done' with the usage
the task settles the bucket to.

* Failures before the first chunk are the SDK's errors, handled by the task like
  any call's (a 429 drains the pool and requeues; the API keeps waiting).
* A stream that breaks after chunks were passed on cannot be retried -- the
  client holds part of the answer: 'error' is published and the task fails.
* For the same reason a redelivered task (its worker died mid-stream) whose
  stream already has entries does not call the upstream again: 'error', fail.
"""

from __future__ import annotations

import redis

from gateway_tasks.upstream.chunks import ChunkWriter
from gateway_tasks.core.errors import UpstreamError
from gateway_tasks.core.keys import Keys
from gateway_tasks.dispatch.request import InferenceRequest
from gateway_tasks.core.settings import Pool

from gateway_tasks.upstream.client import StreamBroken, UpstreamReply, chat_stream


def chat_streamed(r: redis.Redis, keys: Keys, req: InferenceRequest, pool: Pool, task_id: str,
                  ttl_s: int) -> UpstreamReply:
    writer = ChunkWriter(r, keys, task_id, ttl_s)
    if writer.started_before():
        message = ("an earlier attempt of this task already streamed part of its answer and was "
                   "lost (worker restart); it is not repeated")
        writer.error("StreamInterrupted", message)
        raise UpstreamError(message)
    try:
        reply = chat_stream(pool, req.model, req.messages, req.max_tokens, req.extra_body,
                            writer.chunk, req.prompt_tokens, task_id)
    except StreamBroken as exc:
        writer.error("UpstreamError", str(exc))
        raise UpstreamError(str(exc)) from None
    writer.done(reply.body.get("usage"))
    return reply
