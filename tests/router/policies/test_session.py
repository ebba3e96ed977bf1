"""session: the replica that served the session (OpenAI's `user`, else x-llmgw-session), weighed against load.

The session stands for its whole prompt in prefix's cost model: moving it
costs its prompt's tokens / PER_REQUEST (256) requests' worth. Each row
first sends the session's earlier turns, each to one replica alone (as if
the others were excluded), then asks where the next turn goes. The replica
that served it carries a request in most rows, so a pick that missed the
session would go to the idle one.
"""
from __future__ import annotations

import pytest

from llmgwctl.router.policies import Policy
from llmgwctl.router.policies.session import SESSION_HEADER

from .scene import MODEL, Ep, Scene

SESSION = Policy.SESSION.label
SHORT = "s" * 400       # 100 tokens: moving costs 0.39 of a request
LONG = "l" * 4000       # 1,000 tokens: moving costs 3.9


def chat(text: str, **extra: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], **extra}


ALICE = chat(LONG, user="alice")
S1 = {SESSION_HEADER: "s-1"}

CASES = [
    pytest.param([(ALICE, None, "b")], [Ep("a"), Ep("b", load=1)], chat(LONG + "?", user="alice"), None, "b",
                 id="by the user field: 1 against 3.9"),
    pytest.param([(chat(LONG), S1, "b")], [Ep("a"), Ep("b", load=1)], chat(LONG + "?"), S1, "b",
                 id="by the header"),
    pytest.param([(ALICE, None, "b"), (chat(LONG), S1, "a")], [Ep("a"), Ep("b", load=1)], ALICE, S1, "b",
                 id="the user field before the header"),
    pytest.param([(chat(LONG), S1, "b")], [Ep("a"), Ep("b", load=1)], chat(LONG, user=""), S1, "b",
                 id="an empty user field falls to the header"),
    pytest.param([(chat(SHORT, user="bob"), None, "b")], [Ep("a"), Ep("b", load=1)], chat(SHORT, user="bob"), None, "a",
                 id="a short session moves off a busy replica: 1 against 0.39"),
    pytest.param([(ALICE, None, "b")], [Ep("a"), Ep("b", queued=True)], ALICE, None, "a",
                 id="a queueing replica is not a candidate"),
    pytest.param([(ALICE, None, "b")], [Ep("a"), Ep("b", load=1)], chat(LONG, user="carol"), None, "a",
                 id="another session has no history: least-load"),
]


@pytest.mark.parametrize(("earlier", "eps", "doc", "headers", "want"), CASES)
def test_session_stays_where_it_was_served_unless_load_says_otherwise(earlier, eps, doc, headers, want):
    scene = Scene(*(Ep(e.rid) for e in eps))
    for turn, turn_headers, served in earlier:
        assert scene.pick(SESSION, turn, turn_headers, only=served) == served
    scene.load(*eps)
    assert scene.pick(SESSION, doc, headers) == want


NO_SESSION = [
    pytest.param(chat(SHORT), None, id="neither field nor header"),
    pytest.param(chat(SHORT, user=""), {SESSION_HEADER: ""}, id="both empty"),
    pytest.param({"messages": [], "user": 7}, None, id="a user that is not a string"),
]


@pytest.mark.parametrize(("doc", "headers"), NO_SESSION)
def test_without_a_session_the_pick_is_least_loads(doc, headers):
    scene = Scene(Ep("a"), Ep("b"))
    assert scene.policies.chooser(SESSION, MODEL, doc, headers) is None
