"""Deadline boost: a task with deadline_s becomes urgent deadline_boost_s (seed 60 s)
before its deadline and is then dispatched ahead of its tier's fair order."""

from __future__ import annotations

import pytest

from gateway_tasks.dispatch.deadline import urgent_from_ms
from gateway_tasks.dispatch.index_entry import IndexEntry
from gateway_tasks.producer.gateway import Gateway


@pytest.mark.parametrize("enq,deadline_s,boost_s,expected", [
    (1_000, 120.0, 60.0, 61_000), (1_000, 30.0, 60.0, 1_000), (0, 60.0, 60.0, 0), (5, 10.5, 0.5, 10_005)])
def test_urgent_from(enq, deadline_s, boost_s, expected):
    assert urgent_from_ms(enq, deadline_s, boost_s) == expected


@pytest.fixture
def gw(make_gateway):
    return make_gateway([("acme", "vip")])


def lines(gw: Gateway) -> list[tuple[int, str]]:
    raw = gw.r.hget(gw.keys.fair("default"), "d:vip")
    return [(int(a), b) for a, b in (line.split(">") for line in raw.decode().split("\n"))] if raw else []


def test_deadline_tasks_are_recorded_by_when_they_become_urgent(gw):
    gw.submit("acme", "no deadline", max_tokens=5)
    assert lines(gw) == []
    late = gw.submit("acme", "two minutes", max_tokens=5, deadline_s=120)
    soon = gw.submit("acme", "thirty seconds", max_tokens=5, deadline_s=30)
    (t_soon, e_soon), (t_late, e_late) = lines(gw)
    enq_late, enq_soon = IndexEntry.decode(e_late).enqueued_ms, IndexEntry.decode(e_soon).enqueued_ms
    assert (t_late, t_soon) == (enq_late + 60_000, enq_soon)
    assert IndexEntry.decode(e_late).tag != IndexEntry.decode(e_soon).tag
    assert int(gw.r.hget(gw.keys.fair("default"), "dn:vip")) == t_soon
    assert {late.id, soon.id}


def test_no_boost_when_turned_off(settings, r):
    g = Gateway(settings.with_(deadline_boost_s=0), client=r)
    g.register_tenant("acme", "vip")
    g.submit("acme", "x", max_tokens=5, deadline_s=30)
    assert g.r.hget(g.keys.fair("default"), "d:vip") is None
    g.app.close()
