"""The fallback choice alone (router/fallback.py), table-driven, on a real balancer fed readings as the poller would.

Each model has at most one endpoint, in one of four states: absent, ejected,
full (its engine last seen queueing at the count it holds) or with room.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmgwctl.catalog import Catalog, Model, Profile
from llmgwctl.contracts import Endpoint, LoadReading
from llmgwctl.router import routes
from llmgwctl.router.auth import hash_key, parse_keys
from llmgwctl.router.balancer import Balancer
from llmgwctl.router.call import View
from llmgwctl.router.fallback import DOWN, SATURATED, UNPLACEABLE, Fallbacks


def model(name, *fallbacks):
    return Model(name=name, source=f"org/{name}", fallbacks=tuple(fallbacks),
                 profiles=(Profile(name="default", engine="fake", gpus=0),))


CATALOG = Catalog([model("a", "b", "c"), model("b"), model("c")])


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(**states: str):
    """A balancer holding an endpoint per model named, in the state given (absent when not named)."""
    balancer = Balancer(clock=Clock(), stale_after=3600)
    balancer.set_endpoints([Endpoint(replica_id=f"{m}-r1", model=m, profile="default", engine="fake",
                                     url=f"http://127.0.0.1:1/{m}") for m in states])
    for m, how in states.items():
        st = balancer.state_of(f"{m}-r1")
        if how == "full":
            balancer.record(st, LoadReading(running=2, waiting=3))
        elif how == "ejected":
            balancer.eject(st)
        else:
            assert how == "room"
    return balancer


def call(key=None):
    return SimpleNamespace(view=View(CATALOG), api_key=key, route=routes.BY_PATH["/v1/chat/completions"])


@pytest.mark.parametrize("states,unplaceable,expected", [
    ({"a": "room", "b": "room"}, False, None),                      # a answers itself
    ({"b": "room", "c": "room"}, False, ("b", DOWN)),              # the first in order
    ({"a": "ejected", "b": "room"}, False, ("b", DOWN)),           # every endpoint ejected is down
    ({"b": "full", "c": "room"}, False, ("c", DOWN)),              # room before a full one, when down
    ({"b": "full"}, False, ("b", DOWN)),                           # a full one over nothing at all
    ({"b": "room"}, True, ("b", UNPLACEABLE)),
    ({}, True, None),                                              # nothing: a's own 503 stands
    ({"a": "full", "b": "room"}, False, ("b", SATURATED)),
    ({"a": "full", "b": "full", "c": "room"}, False, ("c", SATURATED)),
    ({"a": "full", "b": "full"}, False, None),                     # full for full: a's own queue
    ({"a": "full", "b": "ejected"}, False, None),
])
def test_the_choice(states, unplaceable, expected):
    choice = Fallbacks(fleet(**states)).choose(call(), CATALOG.resolve("a"), ("b", "c"), unplaceable)
    assert (None if choice is None else (choice.model.name, choice.reason)) == expected


def test_a_fallback_the_key_may_not_use_is_skipped():
    keys = parse_keys({"keys": [{"name": "k", "sha256": hash_key("sk-" + "x" * 40), "models": ["a", "c"],
                                 "rpm": 10}]})
    key = keys.lookup("Bearer sk-" + "x" * 40)
    balancer = fleet(b="room", c="full")
    choice = Fallbacks(balancer).choose(call(key), CATALOG.resolve("a"), ("b", "c"), False)
    assert (choice.model.name, choice.reason) == ("c", DOWN)
    assert Fallbacks(fleet(b="room")).choose(call(key), CATALOG.resolve("a"), ("b", "c"), False) is None
