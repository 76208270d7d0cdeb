"""InferenceRequest: the one typed request between producer and worker."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gateway_tasks.core.errors import InvalidRequest
from gateway_tasks.dispatch.request import InferenceRequest

GOOD = InferenceRequest(tenant_id="acme", tier="vip", pool="default", model="gpt-4o-mini",
                        messages=[{"role": "user", "content": "secret prompt"}], max_tokens=64,
                        prompt_tokens=9, est_tokens=73, deadline_s=30.0, source="api",
                        extra_body={"temperature": 0})


def test_body_round_trips_through_json():
    body = json.loads(json.dumps(GOOD.to_body()))
    assert InferenceRequest.from_body(body) == GOOD
    assert GOOD.routing_headers() == {"gt_tenant": "acme", "gt_tier": "vip", "gt_est_tokens": 73,
                                      "gt_source": "api", "gt_weight": 1.0, "gt_lane": "interactive",
                                      "gt_deadline_s": 30.0}
    assert "gt_deadline_s" not in replace(GOOD, deadline_s=None).routing_headers()
    scheduled = replace(GOOD, lane="scheduled")
    assert scheduled.routing_headers()["gt_lane"] == "scheduled"
    assert InferenceRequest.from_body(json.loads(json.dumps(scheduled.to_body()))) == scheduled
    assert "secret" not in GOOD.argsrepr() and "tenant=acme" in GOOD.argsrepr()


@pytest.mark.parametrize("change,reason", [
    ({"tenant_id": ""}, "tenant_id=''"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"max_tokens": True}, "max_tokens=True"),
    ({"est_tokens": -1}, "est_tokens=-1"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"deadline_s": float("nan")}, "deadline_s=nan"),
    ({"deadline_s": 0}, "deadline_s=0"),
    ({"extra_body": [1]}, "extra_body"),
    ({"pool": 3}, "pool=3"),
    ({"lane": "urgent"}, "lane='urgent'"),
])
def test_a_crafted_body_fails_naming_the_field(change, reason):
    body = {**GOOD.to_body(), **change}
    with pytest.raises(InvalidRequest, match=reason.replace("(", r"\(").replace(")", r"\)")):
        InferenceRequest.from_body(body)


def test_missing_fields_and_non_objects_are_named():
    with pytest.raises(InvalidRequest, match=r"lacks \['est_tokens'\]"):
        InferenceRequest.from_body({k: v for k, v in GOOD.to_body().items() if k != "est_tokens"})
    with pytest.raises(InvalidRequest, match="must be an object, got list"):
        InferenceRequest.from_body([1, 2])
