"""Request bodies of the REST trigger (pydantic models)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway_tasks.dispatch.request import MAX_DEADLINE_S

# fields of an OpenAI chat request the gateway handles itself (never forwarded in extra_body)
_OWN_CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "stream",
                    "stream_options", "deadline_s", "idempotency_key"}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # not blank: at least one character that is not white space, as submit checks it (a
    # validator, not a pattern: a lone surrogate reaches submit, which names it)
    content: str = Field(json_schema_extra={"pattern": r"\S"}, description="the message text, not blank")

    @field_validator("content")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the message content is blank")
        return value


def _prompt_to_messages(value: Any) -> Any:
    # a blank string stays a string, which the field refuses
    return [{"role": "user", "content": value}] if isinstance(value, str) and value else value


prompt_to_messages = _prompt_to_messages    # for the other request models (rest.crons)


class TaskRequest(BaseModel):
    """POST /v1/tasks."""

    model_config = ConfigDict(extra="forbid")

    # a plain string is accepted, and the schema says so: the before-validator makes it one user message
    messages: list[ChatMessage] | Annotated[str, Field(min_length=1)] = Field(
        min_length=1, description="chat messages; a plain string is taken as one user message")
    model: str | None = Field(default=None, min_length=1,
                              description="a model served by one of the pools (default: first pool's)")
    max_tokens: int | None = Field(default=None, gt=0, strict=True,
                                   description="completion token limit (default: settings)")
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S,
                                     description="drop the task if it waits longer in the queue")
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256,
                                        description="same key, same tenant -> same task id, "
                                                    "enqueued once")
    extra_body: dict[str, Any] | None = Field(
        default=None, description="other upstream parameters (temperature, top_p, ...)")
    depends_on: list[str] | None = Field(
        default=None, max_length=32,
        description="ids of the tenant's own tasks (or of tasks submitted on behalf of one of "
                    "its tasks) that must finish first; the task is held until they have")
    on_behalf_of: str | None = Field(
        default=None, min_length=1, max_length=200,
        description="id of a live task (any tenant's) this work is for: admitted and judged by "
                    "the load level at that task's tier when higher, dispatched at its priority "
                    "and never evicted while it lives; that task's tenant may name it in "
                    "depends_on; quotas stay this tenant's")
    lane: Literal["interactive", "scheduled"] | None = Field(
        default=None,
        description="interactive (default: someone waits) or scheduled (background work that "
                    "tolerates seconds of delay: inside its tier it yields to interactive work, "
                    "by a bounded lag)")

    on_defer: Literal["hold", "refuse"] | None = Field(
        default=None,
        description="when the load level defers the tier: hold (default: accepted, 202 with "
                    "`deferred`, run later) or refuse (429 Deferred with Retry-After); also the "
                    "X-Gateway-On-Defer header")

    _messages = field_validator("messages", mode="before")(_prompt_to_messages)


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions: an OpenAI chat request; unknown fields go upstream."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = Field(default=None, min_length=1)
    max_tokens: int | None = Field(default=None, gt=0, strict=True)
    max_completion_tokens: int | None = Field(default=None, gt=0, strict=True)
    stream: bool = Field(default=False, strict=True,
                         description="stream the completion as server-sent chat.completion.chunk events")
    stream_options: dict[str, Any] | None = Field(
        default=None, description="with stream: {'include_usage': true} adds the usage chunk")
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S,
                                     description="gateway extension: queue deadline and wait timeout")
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage", False))

    def upstream_extras(self) -> dict[str, Any]:
        return {k: v for k, v in (self.model_extra or {}).items() if k not in _OWN_CHAT_FIELDS}


# fields of an OpenAI embeddings request the gateway handles itself (never forwarded)
_OWN_EMBEDDING_FIELDS = {"model", "input", "deadline_s", "idempotency_key"}


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: an OpenAI embeddings request; other fields (encoding_format,
    dimensions, user) go upstream."""

    model_config = ConfigDict(extra="allow")

    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists")
    model: str = Field(min_length=1, description="an embedding model served by one of the pools")
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S,
                                     description="gateway extension: queue deadline and wait timeout")
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)

    def upstream_extras(self) -> dict[str, Any]:
        return {k: v for k, v in (self.model_extra or {}).items() if k not in _OWN_EMBEDDING_FIELDS}
