"""Embeddings without a worker: the input checked and counted with the prompts' tokenizer,
the task's estimate (no completion reserve), the simulator's deterministic vectors."""

from __future__ import annotations

import pytest

from gateway_tasks.core.errors import InvalidRequest, PromptTooLarge
from gateway_tasks.core.settings import Pool
from gateway_tasks.core.tokens import count_embedding_tokens, count_text_tokens, validate_embedding_input
from gateway_tasks.dispatch.request import EMBEDDINGS, InferenceRequest
from gateway_tasks.simulator.embeddings import vector


@pytest.mark.parametrize("value", ["", "  ", [], [""], [1, -2], [[1], "x", []], 5, [True]])
def test_bad_inputs_are_refused(value):
    with pytest.raises(InvalidRequest):
        validate_embedding_input(value)


def test_tokens_of_each_input_form():
    assert count_embedding_tokens("hello world") == count_text_tokens("hello world")
    assert count_embedding_tokens(["a b", "c"]) == count_text_tokens("a b") + count_text_tokens("c")
    assert count_embedding_tokens([5, 6, 7]) == 3
    assert count_embedding_tokens([[5, 6], [7]]) == 3


def test_vectors_are_deterministic_unit_vectors():
    a, b = vector("m", "text", 16), vector("m", "text", 16)
    assert a == b and vector("m", "other", 16) != a and vector("m2", "text", 16) != a
    assert abs(sum(x * x for x in a) - 1.0) < 1e-9


def test_an_embeddings_task_reserves_no_completion(make_gateway, settings):
    pool = Pool("default", base_url="http://127.0.0.1:9/v1", api_key="k",
                models=("gpt-4o-mini", "text-embedding-3-small"), tpm=60_000, rpm=600)
    gw = make_gateway([("acme", "batch")], settings=settings.with_(pools=(pool,)))
    h = gw.submit("acme", ["one two three", "four"], model="text-embedding-3-small", endpoint=EMBEDDINGS)
    tokens = count_text_tokens("one two three") + count_text_tokens("four")
    assert (h.prompt_tokens, h.est_tokens, h.model) == (tokens, tokens, "text-embedding-3-small")
    body = gw.r.hvals(gw.keys.messages("default"))
    assert len(body) == 1
    with pytest.raises(InvalidRequest, match="model is required"):
        gw.submit("acme", "x", endpoint=EMBEDDINGS)
    with pytest.raises(InvalidRequest, match="not streamed"):
        gw.submit("acme", "x", model="text-embedding-3-small", endpoint=EMBEDDINGS, stream=True)
    with pytest.raises(PromptTooLarge):
        gw.submit("acme", "word " * 70_000, model="text-embedding-3-small", endpoint=EMBEDDINGS)
    req = InferenceRequest.from_body({**InferenceRequest("acme", "batch", "default", "text-embedding-3-small",
                                                         [], 0, 3, 3, endpoint=EMBEDDINGS, input="hi").to_body()})
    assert (req.endpoint, req.input, req.max_tokens) == (EMBEDDINGS, "hi", 0)
    with pytest.raises(InvalidRequest):
        InferenceRequest.from_body({**req.to_body(), "input": ""})
