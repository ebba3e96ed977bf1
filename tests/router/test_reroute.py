"""The rerouting alone (router/reroute.py): a call switched to a fallback, and a body renamed for the model served.

On a real balancer, metrics registry and cold start; the `Call` is the few
fields the rerouting reads and writes.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llmgwctl.catalog import Catalog, Model, Profile
from llmgwctl.contracts import Endpoint
from llmgwctl.observability.metrics import RouterMetrics
from llmgwctl.router import jsonbody, routes
from llmgwctl.router.balancer import Balancer
from llmgwctl.router.call import Refused, View
from llmgwctl.router.coldstart import ColdStart
from llmgwctl.router.policies import Policies
from llmgwctl.router.reroute import Rerouting, renamed


def model(name, *fallbacks, routing=None):
    return Model(name=name, source=f"org/{name}", fallbacks=tuple(fallbacks), routing=routing,
                 profiles=(Profile(name="default", engine="fake", gpus=0),))


# b picks round-robin, a policy whose chooser is never None: a fallback's own is seen.
CATALOG = Catalog([model("a", "b"), model("b", routing="round-robin")])


class Waker:
    def __init__(self):
        self.woken = []

    def wake(self, model):
        self.woken.append(model)


def rerouting(*serving):
    """A rerouting over a balancer with one endpoint for each model in `serving`, and its waker and metrics."""
    balancer = Balancer(clock=lambda: 100.0, stale_after=3600)
    balancer.set_endpoints([Endpoint(replica_id=f"{m}-r1", model=m, profile="default", engine="fake",
                                     url=f"http://127.0.0.1:1/{m}") for m in serving])
    waker, metrics = Waker(), RouterMetrics(process=False)
    parts = Rerouting(balancer=balancer, policies=Policies(balancer), cold=ColdStart(waker), metrics=metrics,
                      surface=SimpleNamespace(unplaceable={}))
    return parts, waker, metrics


def call(**fields):
    base = dict(view=View(CATALOG), api_key=None, route=routes.BY_PATH["/v1/chat/completions"], model="a",
                fallback_from="", echo_as="", chooser=None, body=b"", request=SimpleNamespace(headers={}))
    return SimpleNamespace(**{**base, **fields})


def fallbacks_counted(metrics, model, fallback, reason):
    return metrics.registry.get_sample_value("llmgw_router_fallbacks_total",
                                             {"model": model, "fallback": fallback, "reason": reason})


@pytest.mark.parametrize("body,expected", [
    (b'{"model":"alias","messages":[]}', b'{"model":"b","messages":[]}'),
    # Only the model's value changes: spacing, order and other keys stay as sent.
    (b'{ "messages" : [ ], "model" :  "alias" , "n":1}', b'{ "messages" : [ ], "model" :  "b" , "n":1}'),
    (b'{"messages":[{"model":"inner"}],"model":"alias"}', b'{"messages":[{"model":"inner"}],"model":"b"}'),
])
def test_a_body_is_renamed_in_place_with_or_without_its_parse(body, expected):
    assert renamed(body, None, "model", "b") == expected
    assert renamed(body, jsonbody.parse(body, "model", 64), "model", "b") == expected


def test_a_body_not_in_utf8_is_re_encoded_whole_with_the_new_name():
    body = json.dumps({"model": "alias", "messages": ["é"]}).encode("utf-16")
    assert json.loads(renamed(body, None, "model", "b")) == {"model": "b", "messages": ["é"]}


def test_a_lone_surrogate_is_refused_not_renamed():
    with pytest.raises(Refused) as refused:
        renamed(b'{"model":"alias","messages":["\\ud800"]}', None, "model", "b")
    assert refused.value.response.status == 400


def test_at_start_a_down_model_falls_back_and_is_woken_and_the_alias_is_no_longer_echoed():
    parts, waker, metrics = rerouting("b")
    c = call(echo_as="alias")
    assert parts.at_start(c, CATALOG.resolve("a"), ("b",)).name == "b"
    assert (c.model, c.fallback_from, c.echo_as) == ("b", "a", "")
    assert waker.woken == ["a"]
    assert fallbacks_counted(metrics, "a", "b", "down") == 1


def test_at_start_a_model_with_room_keeps_its_request():
    parts, waker, metrics = rerouting("a", "b")
    c = call(echo_as="alias")
    assert parts.at_start(c, CATALOG.resolve("a"), ("b",)).name == "a"
    assert (c.model, c.fallback_from, c.echo_as) == ("a", "", "alias")
    assert waker.woken == []


def test_after_refusals_the_fallback_gets_the_renamed_body_its_endpoint_and_its_own_policy():
    parts, _, metrics = rerouting("b")
    stale = object()        # the model's chooser, built for the model's endpoints
    c = call(echo_as="alias", chooser=stale)
    body, state = parts.after_refusals(c, b'{"model":"alias","messages":[]}')
    assert (body, c.body, state.replica_id) == (b'{"model":"b","messages":[]}',) * 2 + ("b-r1",)
    assert (c.model, c.fallback_from, c.echo_as) == ("b", "a", "")
    assert c.chooser is not None and c.chooser is not stale      # b's round robin, built anew
    assert fallbacks_counted(metrics, "a", "b", "down") == 1


def test_after_refusals_a_model_without_fallbacks_or_with_none_that_can_take_it_stays():
    assert rerouting("b")[0].after_refusals(call(model="b"), b'{"model":"b"}') is None
    c = call()
    assert rerouting()[0].after_refusals(c, b'{"model":"a"}') is None
    assert (c.model, c.fallback_from) == ("a", "")
