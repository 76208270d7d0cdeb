"""What the simulator answers: the ``chat.completion`` document (filler text
of the simulated length) and OpenAI's error document for an ApiError."""

from __future__ import annotations

import math
import time
from typing import Any

from gateway_tasks.core.errors import ApiError
from gateway_tasks.devtools.simulator.config import SimConfig
from gateway_tasks.devtools.simulator.request import ChatRequest

FILLER_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing",
                "elit", "sed", "do", "eiusmod", "tempor", "incididunt", "ut", "labore",
                "et", "dolore", "magna", "aliqua")


def completion_tokens_for(request: ChatRequest, config: SimConfig) -> int:
    """How many tokens the simulated reply has (never more than max_tokens)."""
    if request.forced_completion_tokens is not None:
        return min(request.forced_completion_tokens, request.max_tokens)
    return min(request.max_tokens,
               max(1, math.ceil(request.max_tokens * config.completion_fraction)))


def filler_text(n_words: int) -> str:
    return " ".join(FILLER_WORDS[i % len(FILLER_WORDS)] for i in range(n_words))


def chat_completion(chat: ChatRequest, completion_tokens: int, request_id: str,
                    reply_text: str = "") -> dict[str, Any]:
    """The ``chat.completion`` body of a reply of ``completion_tokens`` tokens (its text
    ``reply_text`` when given, e.g. a marker a test looks for, else filler words)."""
    finish = "length" if completion_tokens == chat.max_tokens else "stop"
    return {
        "id": f"chatcmpl-sim{request_id[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": reply_text or filler_text(completion_tokens),
                        "refusal": None},
            "logprobs": None,
            "finish_reason": finish,
        }],
        "usage": {"prompt_tokens": chat.prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": chat.prompt_tokens + completion_tokens},
        "system_fingerprint": "fp_simulator",
    }


def error_body(exc: ApiError) -> dict[str, Any]:
    """OpenAI's error document for ``exc``: ``code`` and ``param`` come from its extras."""
    return {"error": {"message": exc.message, "type": exc.type,
                      "param": exc.extra.get("param"), "code": exc.extra.get("code")}}
