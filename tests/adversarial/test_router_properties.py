"""Issue 13: whatever JSON a client sends the router's POST routes, the answer is never a 5xx of the router's own.

Hypothesis draws JSON documents -- lone surrogates in their strings included,
the case that was a 500 -- as bodies for /v1/chat/completions and
/v1/completions, with a model that exists (by name or alias), does not, or is
not a string. A real router serves them on loopback with a fake engine
behind it; every answer must be below 500, and every error OpenAI-shaped.
"""
from __future__ import annotations

import json

import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ..router.harness import catalog, make_router

# Bounded: a few hundred requests on loopback take seconds here.
EXAMPLES = 150

# Any code point, lone surrogates (category Cs) included: JSON's \u escapes can spell them.
text = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=12)
leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), text)
value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(text, inner, max_size=4)), max_leaves=16)
body = st.one_of(
    value,
    st.fixed_dictionaries({"model": st.one_of(st.sampled_from(["talk", "chat", "nope", ""]), value)},
                          optional={"messages": value, "prompt": value, "stream": value, "max_tokens": value,
                                    "stop": value, "n": value}),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=body, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
# The case b616774 answered 500 (the alias makes the router re-encode the body), always tried.
@example(doc={"model": "chat", "prompt": "\ud800"}, path="/v1/completions")
def test_arbitrary_json_is_never_answered_5xx_by_the_router(engines, routers, doc, path):
    rt = _router(engines, routers)
    resp = requests.post(rt.url + path, data=json.dumps(doc).encode(), timeout=30,
                         headers={"Content-Type": "application/json"})
    assert resp.status_code < 500, (doc, resp.status_code, resp.text[:300])
    if resp.status_code >= 400 and "x-llmgw-replica" not in resp.headers:
        error = resp.json()["error"]
        assert {"message", "type", "code"} <= set(error)


_served: dict = {}


def _router(engines, routers):
    # One engine and one router for all examples of a run (hypothesis calls
    # the test once per example with the same fixtures).
    key = (id(engines), id(routers))
    if key not in _served:
        engine = engines("talk", "t1", "--tokens-per-second", "2000")
        rt = routers(make_router(catalog(("talk", ("chat",)))))
        rt.set_endpoints([engine.endpoint()])
        _served.clear()
        _served[key] = rt
    return _served[key]
