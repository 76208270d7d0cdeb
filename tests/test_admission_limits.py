"""Malformed requests are refused at admission with a 4xx JSON error, through the REST API
and through ``Gateway.submit``, and nothing is enqueued: JSON nested deeper than
max_json_depth (measured on a REST body's bytes before it is parsed), lone surrogates and
NaN/±Infinity (which the worker could not encode), and a prompt far over its limit, refused
without tokenizing all of it."""

from __future__ import annotations

import random
import string
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from gateway_tasks.core import tokens
from gateway_tasks.core.errors import InvalidRequest, PromptTooLarge
from gateway_tasks.core.json_limits import check_value, json_depth
from gateway_tasks.core.keys import Keys
from gateway_tasks.rest.app import create_app

HELLO = [{"role": "user", "content": "hello there"}]
ADMIN_KEY = "admin-" + "y" * 26


@pytest.fixture
def gw(make_gateway, settings):
    return make_gateway(tenants=[("acme", "vip")], settings=replace(settings, admin_key=ADMIN_KEY))


@pytest.fixture
def api(gw):
    with TestClient(create_app(gw), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def key(gw):
    return gw.register_tenant("bob", "vip")


def _enqueued(gw) -> int:
    """How many enqueues the pool has seen (lua/dispatch/enqueue.lua INCRs this per task)."""
    return int(gw.r.get(Keys(gw.settings.key_prefix).seq("default")) or 0)


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def _refused(resp, status: int = 400, type_: str = "InvalidRequest") -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert err["type"] == type_, err
    return err


# -- nesting depth -------------------------------------------------------------------------
def test_json_depth_counts_brackets_outside_strings():
    assert json_depth(b'{"a": [1, {"b": "[[[{{{"}]}', 10) == 3
    assert json_depth(b'{"a": "\\"[[[["}', 10) == 1
    assert json_depth(_nested(100).encode(), 64) == 65   # stops once past the limit


@pytest.mark.parametrize("levels", [65, 500, 900, 990, 5_000])
@pytest.mark.parametrize("path,body", [
    ("/v1/tasks", '{{"messages": "hi", "extra_body": {{"x": {deep}}}}}'),
    ("/v1/chat/completions", '{{"messages": [{{"role": "user", "content": "hi"}}], "x": {deep}}}'),
    ("/v1/crons", '{{"task_id": "c1", "schedule": "* * * * *", "messages": "hi", "x": {deep}}}'),
])
def test_deep_json_is_a_400_naming_the_limit(api, gw, key, levels, path, body):
    before = _enqueued(gw)
    resp = api.post(path, content=body.format(deep=_nested(levels)),
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    err = _refused(resp)
    assert "max_json_depth" in err["message"] and err["max_json_depth"] == 64
    assert _enqueued(gw) == before


def test_deep_json_in_an_admin_body_is_a_400(api, gw):
    resp = api.post("/v1/admin/tenants", content='{"tenant_id": "t", "tier": ' + _nested(900) + "}",
                    headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"})
    assert "max_json_depth" in _refused(resp)["message"]


def test_nesting_up_to_the_limit_is_accepted(api, gw, key):
    deep = _nested(62)     # the body's object, extra_body's object, then 62 levels: 64
    resp = api.post("/v1/tasks", content='{"messages": "hi", "extra_body": {"x": ' + deep + "}}",
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert resp.status_code == 202, resp.text


@pytest.mark.parametrize("levels", [65, 500, 990, 5_000])
def test_deep_extra_body_is_refused_by_submit(gw, levels):
    deep: list = []
    inner = deep
    for _ in range(levels - 1):
        inner.append([])
        inner = inner[0]
    before = _enqueued(gw)
    with pytest.raises(InvalidRequest, match="extra_body: .*max_json_depth"):
        gw.submit("acme", "hi", extra_body={"x": deep})
    assert _enqueued(gw) == before


# -- values the worker could not encode ----------------------------------------------------
BAD_BODIES = [
    ('{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content: lone surrogate"),
    ('{"messages": "hi", "extra_body": {"stop": ["ok", "\\udfff"]}}', "extra_body.stop[1]: lone surrogate"),
    ('{"messages": "hi", "extra_body": {"\\ud800": 1}}', "lone surrogate in the key"),
    ('{"messages": "hi", "extra_body": {"temperature": NaN}}', "extra_body.temperature: NaN is not valid JSON"),
    ('{"messages": "hi", "extra_body": {"top_p": Infinity}}', "extra_body.top_p: Infinity is not valid JSON"),
    ('{"messages": "hi", "extra_body": {"a": {"b": -Infinity}}}', "extra_body.a.b: -Infinity is not valid JSON"),
]


def _refused_raw(api, gw, key, path: str, raw: str) -> str:
    """POST a raw JSON body; its refusal's message, once checked that nothing was enqueued."""
    before = _enqueued(gw)
    resp = api.post(path, content=raw,
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    message = _refused(resp)["message"]
    assert _enqueued(gw) == before
    return message


@pytest.mark.parametrize("raw,message", BAD_BODIES)
def test_unencodable_values_are_a_400_naming_the_field(api, gw, key, raw, message):
    assert message in _refused_raw(api, gw, key, "/v1/tasks", raw)


@pytest.mark.parametrize("raw,message", [
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content: lone surrogate"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     "extra_body.temperature: NaN is not valid JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": -Infinity}}',
     "extra_body.logit_bias.1: -Infinity is not valid JSON"),
])
def test_the_sync_endpoint_refuses_them_before_submitting(api, gw, key, raw, message):
    assert message in _refused_raw(api, gw, key, "/v1/chat/completions", raw)


@pytest.mark.parametrize("kwargs,message", [
    ({"messages": "hi \ud800"}, "messages: lone surrogate"),
    ({"messages": [{"role": "user", "content": "\udc00"}]}, r"messages\[0\].content: lone surrogate"),
    ({"messages": "hi", "extra_body": {"temperature": float("nan")}}, "extra_body.temperature: NaN"),
    ({"messages": "hi", "extra_body": {"x": [float("inf")]}}, r"extra_body.x\[0\]: Infinity"),
    ({"messages": "hi", "extra_body": {"x": {1, 2}}}, "extra_body.x: a set is not JSON"),
])
def test_submit_refuses_them_too(gw, kwargs, message):
    before = _enqueued(gw)
    with pytest.raises(InvalidRequest, match=message):
        gw.submit("acme", **kwargs)
    assert _enqueued(gw) == before


def test_check_value_accepts_plain_json():
    check_value({"a": [1, 2.5, True, None, "é漢😀", {"b": -0.0}]}, "extra_body", 64)


# -- a prompt far over its limit --------------------------------------------------------
def _prose(chars: int, seed: int = 1) -> str:
    rnd = random.Random(seed)
    alphabet = string.ascii_letters + "     \n.,'!?_0123456789éü漢字"
    return "".join(rnd.choice(alphabet) for _ in range(chars))


def test_counting_in_pieces_is_exact():
    enc = tokens.encoding()
    for seed in range(8):
        text = _prose(60_000 + seed * 7_919, seed)
        assert tokens.count_text_tokens(text, 10 ** 9) == len(enc.encode(text, disallowed_special=()))


@pytest.mark.parametrize("via", ["submit", "rest"])
def test_a_huge_prompt_is_refused_without_encoding_all_of_it(gw, api, key, monkeypatch, via):
    enc = tokens.encoding()
    encoded: list[int] = []
    real_encode = enc.encode

    def counting_encode(text, **kwargs):
        encoded.append(len(text))
        return real_encode(text, **kwargs)

    monkeypatch.setattr(enc, "encode", counting_encode)
    prompt = ("lorem ipsum dolor sit amet " * 150_000)[:3_900_000]
    before = _enqueued(gw)
    if via == "submit":
        with pytest.raises(PromptTooLarge, match="at least"):
            gw.submit("acme", prompt, max_tokens=16)
    else:
        resp = api.post("/v1/tasks", json={"messages": prompt, "max_tokens": 16},
                        headers={"Authorization": f"Bearer {key}"})
        assert "at least" in _refused(resp, 413, "PromptTooLarge")["message"]
    # 128k tokens of this text are ~700k characters: the rest is never encoded
    assert 0 < sum(encoded) < 1_000_000
    assert _enqueued(gw) == before


def test_more_bytes_than_the_longest_tokens_hold_is_refused_without_encoding(gw, monkeypatch):
    enc = tokens.encoding()
    monkeypatch.setattr(enc, "encode", lambda *a, **k: pytest.fail("encoded"))
    text = "x" * ((200 + 2) * tokens.longest_token_bytes())
    assert tokens.count_text_tokens(text, 200) == 201


# -- the REST contract ---------------------------------------------------------------------
def test_cancel_documents_its_202_and_409(api):
    responses = api.get("/openapi.json").json()["paths"]["/v1/tasks/{task_id}"]["delete"]["responses"]
    assert {"200", "202", "409"} <= set(responses)
    assert responses["409"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert "TaskFinished" in responses["409"]["description"]


@pytest.mark.parametrize("method,path,allowed", [
    ("PUT", "/v1/tasks/some-id", {"GET", "DELETE"}),
    ("PATCH", "/v1/crons", {"GET", "POST"}),
    ("POST", "/v1/crons/c1", {"GET", "DELETE"}),
    ("PUT", "/v1/tasks", {"POST"}),
])
def test_a_405_allows_every_method_of_the_path(api, key, method, path, allowed):
    resp = api.request(method, path, headers={"Authorization": f"Bearer {key}"})
    _refused(resp, 405, "MethodNotAllowed")
    assert set(resp.headers["Allow"].split(", ")) == allowed


def test_the_schema_bounds_max_tokens_as_submit_does(api, gw, key):
    maximum = gw.settings.max_prompt_tokens - tokens.MIN_PROMPT_TOKENS
    schemas = api.get("/openapi.json").json()["components"]["schemas"]
    for model, field in (("TaskRequest", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
                         ("ChatCompletionRequest", "max_completion_tokens")):
        [integer] = [v for v in schemas[model]["properties"][field]["anyOf"] if v.get("type") == "integer"]
        assert integer["maximum"] == maximum and integer["exclusiveMinimum"] == 0
    # the smallest prompt is MIN_PROMPT_TOKENS: one over the maximum fits no prompt
    assert tokens.count_prompt_tokens([{"role": "user", "content": "a"}]) == tokens.MIN_PROMPT_TOKENS
    before = _enqueued(gw)
    for path, body in (("/v1/tasks", {"messages": "a", "max_tokens": maximum + 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                 "max_completion_tokens": maximum + 1})):
        resp = api.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
        _refused(resp, 413, "PromptTooLarge")
    assert _enqueued(gw) == before


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/chat/completions"])
@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": " \n\t"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "  "}],
])
def test_blank_message_content_is_refused_by_both_endpoints(api, gw, key, path, messages):
    before = _enqueued(gw)
    resp = api.post(path, json={"messages": messages}, headers={"Authorization": f"Bearer {key}"})
    assert "blank" in _refused(resp, 400, "ValidationError")["message"]
    assert _enqueued(gw) == before


def test_the_schema_says_content_is_not_blank(api):
    schemas = api.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["ChatMessage"]["properties"]["content"]["pattern"] == r"\S"


@pytest.mark.parametrize("messages", ["  ", [{"role": "system", "content": "x"}, {"role": "user", "content": ""}]])
def test_submit_refuses_blank_content_too(gw, messages):
    with pytest.raises(InvalidRequest, match="blank"):
        gw.submit("acme", messages)
