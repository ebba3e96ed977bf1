"""The traffic history (control.history): points per interval, rates over the time covered, bounded rings."""
from __future__ import annotations

import math

import pytest

from llmgwctl.contracts import RequestRecord
from llmgwctl.control.history import FIELDS, History, ModelSample


def rec(model="m", status=200, ttft=0.1, tokens=(10, 20), replica="r-1", at=0.0):
    return RequestRecord(at=at, id="x", key=None, asked=model, model=model, status=status, ttft=ttft, duration=ttft,
                         tokens_in=tokens[0], tokens_out=tokens[1], replica=replica)


def sample(name="m", inflight=0, desired=1, ready=1, load=None, target=None):
    return ModelSample(name, inflight, desired, ready, load, target)


def test_a_point_holds_the_rates_percentiles_and_the_fleet_state_of_its_interval():
    h = History(interval=5.0, points=10)
    h.sample(100.0, [sample()])      # the first point: the rate is over one interval
    for i in range(100):
        h.observe(rec(ttft=0.01 * (i + 1)))         # 10 ms .. 1 s
    h.observe(rec(status=503, ttft=None, tokens=(0, 0), replica=""))
    h.sample(110.0, [sample(inflight=3, desired=2, ready=1, load=2.5, target=4.0)])
    doc = h.to_dict()
    assert doc["t"] == [100.0, 110.0]
    m = doc["models"]["m"]
    assert m["requests"] == [0.0, pytest.approx(101 / 10.0)]   # over the 10 s the window really covered
    assert m["errors"][1] == pytest.approx(0.1)
    assert m["tokens_out"][1] == pytest.approx(2000 / 10.0)
    assert m["ttft_p50"][0] is None                 # no request: no percentile, not zero
    assert m["ttft_p50"][1] == pytest.approx(0.5, rel=0.06)
    assert m["ttft_p99"][1] == pytest.approx(0.99, rel=0.06)
    assert (m["inflight"][1], m["desired"][1], m["ready"][1], m["load"][1], m["target"][1]) == (3, 2, 1, 2.5, 4)
    fleet = doc["fleet"]
    assert fleet["requests"][1] == pytest.approx(10.1) and fleet["desired"][1] == 2
    assert fleet["load"][1] is None                 # loads of different metrics do not add up
    assert set(m) == set(FIELDS)


def test_since_gives_only_the_new_points_and_the_ring_keeps_the_last_ones():
    h = History(interval=1.0, points=4)
    for t in range(10):
        h.observe(rec())
        h.sample(float(t), [sample()])
    doc = h.to_dict()
    assert doc["t"] == [6.0, 7.0, 8.0, 9.0]
    assert h.to_dict(since=8.0)["t"] == [9.0]
    assert h.to_dict(since=9.0)["t"] == []
    assert h.version == 10


def test_since_is_compared_as_answers_spell_times():
    h = History(interval=1.0, points=4)
    h.sample(1.0004, [sample()])
    t = h.to_dict()["t"]
    assert t == [1.0]
    assert h.to_dict(since=t[-1])["t"] == [], "a point an answer gave is not new again"


def test_a_model_gone_from_the_catalog_keeps_its_points_until_they_age_out():
    h = History(interval=1.0, points=3)
    h.sample(0.0, [sample("a"), sample("b")])
    h.sample(1.0, [sample("a")])
    assert h.models() == ["a", "b"]
    assert h.to_dict()["models"]["b"]["desired"] == [1, None]
    h.sample(2.0, [sample("a")])
    h.sample(3.0, [sample("a")])
    assert h.models() == ["a"]
    with pytest.raises(KeyError):
        h.to_dict("b")


def test_names_beyond_the_bound_count_for_the_fleet_only():
    h = History(interval=1.0, points=2, max_models=2)
    for name in ("a", "b", "c"):
        h.observe(rec(model=name))
    h.sample(1.0, [sample("a"), sample("b"), sample("c")])
    doc = h.to_dict()
    assert sorted(doc["models"]) == ["a", "b"]
    assert doc["fleet"]["requests"] == [3.0]
    assert list(h.to_dict(first=1)["models"]) == ["a"], "the console's stream carries the first by name"


def test_a_request_refused_before_any_replica_has_no_ttft():
    h = History(interval=1.0, points=2)
    h.observe(rec(status=401, replica="", ttft=0.0001))
    h.sample(1.0, [sample()])
    m = h.to_dict()["models"]["m"]
    assert m["requests"] == [1.0] and m["errors"] == [0.0] and m["ttft_p50"] == [None]
    assert not any(isinstance(v, float) and math.isnan(v) for v in m["ttft_p99"])
