"""least-load: no chooser, so the balancer's two random choices by load per unit of weight pick."""
from __future__ import annotations

import pytest

from llmgwctl.router.policies import Policy

from .scene import Ep, Scene

PROMPT = {"prompt": "a shared system prompt " * 100}

# Two candidates: two random choices draw both, so the one with less load
# per unit of weight wins every time and the row has one right answer.
CASES = [
    pytest.param([Ep("a", load=3), Ep("b")], "b", id="the idle one"),
    pytest.param([Ep("a"), Ep("b", load=2)], "a", id="the idle one, listed first"),
    pytest.param([Ep("a", load=3, weight=4), Ep("b", load=1)], "a", id="per unit of weight: 0.75 beats 1"),
    pytest.param([Ep("a", load=2, weight=0.5), Ep("b", load=3)], "b", id="at half weight 2 counts as 4"),
    pytest.param([Ep("a", queued=True), Ep("b", load=5)], "b", id="a queueing engine is not a candidate"),
    pytest.param([Ep("a", load=9)], "a", id="one candidate"),
]


@pytest.mark.parametrize(("eps", "want"), CASES)
def test_least_load_picks_the_lightest_candidate(eps, want):
    scene = Scene(*eps)
    assert scene.policies.chooser(Policy.LEAST_LOAD.label, "m", PROMPT) is None
    assert {scene.pick(Policy.LEAST_LOAD.label, PROMPT) for _ in range(20)} == {want}
