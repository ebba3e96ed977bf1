"""round-robin: each candidate in turn, load ignored; the turn is per model and forgotten with its endpoints."""
from __future__ import annotations

import pytest

from llmgwctl.contracts import Endpoint
from llmgwctl.router.policies import Policy
from llmgwctl.router.policies.round_robin import RoundRobin

from .scene import Ep, Scene

RR = Policy.ROUND_ROBIN.label
DOC = {"prompt": "hello"}

CASES = [
    pytest.param([Ep("a"), Ep("b"), Ep("c")], "abcabc", id="in list order"),
    pytest.param([Ep("a", load=10), Ep("b"), Ep("c", load=3)], "abcabc", id="load is ignored"),
    pytest.param([Ep("a"), Ep("b", queued=True), Ep("c")], "acac", id="a queueing engine is skipped"),
    pytest.param([Ep("a", queued=True), Ep("b", queued=True)], "abab", id="none with room: the turn still turns"),
    pytest.param([Ep("a")], "aaa", id="one candidate"),
]


@pytest.mark.parametrize(("eps", "want"), CASES)
def test_round_robin_takes_each_candidate_in_turn(eps, want):
    scene = Scene(*eps)
    assert "".join(scene.pick(RR, DOC) for _ in want) == want


def test_the_turn_is_per_model_and_starts_over_once_its_endpoints_left():
    scene = Scene(Ep("a"), Ep("b"))
    rr = scene.policies.plugin(Policy.ROUND_ROBIN)
    assert isinstance(rr, RoundRobin)
    turns = rr.chooser("m", DOC, None, None)
    assert rr.chooser("m", DOC, None, None) is turns
    assert rr.chooser("other", DOC, None, None) is not turns
    assert scene.pick(RR, DOC) == "a"
    scene.balancer.set_endpoints([])
    scene.policies.chooser(RR, "m", DOC)             # the next request sees the change
    scene.balancer.set_endpoints([scene_endpoint("a"), scene_endpoint("b")])
    assert scene.pick(RR, DOC) == "a"                # a fresh turn, not "b"


def scene_endpoint(rid: str) -> Endpoint:
    return Endpoint(replica_id=rid, model="m", profile="p", engine="fake", url=f"http://127.0.0.1:{3000 + ord(rid)}")
