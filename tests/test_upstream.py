"""workers.upstream: what a reply says of the upstream's own time, and which of its 4xx
are the caller's error (``refusal_of``)."""

from __future__ import annotations

import openai
import pytest

from gateway_tasks.core.errors import UpstreamRejected
from workers.upstream import UNKNOWN_ERROR_TYPE, processing_ms, refusal_of


@pytest.mark.parametrize("headers,expected", [
    ({"openai-processing-ms": "173"}, 173.0),
    ({"openai-processing-ms": "0"}, 0.0),
    ({"openai-processing-ms": "12.5"}, 12.5),
    ({}, None),                                          # another provider sends none
    ({"openai-processing-ms": ""}, None),
    ({"openai-processing-ms": "soon"}, None),
    ({"openai-processing-ms": "-3"}, None),
    ({"openai-processing-ms": "nan"}, None),
    ({"openai-processing-ms": "inf"}, None),
])
def test_processing_ms_is_the_upstreams_own_time_or_none(headers, expected):
    assert processing_ms(headers) == expected


def status_error(status: int, body: object) -> openai.APIStatusError:
    """An SDK status error as ``refusal_of`` reads it: its status, decoded body and message."""
    exc = openai.APIStatusError.__new__(openai.APIStatusError)
    exc.status_code, exc.body, exc.message = status, body, f"Error code: {status}"
    return exc


@pytest.mark.parametrize("status", [401, 403, 429, 500, 502, 503])
def test_not_the_callers_error_is_no_refusal(status):
    body = {"message": "Incorrect API key provided: sk-abc***xyz", "type": "invalid_request_error",
            "param": None, "code": "invalid_api_key"}
    assert refusal_of(status_error(status, body)) is None


@pytest.mark.parametrize("status", [400, 404, 409, 413, 422])
def test_a_callers_4xx_keeps_the_upstreams_status_and_error_object(status):
    body = {"message": "Unknown parameter: 'x'.", "type": "invalid_request_error", "param": "x",
            "code": "unknown_parameter"}
    refused = refusal_of(status_error(status, body))
    assert isinstance(refused, UpstreamRejected) and refused.status == status
    assert refused.openai_error() == body
    assert str(refused) == f"the upstream refused the request ({status}): Unknown parameter: 'x'."


def test_a_refusal_in_another_shape_keeps_its_text():
    refused = refusal_of(status_error(400, "<html>Bad Request</html>"))
    assert refused.openai_error() == {"message": "<html>Bad Request</html>", "type": UNKNOWN_ERROR_TYPE,
                                      "param": None, "code": None}
    numbered = refusal_of(status_error(400, {"message": "bad", "code": 1234}))
    assert numbered.code == "1234" and numbered.type == UNKNOWN_ERROR_TYPE
