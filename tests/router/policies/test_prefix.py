"""prefix: cost = load + uncached tokens / (PER_REQUEST x weight), lowest wins; the winner learns the prompt.

Every row's prompt is 8 blocks (2,048 characters, 512 tokens at 4 a token),
so with PER_REQUEST = 256 a replica holding none of it pays 2 requests' worth
and each block it lacks a quarter of one.
"""
from __future__ import annotations

import pytest

from llmgwctl.router.policies import Policy
from llmgwctl.router.policies.prefix import BLOCK_CHARS, block_hashes, prompt_text

from .scene import MODEL, Ep, Scene

PREFIX = Policy.PREFIX.label
DOC = {"prompt": "".join(f"block {i:03} ".ljust(BLOCK_CHARS, ".") for i in range(8))}
HASHES = block_hashes(prompt_text(DOC) or "")

CASES = [
    pytest.param([Ep("a"), Ep("b")], {"a": 8}, "a", id="the holder, at equal load: 0 against 2"),
    pytest.param([Ep("a", load=1), Ep("b")], {"a": 8}, "a", id="a busy holder still beats a cold prefill: 1 against 2"),
    pytest.param([Ep("a", load=3), Ep("b")], {"a": 8}, "b", id="until it is busier than the prefill is worth: 3 against 2"),
    pytest.param([Ep("a"), Ep("b")], {"a": 4, "b": 8}, "b", id="the longer match: 1 against 0"),
    pytest.param([Ep("a"), Ep("b", load=2)], {"a": 4, "b": 8}, "a", id="the shorter match when the longer is busy: 1 against 2"),
    pytest.param([Ep("a", load=3), Ep("b", load=3, weight=2)], {"a": 8}, "b",
                 id="weight halves a cold prefill: 3 against 1.5 + 1"),
    pytest.param([Ep("a", load=3), Ep("b", load=3)], {"a": 8}, "a", id="at weight 1 it does not: 3 against 5"),
    pytest.param([Ep("a", queued=True), Ep("b", load=4)], {"a": 8}, "b", id="a queueing holder is not a candidate"),
    pytest.param([Ep("a", load=2), Ep("b")], {}, "b", id="nothing cached anywhere: least-load's pick"),
    pytest.param([Ep("a", load=1), Ep("b"), Ep("c")], {"a": 8, "b": 6}, "b",
                 id="three candidates: 1, 0.5 and 2"),
]


@pytest.mark.parametrize(("eps", "held", "want"), CASES)
def test_prefix_picks_the_lowest_cost_and_teaches_it_the_prompt(eps, held, want):
    scene = Scene(*eps)
    for rid, blocks in held.items():
        scene.policies.index(MODEL).of(scene.state(rid)).record(HASHES[:blocks])
    assert scene.pick(PREFIX, DOC) == want
    learnt = scene.policies.index(MODEL).get(scene.state(want))
    assert learnt is not None and learnt.match(HASHES) == len(HASHES) == 8


NO_CHOOSER = [
    pytest.param({"prompt": "x" * (BLOCK_CHARS - 1)}, prompt_text, id="shorter than a block"),
    pytest.param({"input": "an embedding"}, prompt_text, id="no prompt in the body"),
    pytest.param(DOC, None, id="a route without a prompt reader"),
]


@pytest.mark.parametrize(("doc", "reader"), NO_CHOOSER)
def test_prefix_leaves_a_request_without_a_block_to_least_load(doc, reader):
    scene = Scene(Ep("a"), Ep("b"))
    assert scene.policies.chooser(PREFIX, MODEL, doc, prompt=reader) is None
