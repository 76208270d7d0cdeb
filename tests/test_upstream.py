"""workers.upstream: what a reply says of the upstream's own time."""

from __future__ import annotations

import pytest

from workers.upstream import processing_ms


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
