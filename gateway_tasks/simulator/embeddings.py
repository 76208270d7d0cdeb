"""``POST /v1/embeddings`` of the simulator: OpenAI's request checked, deterministic vectors.

A vector is a function of (model, input) only: sha256 counter-mode bytes mapped to
[-1, 1) and scaled to unit length, ``dimensions`` long (the request's, else
``SimConfig.embedding_dimensions``).  ``encoding_format`` "float" answers lists of floats,
"base64" (what the openai SDK asks for by default) little-endian float32 bytes in base64.
The input's tokens are counted with the same tokenizer as chat prompts and charged to the
buckets as prompt tokens with no completion (``Simulator.admit(tokens, 0)``).
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any

from gateway_tasks.core.errors import ApiError, InvalidRequest
from gateway_tasks.core.tokens import count_embedding_tokens, validate_embedding_input
from gateway_tasks.simulator.config import SimConfig
from gateway_tasks.simulator.request import INVALID, checked_model

KNOWN_PARAMETERS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
MAX_DIMENSIONS = 4096


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: list[Any]          # each one input: a string or a list of token ids
    dimensions: int
    encoding_format: str
    prompt_tokens: int


def parse_embedding_request(body: Any, config: SimConfig) -> EmbeddingRequest:
    """Validate a decoded embeddings body; raise ApiError (400, 404 for an unknown model)."""
    model = checked_model(body, KNOWN_PARAMETERS, config.embedding_models)
    try:
        value = validate_embedding_input(body.get("input"))
    except InvalidRequest as exc:
        raise ApiError(400, INVALID, str(exc), code="invalid_value", param="input") from None
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, INVALID, f"encoding_format must be 'float' or 'base64', got {fmt!r}",
                       code="invalid_value", param="encoding_format")
    dims = body.get("dimensions", config.embedding_dimensions)
    if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= MAX_DIMENSIONS:
        raise ApiError(400, INVALID, f"dimensions must be an integer in [1, {MAX_DIMENSIONS}], got {dims!r}",
                       code="invalid_value", param="dimensions")
    inputs = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    return EmbeddingRequest(model, inputs, dims, fmt, count_embedding_tokens(value))


def vector(model: str, item: Any, dimensions: int) -> list[float]:
    """The unit vector of one input (pure, deterministic)."""
    seed = hashlib.sha256(f"{model}\x00{item!r}".encode("utf-8", "surrogatepass")).digest()
    raw: list[float] = []
    counter = 0
    while len(raw) < dimensions:
        block = hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
        raw.extend(int.from_bytes(block[i:i + 2], "big") / 32768.0 - 1.0 for i in range(0, 32, 2))
        counter += 1
    raw = raw[:dimensions]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def embedding_reply(req: EmbeddingRequest) -> dict[str, Any]:
    """OpenAI's ``list`` of ``embedding`` objects with the usage."""
    data = []
    for index, item in enumerate(req.inputs):
        vec = vector(req.model, item, req.dimensions)
        value: Any = vec
        if req.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": index, "embedding": value})
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens}}
