"""Parsing and validating one ``POST /v1/chat/completions`` body.

Everything a request can get wrong is answered here, before it touches a
bucket, in OpenAI's words where OpenAI has them: a parameter OpenAI does not
document for chat completions is a 400 ``unknown_parameter``; a bad body,
model, ``stream``/``stream_options``/``n``, messages or token field is a 400
(404 ``model_not_found`` for an unknown model); an ``n`` over ``max_n`` is a 400
``unsupported_value``; a ``prompt + max_tokens`` past the model's context window
(``context_window_tokens``) is a 400 ``context_length_exceeded``; and one that
exceeds the token bucket's capacity is a 400 ``request_too_large`` -- OpenAI
answers 429 for that, which makes clients retry forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from gateway_tasks.core.errors import ApiError, InvalidRequest
from gateway_tasks.core.tokens import CONTROL_PARAMETERS, count_prompt_tokens, validate_messages
from gateway_tasks.simulator.config import SimConfig

INVALID = "invalid_request_error"
# the request parameters OpenAI documents for POST /v1/chat/completions, and the simulator's own
KNOWN_PARAMETERS = frozenset({
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
    "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
    "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
    "sim_completion_tokens",   # the simulator's: force the reply's length
})


@dataclass(frozen=True)
class ChatRequest:
    """A valid chat request, as far as the simulator cares."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    forced_completion_tokens: int | None
    prompt_tokens: int
    stream: bool = False            # answer as server-sent chat.completion.chunk events
    include_usage: bool = False     # stream_options.include_usage: a last chunk with the usage
    n: int = 1                      # choices in the reply, each of up to max_tokens

    @property
    def max_completion_tokens_total(self) -> int:
        """The completion tokens it may use over all its choices (what ``reserve`` debits)."""
        return self.max_tokens * self.n


def _int_field(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ApiError(400, INVALID, f"{name} must be an integer >= {minimum}, got {value!r}",
                       code="invalid_value", param=name)
    return value


def _prompt_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters the simulator charges as prompt besides the messages: every one but the
    control parameters and its own ``sim_completion_tokens`` (tools, functions, user,
    metadata, ... -- all the text a real upstream would read)."""
    return {k: v for k, v in body.items() if k not in CONTROL_PARAMETERS and k != "sim_completion_tokens"}


def checked_model(body: Any, known_parameters: frozenset[str], models: tuple[str, ...]) -> str:
    """The model a request body names, once the body is an object of known parameters and
    the model one the simulator serves; else ApiError as OpenAI answers (400, 404)."""
    if not isinstance(body, dict):
        raise ApiError(400, INVALID, "the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in known_parameters)
    if unknown:
        raise ApiError(400, INVALID, f"Unknown parameter: '{unknown[0]}'.", code="unknown_parameter",
                       param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, INVALID, "model is required and must be a non-empty string",
                       code="missing_required_parameter", param="model")
    if model not in models:
        raise ApiError(404, INVALID, f"The model `{model}` does not exist or you do not have access to it.",
                       code="model_not_found")
    return model


def parse_chat_request(body: Any, config: SimConfig) -> ChatRequest:
    """Validate a decoded chat.completions body; raise ApiError (400/404)."""
    model = checked_model(body, KNOWN_PARAMETERS, config.models)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, INVALID, f"stream must be a boolean, got {stream!r}",
                       code="invalid_type", param="stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise ApiError(400, INVALID, "stream_options is only allowed with stream=true and must be "
                                     "an object such as {'include_usage': true}",
                       code="invalid_value", param="stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    n = _int_field(body, "n", 1) or 1
    if n > config.max_n:
        supported = ("Only the default (1) value is supported." if config.max_n == 1
                     else f"Supported values are 1 to {config.max_n}.")
        raise ApiError(400, INVALID, f"Unsupported value: 'n' does not support {n} with this model. {supported}",
                       code="unsupported_value", param="n")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list):
        raise ApiError(400, INVALID, "messages is required and must be a list of "
                                     "{'role', 'content'} objects",
                       code="invalid_type", param="messages")
    try:
        messages = validate_messages(raw_messages)
    except InvalidRequest as exc:
        raise ApiError(400, INVALID, str(exc), code="invalid_value", param="messages") from None
    max_tokens = _int_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", 1)
    forced = _int_field(body, "sim_completion_tokens", 0)
    chat = ChatRequest(model=model, messages=messages,
                       max_tokens=config.default_max_tokens if max_tokens is None else max_tokens,
                       forced_completion_tokens=forced,
                       prompt_tokens=count_prompt_tokens(messages, extra_body=_prompt_fields(body)),
                       stream=bool(stream),
                       include_usage=include_usage, n=n)
    _require_context(chat, config)
    _require_fits(chat, config)
    return chat


def _require_context(chat: ChatRequest, config: SimConfig) -> None:
    """400 ``context_length_exceeded`` (OpenAI's words) when prompt + max_tokens exceeds the
    model's context window."""
    window = config.context_window(chat.model)
    if window is not None and chat.prompt_tokens + chat.max_tokens > window:
        raise ApiError(
            400, INVALID,
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{chat.prompt_tokens + chat.max_tokens} tokens ({chat.prompt_tokens} in the messages, "
            f"{chat.max_tokens} in the completion). Please reduce the length of the messages or completion.",
            code="context_length_exceeded", param="messages")


def _require_fits(chat: ChatRequest, config: SimConfig) -> None:
    """400 ``request_too_large`` when prompt + max_tokens (of all its choices) exceeds the
    token capacity."""
    total = chat.prompt_tokens + chat.max_completion_tokens_total
    if total > config.token_capacity:
        raise ApiError(
            400, INVALID,
            f"Request too large for {chat.model}: prompt_tokens ({chat.prompt_tokens}) + "
            f"max_tokens ({chat.max_tokens}){f' * n ({chat.n})' if chat.n > 1 else ''} = {total} exceeds the token bucket capacity "
            f"({int(config.token_capacity)} = tpm {config.tpm} * burst_s {config.burst_s:g} / 60); "
            f"it could never be admitted. Lower max_tokens or shorten the prompt.",
            code="request_too_large", param="max_tokens")
