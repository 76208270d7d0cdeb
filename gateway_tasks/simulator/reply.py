"""What the simulator answers: the ``chat.completion`` document (filler text
of the simulated length) and OpenAI's error document for an ApiError."""

from __future__ import annotations

import math
import time
from typing import Any

from gateway_tasks.core.errors import ApiError
from gateway_tasks.simulator.config import SimConfig
from gateway_tasks.simulator.request import ChatRequest

FILLER_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing",
                "elit", "sed", "do", "eiusmod", "tempor", "incididunt", "ut", "labore",
                "et", "dolore", "magna", "aliqua")


def completion_tokens_for(request: ChatRequest, config: SimConfig) -> int:
    """How many tokens each choice of the simulated reply has (never more than max_tokens)."""
    if request.forced_completion_tokens is not None:
        return min(request.forced_completion_tokens, request.max_tokens)
    return min(request.max_tokens,
               max(1, math.ceil(request.max_tokens * config.completion_fraction)))


def filler_text(n_words: int) -> str:
    return " ".join(FILLER_WORDS[i % len(FILLER_WORDS)] for i in range(n_words))


def chat_completion(chat: ChatRequest, choice_tokens: int, request_id: str,
                    reply_text: str = "") -> dict[str, Any]:
    """The ``chat.completion`` body of a reply of ``chat.n`` choices of ``choice_tokens`` tokens
    each (its text ``reply_text`` when given, e.g. a marker a test looks for, else filler
    words); the usage counts the completion tokens of all of them."""
    finish = "length" if choice_tokens == chat.max_tokens else "stop"
    completion_tokens = choice_tokens * chat.n
    return {
        "id": f"chatcmpl-sim{request_id[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "choices": [{
            "index": index,
            "message": {"role": "assistant", "content": reply_text or filler_text(choice_tokens),
                        "refusal": None},
            "logprobs": None,
            "finish_reason": finish,
        } for index in range(chat.n)],
        "usage": {"prompt_tokens": chat.prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": chat.prompt_tokens + completion_tokens},
        "system_fingerprint": "fp_simulator",
    }


def error_body(exc: ApiError) -> dict[str, Any]:
    """OpenAI's error document for ``exc``: ``code`` and ``param`` come from its extras."""
    return {"error": {"message": exc.message, "type": exc.type,
                      "param": exc.extra.get("param"), "code": exc.extra.get("code")}}


STREAM_WORDS_PER_CHUNK = 4


def chunk_texts(completion_tokens: int) -> list[str]:
    """The reply's text (one filler word a token) cut into chunks of a few words; joined,
    they are exactly the non-streamed reply's content."""
    words = [FILLER_WORDS[i % len(FILLER_WORDS)] for i in range(completion_tokens)]
    out = []
    for start in range(0, len(words), STREAM_WORDS_PER_CHUNK):
        text = " ".join(words[start:start + STREAM_WORDS_PER_CHUNK])
        out.append(text if start == 0 else " " + text)
    return out


def stream_chunk(chat: ChatRequest, request_id: str, created: int, delta: dict[str, Any],
                 finish_reason: str | None = None, usage: dict[str, int] | None = None,
                 with_choice: bool = True, index: int = 0) -> dict[str, Any]:
    """One ``chat.completion.chunk`` (OpenAI's streaming format) of choice ``index``."""
    return {
        "id": f"chatcmpl-sim{request_id[:24]}", "object": "chat.completion.chunk",
        "created": created, "model": chat.model, "system_fingerprint": "fp_simulator",
        "choices": ([{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
                    if with_choice else []),
        "usage": usage,
    }


def stream_chunks(chat: ChatRequest, choice_tokens: int, request_id: str) -> list[dict[str, Any]]:
    """Every chunk of a streamed reply, for each of its ``chat.n`` choices in turn: the role,
    the text pieces, the finish reason; with ``include_usage``, a last chunk without
    choices carrying the usage of them all."""
    created = int(time.time())
    finish = "length" if choice_tokens == chat.max_tokens else "stop"
    completion_tokens = choice_tokens * chat.n
    out = []
    for index in range(chat.n):
        out.append(stream_chunk(chat, request_id, created, {"role": "assistant", "content": ""}, index=index))
        out += [stream_chunk(chat, request_id, created, {"content": text}, index=index)
                for text in chunk_texts(choice_tokens)]
        out.append(stream_chunk(chat, request_id, created, {}, finish_reason=finish, index=index))
    if chat.include_usage:
        out.append(stream_chunk(chat, request_id, created, {}, with_choice=False, usage={
            "prompt_tokens": chat.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": chat.prompt_tokens + completion_tokens}))
    return out
